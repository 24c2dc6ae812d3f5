"""The ways out name a job's files from orchestrator/engine/job_files.py's table: /view serves its kept results, /history
lists a batch's images under the names the plan writes them."""
from __future__ import annotations

from types import SimpleNamespace

from orchestrator.http import comfy_shapes, files
from orchestrator.engine.job_files import JOB_FILES, batch_name, names
from protocol.prompt import MAX_BATCH


def test_view_serves_the_kept_results_of_the_table_and_nothing_else():
    kept = {n for f in JOB_FILES if f.kept for n in names(f)}
    assert set(files.ALLOWED) <= kept
    assert {"image.png", "image_7.png", "report.json", "timing.png"} <= set(files.ALLOWED)
    assert len([n for n in files.ALLOWED if n.startswith("image")]) == MAX_BATCH
    assert not {"job.json", "init_image.png", "mask.png"} & set(files.ALLOWED)     # inputs and the record stay in
    assert {n: t for n, t in files.ALLOWED.items() if n.endswith(".json")} == {"report.json": "application/json"}


def test_history_lists_a_batchs_images_by_the_plans_names():
    for batch, want in ((None, ["image.png"]), (1, ["image.png"]), (3, ["image.png", "image_1.png", "image_2.png"])):
        job = SimpleNamespace(spec={} if batch is None else {"batch": batch})
        assert comfy_shapes.image_files(job) == want == [batch_name("image", ".png", p) for p in range(len(want))]
