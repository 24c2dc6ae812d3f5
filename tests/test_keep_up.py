"""The encoder and the VAE left up between uses (orchestrator/engine/keep_up.py, `[stage.orchestrator] keep_up`): the
policy the board model gives per board RAM, and through the real pipeline on the 8 GB board (`auto`: idle) the VAE
that decoded one job encoding the next job's init image without a start, while neither stage is ever up during a
denoise (report.json's stage_starts and teardown record, supervisord's states, the daemon log)."""
from __future__ import annotations

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from orchestrator.engine import keep_up

# ------------------------------------------------------------------ the policy


def _cfg(tmp_path, ram: int, extra: str = ""):
    from stages.config import load_config
    toml = tmp_path / f"p{ram}.toml"
    toml.write_text(f'run_dir = "."\nbackend = "board-sim"\n[stage.executor]\nboard_ram_gb = {ram}\n{extra}')
    return load_config(toml)


def test_8_gb_keeps_nothing_beside_the_dit_and_never_both_at_once(tmp_path):
    """8 GB, auto (and `always`, which the 8 GB rule turns into idle): up while nothing denoises, stopped before a
    denoise; the encoder (2,300 MiB, cost.toml) and the VAE do not fit the 2,373 MiB context budget together."""
    for setting in ("auto", "always", "idle"):
        k = keep_up.resolve(setting, _cfg(tmp_path, 8), None, (1024, 1024))
        assert k.modes == {"encoder": "idle", "vae": "idle"} and not k.together, setting
        assert k.after_use("vae") and not k.while_denoising("vae") and not k.while_denoising("encoder")
        assert k.to_stop_before("vae", ["encoder"]) == ["encoder"]
    assert keep_up.resolve("never", _cfg(tmp_path, 8), None, (512, 512)) == keep_up.NEVER
    assert not keep_up.NEVER.after_use("vae")


def test_16_gb_keeps_what_fits_beside_the_dits_contexts(tmp_path):
    """16 GB at 512x512: the board model's budget left beside auto's contexts (account.stays_up_while_denoising,
    checked here against the budget and the two resident estimates read from cost.toml) holds both stages."""
    import tomllib
    from pathlib import Path
    from models.board import account
    from orchestrator.engine.estimate import BoardSettings, evaluation
    cfg = _cfg(tmp_path, 16)
    k = keep_up.resolve("auto", cfg, None, (512, 512))
    e, _, model = evaluation(None, (512, 512), 1, 2, BoardSettings.of_config(cfg))
    left = model.context_budget_mib(16) - e.memory_mib
    j = tomllib.loads((Path(account.__file__).parent / "cost.toml").read_text())["job"]
    for stage, need in (("encoder", j["encoder_resident_mib_estimate"]), ("vae", j["vae_npu_resident_mib_estimate"])):
        assert k.modes[stage] == ("always" if left >= need else "idle")
    assert k.together
    assert keep_up.resolve("idle", cfg, None, (512, 512)).modes == {"encoder": "idle", "vae": "idle"}


def test_board_ram_is_configured_read_on_the_board_or_assumed():
    """models/board/account.board_ram: board_ram_gb wins; a MemTotal read on the board gives the largest modelled size
    of which it has 90% (the kernel keeps the rest: an 8 GB ROCK 5C shows 7.75 GiB); none read: 8 GB, assumed."""
    from models.board.account import board_ram
    gib = 2**20                                                   # kB per GiB
    assert board_ram({"board_ram_gb": 16}, 7.75 * gib) == (16, "configured: [stage.executor] board_ram_gb")
    assert board_ram({}, None) == (8, "assumed: board_ram_gb not set and not on the RK3588 board")
    for total, gb in ((7.75, 8), (7.3, 8), (11.6, 8), (15.5, 16), (23.4, 16), (31.0, 32), (62.0, 32)):
        assert board_ram({}, total * gib) == (gb, f"read: MemTotal {total:.2f} GiB"), total
    gb, basis = board_ram({}, 3.8 * gib)                          # a 4 GB board: below every modelled one
    assert gb == 8 and basis.startswith("read: MemTotal 3.80 GiB, under the smallest modelled board")


def test_auto_on_the_board_uses_the_ram_it_reads(tmp_path, monkeypatch, caplog):
    """The rknn executor on an RK3588 (a fake device tree and /proc/meminfo): keep_up auto prices the 16 GB board the
    machine's MemTotal says, exactly as a board-sim run configured with board_ram_gb = 16; the same files on a PC
    (no device tree) leave the 8 GB board assumed. The policy's record and the log say which figure was used."""
    from models.runtime import probes
    from orchestrator.engine.estimate import BoardSettings
    from stages.config import load_config
    meminfo, dt = tmp_path / "meminfo", tmp_path / "compatible"
    meminfo.write_text("MemTotal:       16252928 kB\nMemAvailable:   14000000 kB\n")      # 15.50 GiB
    monkeypatch.setattr(probes, "MEMINFO", str(meminfo))
    monkeypatch.setattr(probes, "DEVICE_TREE_COMPATIBLE", str(dt))
    toml = tmp_path / "rknn.toml"
    toml.write_text('run_dir = "."\nbackend = "rknn"\n')
    cfg = load_config(toml)
    pc, eight = keep_up.resolve("auto", cfg, None, (512, 512)), keep_up.resolve("auto", _cfg(tmp_path, 8), None,
                                                                                 (512, 512))
    assert (pc.modes, pc.together) == (eight.modes, eight.together)                       # a PC: nothing read
    assert pc.why.endswith("(8 GB board, assumed: board_ram_gb not set and not on the RK3588 board)")
    dt.write_bytes(b"radxa,rock-5b\x00rockchip,rk3588\x00")
    board = BoardSettings.of_config(cfg)
    assert (board.board_ram_gb, board.ram_basis) == (16, "read: MemTotal 15.50 GiB")
    with caplog.at_level("INFO", logger="orchestrator.engine.keep_up"):
        read = keep_up.resolve("auto", cfg, None, (512, 512))
    configured = keep_up.resolve("auto", _cfg(tmp_path, 16), None, (512, 512))
    assert (read.modes, read.together) == (configured.modes, configured.together)
    assert read.together and not keep_up.resolve("auto", _cfg(tmp_path, 8), None, (512, 512)).together
    assert read.why.endswith("(16 GB board, read: MemTotal 15.50 GiB)")
    assert configured.why.endswith("(16 GB board, configured: [stage.executor] board_ram_gb)")
    assert any("read: MemTotal 15.50 GiB" in r.getMessage() for r in caplog.records)


def test_a_bad_setting_names_the_field(tmp_path):
    from stages.settings import ConfigError
    with pytest.raises(ConfigError, match="keep_up"):
        _cfg(tmp_path, 8, '[stage.orchestrator]\nkeep_up = "sometimes"\n')


# ------------------------------------------------------------------ through the real pipeline

@pytest.fixture(scope="module")
def idle_pipeline(pipeline_assets):
    """The ONNX encoder beside the torch VAE (img2img needs its encoder half), the cache on, keep_up auto on the
    harness's 8 GB board."""
    from tests.pipeline_harness import Pipeline, board_stage_toml
    models, pack = pipeline_assets
    p = Pipeline.start(models, pack, threads=1, extra_toml=board_stage_toml(models, pack.parent, stages=("encoder",)),
                       cond_cache_mb=64, keep_up="auto")
    try:
        yield p
    finally:
        p.stop_clean()


def _png(size: tuple) -> bytes:
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    buf = io.BytesIO()
    Image.fromarray(np.stack([xx * 2, yy * 2, (xx + yy) % 256], -1).astype(np.uint8), "RGB").save(buf, "PNG")
    return buf.getvalue()


def test_the_vae_that_decoded_a_job_encodes_the_next_ones_init_image(idle_pipeline, pipeline_assets, tmp_path,
                                                                      capsys):
    from models.packs.pack import load_pack
    from orchestrator.terminal import cli
    from orchestrator.engine.inputs import save_upload
    p = idle_pipeline
    g = load_pack(pipeline_assets[1]).geometry
    save_upload(p.rf.root, "input", "keep", "init.png", _png((g.width, g.height)), overwrite=True)
    job = {"prompt": "a lighthouse at dusk", "negative_prompt": "blurry", "seed": 5, "steps": 2, "spectrum": False}
    first = p.submit(job)
    assert p.wait(first, ("done", "failed")).state == "done", p.logs()
    r1 = p.report(first)
    assert r1["stage_starts"] == {"encoder": 1, "vae": 1} and r1["keep_up"].startswith("auto: ")
    assert p.sup.info("vae").state == "RUNNING"            # kept up: nothing denoises now
    assert p.sup.info("encoder").state == "STOPPED"        # stopped before the first job's denoise
    # `orchestrator estimate` knows the cache: the first job's prompt is priced with no encoder, a new one with it
    est = {}
    for name, prompt in (("cached", job["prompt"]), ("new", "a lighthouse at dawn")):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({**job, "prompt": prompt}))
        assert cli.main(["--run", str(p.rf.root), "estimate", str(f)]) == 0
        est[name] = capsys.readouterr().out.strip().splitlines()
    assert " encode_s=0.0 " in est["cached"][-1] and any("conditioning cache" in line for line in est["cached"])
    assert " encode_s=39.0 " in est["new"][-1]             # cfg 4: both texts (cost.toml's encoder estimate)
    # the same prompt (cached: no encoder) from an init image: the VAE still up encodes it, no start; it is
    # stopped before the denoise and started again for the decode
    second = p.submit({**job, "init_image": "keep/init.png [input]", "denoise": 0.6})
    assert p.wait(second, ("done", "failed")).state == "done", p.logs()
    r2 = p.report(second)
    assert r2["encoder_started"] is False and r2["stage_starts"] == {"encoder": 0, "vae": 1}
    for r in (r1, r2):                                     # the 8 GB rule: neither up while the DiT denoises
        assert r["teardown"]["samples"] > 0
        assert not r["teardown"]["encoder_running_during_denoise"] and not r["teardown"]["vae_running_during_denoise"]
    log = "".join(f.read_text(errors="replace") for f in p.rf.logs.glob("orchestrator*.log"))
    up = [line for line in log.splitlines() if f"job {second}: vae already up, " in line]
    assert up and "keep_up auto: encoder idle, vae idle (8 GB board, assumed" in up[0], up     # x86: no board RAM read
    assert up[0].endswith(": no start"), up
    assert f"job {first}: vae kept up" in log
    assert (p.job_dir(second) / "init_latent.npy").exists()
    # a new prompt: the encoder must start; the VAE kept up since the last decode is stopped first unless the board
    # model says the two fit together (at this tiny size they do: the VAE's resident estimate scales with the pixels)
    from stages.config import load_config
    size = (g.width, g.height)
    together = keep_up.resolve("auto", load_config(p.rf.pipeline_toml), pipeline_assets[1], size).together
    assert p.sup.info("vae").state == "RUNNING"            # kept up since the second job's decode
    third = p.submit({**job, "prompt": "a lighthouse at noon"})
    assert p.wait(third, ("done", "failed")).state == "done", p.logs()
    r3 = p.report(third)
    assert r3["stage_starts"] == {"encoder": 1, "vae": 1} and r3["encoder_started"] is True
    assert not r3["teardown"]["encoder_running_during_denoise"] and not r3["teardown"]["vae_running_during_denoise"]
    log = "".join(f.read_text(errors="replace") for f in p.rf.logs.glob("orchestrator*.log"))
    mine = [line for line in log.splitlines() if third in line]
    assert (f"job {third}: vae stopped before encoder starts" in log) == (not together), "\n".join(mine)


# ------------------------------------------------------------------ StageControl's part, on a stand-in supervisord

class _Sup:
    """supervisord as StageControl asks it: programs' states (a pid above pid_max: no process to sample), and the
    stops asked for, in order."""

    def __init__(self, live: set):
        self.live, self.stops = set(live), []

    def info(self, name: str):
        from orchestrator.engine.supervisor import ProcInfo
        up = name in self.live
        return ProcInfo(name, "RUNNING" if up else "STOPPED", 4_194_399 if up else 0, 0, "", "", 0.0)

    def stop(self, name: str, timeout_s: float = 0.0, sleep=None):
        self.stops.append(name)
        self.live.discard(name)


def _control(sup: _Sup, keep: keep_up.KeepUp):
    from orchestrator.engine.report import JobReport
    from orchestrator.engine.stage_control import StageControl
    settings = SimpleNamespace(keep_up="never", stop_timeout_s=1.0)
    daemon = SimpleNamespace(sup=sup, cfg=SimpleNamespace(is_remote=lambda name: False), settings=settings,
                             pump=lambda s: None)
    c = StageControl(daemon, SimpleNamespace(id="j"), JobReport("j", {}))
    c.keep = keep
    return c


def test_stage_control_keeps_stops_before_another_and_before_denoise():
    idle = keep_up.KeepUp({"encoder": "idle", "vae": "idle"}, False, "test")
    sup = _Sup({"vae"})
    c = _control(sup, idle)
    c.bring_down("vae")                                      # its phase over: kept up
    assert sup.stops == [] and c._held("vae")
    c._stop_held("encoder")                                  # the encoder starts: the two do not fit together
    assert sup.stops == ["vae"]
    sup.live.add("encoder")
    c._stop_held("vae")
    assert sup.stops == ["vae", "encoder"]
    sup.live |= {"encoder", "vae"}
    c.tear_down_on_demand()                                  # before DENOISE: nothing idle stays up
    assert set(sup.stops[2:]) == {"encoder", "vae"} and not sup.live
    # together: nothing stopped before a start; `always`: kept through the denoise; `never`: stopped after use
    sup = _Sup({"vae", "encoder"})
    c = _control(sup, keep_up.KeepUp({"encoder": "idle", "vae": "always"}, True, "test"))
    c._stop_held("encoder")
    c.tear_down_on_demand()
    assert sup.stops == ["encoder"] and sup.live == {"vae"}
    sup = _Sup({"vae"})
    c = _control(sup, keep_up.NEVER)
    c.bring_down("vae")
    assert sup.stops == ["vae"] and not c._held("vae")
