"""bench/workflow_time.py (MODELLED board time per workflow): its model calls are the sampler's own counts, its
text-to-image job is bench/overhead.py's analytic job, and a workflow's job is its parts."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import overhead  # noqa: E402
from bench.workflow_time import HIRES, Prices, Workflow, model_calls, price  # noqa: E402
from models.board.cost import BoardModel  # noqa: E402


def test_model_calls_count_as_comfyui_and_a1111_do():
    assert model_calls("euler", "sgm_uniform", 20, False) == 20
    assert model_calls("euler", "sgm_uniform", 20, False, 0.6) == 20                 # ComfyUI: steps, whatever d
    assert model_calls("euler", "sgm_uniform", 20, False, 0.6, "a1111") == 13        # int(0.6 x 20) + 1
    assert model_calls("heun", "sgm_uniform", 20, False) == 39                       # two calls a step, one last
    assert model_calls("euler", "sgm_uniform", 20, True) == 11                       # Spectrum's computed steps


def test_text_to_image_is_the_analytic_job_and_a_hires_job_is_its_parts():
    prices = Prices(8)
    t2i = price(Workflow("t2i"), ("euler", "sgm_uniform", 20, True), prices)
    line = overhead.analytic_table(BoardModel(), ["auto"], [8], calls=11)[-1]
    assert t2i["job_s"] == float(re.search(r"job_s=([\d.]+)", line).group(1))
    hires = price(Workflow("h", hires="pixel"), ("euler", "sgm_uniform", 20, True), prices)
    parts = hires["parts_s"]
    assert set(parts) == {"encoder", "denoise", "vae decode (first pass)", "vae encode (second size)",
                          "denoise (second pass)", "vae decode"}
    assert abs(hires["job_s"] - sum(parts.values())) < 0.1
    assert parts["vae decode"] > parts["vae decode (first pass)"]          # decoded at the second size
    assert parts["denoise (second pass)"] == round(prices.denoise_s(HIRES, 11)[0], 2)
