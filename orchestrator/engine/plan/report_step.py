"""The plan's last step (Report): report.json (with the job's estimate, priced here), then timing.png drawn from it by
a short child process. A failed job writes the same two files from where it stopped, once it reached a stage
(orchestrator.engine.plan.run)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

from orchestrator.engine.estimate import safe_estimate
from orchestrator.engine.job_files import REPORT_FILE, TEXT_FILE
from orchestrator.engine.plan.job_io import load_text

log = logging.getLogger("orchestrator.engine.plan")


class ReportStep:
    """The report of a job's runner (orchestrator.engine.plan.run.PlanRunner)."""

    def _step_report(self, step) -> None:
        """Report: the decoding phase closed first (the report shows it), the prompts' token counts read back when
        no step of this run set them (a resume that skipped the encoder and the denoiser), then both files."""
        self._close_phase()
        if not self.report.text and any(TEXT_FILE in s.outputs for s in self.plan.steps):
            self.report.text = load_text(self.dir / TEXT_FILE) or {}
        self.report.finished = time.time()
        self._write_report(step)

    def _write_report(self, running=None) -> None:
        """report.json (with the plan's steps and which of them ran in this run: `running` is the step writing it),
        then timing.png."""
        ran = set(self._ran) | ({running} if running is not None else set())
        if self.report.estimate is None:      # priced once, with the cache as the job found it (PlanRunner)
            self.report.estimate = safe_estimate(self.spec, self.cfg, self.d.packs, self.prompts_cached)
        self.report.plan = [{"step": s.name, "stage": s.stage, "phase": s.phase, "ran": s in ran}
                            for s in self.plan.steps]
        self.report.write(self.dir / REPORT_FILE)
        self._timing_plot()

    def _report_whole(self) -> bool:
        """report.json as this step wrote it: readable, and its `plan` says the Report step ran (a failed job's,
        written where it stopped, is not: a resume that gets further writes it again)."""
        rep = load_text(self.dir / REPORT_FILE)
        steps = rep.get("plan") if rep is not None else None
        return isinstance(steps, list) and any(isinstance(s, dict) and s.get("step") == "Report"
                                               and s.get("ran") is True for s in steps)

    def _plots(self) -> bool:
        """timing.png is drawn ([stage.orchestrator] timing_plot_timeout_s = 0 turns it off)."""
        return bool(self.settings.timing_plot_timeout_s)

    def _timing_plot(self) -> None:
        """timing.png next to report.json, drawn by a short child process (orchestrator.engine.timing_plot): matplotlib's
        import and memory stay out of this long-lived daemon, which keeps serving while it runs. Best effort: a
        failure, a timeout or a daemon stop leaves the job as it is, without the picture."""
        if not self.report.phases or not self._plots():   # failed before any stage ran (disk, arena), or turned off
            return
        cmd = [sys.executable, "-m", "orchestrator.engine.timing_plot", str(self.dir / REPORT_FILE),
               "--parent", str(os.getpid())]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)   # stderr: our log
        except OSError as e:
            log.warning("job %s: no timing plot: %s", self.job.id, e)
            return
        deadline = time.monotonic() + self.settings.timing_plot_timeout_s
        while proc.poll() is None:
            if self.d.stopping or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                log.warning("job %s: timing plot %s", self.job.id, "stopped" if self.d.stopping else "timed out")
                return
            self.d.pump(0.05)
        if proc.returncode != 0:
            log.warning("job %s: the timing plot failed (exit %s; its message is above)", self.job.id,
                        proc.returncode)
