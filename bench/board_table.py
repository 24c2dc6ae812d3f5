"""THE table of board time that bench/overhead.py and bench/board.py print (one table code): the per-step rows, a
policy's line and the job projection's notes, every line labelled measured or modelled with its time scale; the
last line of both benches is `summary_line` (an interface: other checks parse it). The rows and the projection
are models/board/account.py's."""
from __future__ import annotations

from models.board.account import Projection
from models.board.pace import scale_note


def format_rows(label: str, rows: list, time_scale: float = 1.0) -> list:
    """The per-step table: every line says what its figures are (measured / modelled) and the time scale."""
    note = f"[{label}, {scale_note(time_scale)}]"
    out = [f"{'step':>4} {'kind':<8} {'wall s':>8} {'NPU s':>8} {'lifecycle s':>11} {'host s':>7} "
           f"{'transport s':>11} {'other s':>8} {'ratio':>6}  {note}"]
    for r in rows:
        ratio = f"{r.overhead_ratio:.3f}" if r.overhead_ratio else "-"
        out.append(f"{r.step:>4} {'computed' if r.computed else 'forecast':<8} {r.wall_s:>8.2f} {r.npu_s:>8.2f} "
                   f"{r.lifecycle_s:>11.2f} {r.host_s:>7.2f} {r.transport_s:>11.3f} {r.other_s:>8.3f} {ratio:>6}  "
                   f"{note}")
    return out


POLICY_HEADER = (f"{'policy':<36} {'RAM':>4} {'step wall s':>11} {'pure NPU s':>10} {'vis. lifecycle s':>16} "
                 f"{'host s':>7} {'transport s':>11} {'overhead_ratio':>14} {'job s (CPU VAE)':>15} "
                 f"{'job s (NPU VAE est.)':>20}")


def format_policy_line(policy: str, ram_gb, p: Projection, label: str, time_scale: float = 1.0) -> str:
    """One row of the policy table (a computed step after the first, and the 20-step Spectrum job)."""
    return (f"{policy:<36} {str(ram_gb):>4} {p.step_s:>11.2f} {p.npu_step_s:>10.2f} {p.lifecycle_step_s:>16.2f} "
            f"{p.host_step_s:>7.2f} {p.transport_step_s:>11.3f} {p.overhead_ratio:>14.3f} {p.job_s:>15.1f} "
            f"{p.job_npu_vae_s:>20.1f}  [{label}, {scale_note(time_scale)}]")


def summary_line(policy: str, ram_gb, p: Projection) -> str:
    """The last line of bench/overhead.py and bench/board.py (an interface: other checks parse it; the lines above
    it say whether its figures are modelled or measured): the job with the VAE as configured (Projection.vae)."""
    return f"policy={policy} board_ram={ram_gb} overhead_ratio={p.overhead_ratio:.3f} job_s={p.configured_job_s:.1f}"


def projection_notes(p: Projection, label: str) -> list:
    """How the job figure is made (each line labelled)."""
    lines = [f"[{label}] 20-step Spectrum job = encode {p.encode_s:.1f} s (estimate) + denoise {p.denoise_s:.1f} s "
             f"(first computed step {p.first_step_s:.2f} + 10 x {p.step_s:.2f} + 9 forecast x {p.forecast_step_s:.3f})"
             f" + decode {p.decode_s:.1f} s (sd.cpp CPU VAE, reference board figure R11) = {p.job_s:.1f} s",
             f"[{label}] with the VAE on the NPU (estimate {p.decode_npu_s:.1f} s): {p.job_npu_vae_s:.1f} s"]
    lines.append(f"[{label}] the VAE as configured: {p.vae} -> job {p.configured_job_s:.1f} s (the last line's job_s)")
    return lines
