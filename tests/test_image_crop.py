"""ImageCrop: the box against ComfyUI's own ImageCrop (recorded: tests/data/comfy_image_crop.json), the graph's node
onto prompt.json's `crop` and back, the plan's CropImage step after every Decode, and the step itself on a PNG (its
text chunks kept, the pixels the decoded PNG's box, bitwise the same when run again)."""
from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from models.images.crop import crop_box
from orchestrator.http.comfy_graph import GraphError, graph_to_job, job_to_graph
from orchestrator.engine.plan.build import build_plan
from orchestrator.engine.plan.image_ops import ImageSteps
from orchestrator.engine.prompt_spec import PromptError, parse_prompt_obj
from tests.comfy_graphs import edited, standard_graph

DATA = json.loads((Path(__file__).parent / "data" / "comfy_image_crop.json").read_text())


@pytest.mark.parametrize("case", DATA["cases"], ids=lambda c: f"{c['width']}x{c['height']}+{c['x']}+{c['y']}")
def test_the_box_is_comfyuis(case):
    w, h = DATA["image"]
    left, top, right, bottom = crop_box(w, h, case["x"], case["y"], case["width"], case["height"])
    assert (left, top, right - left, bottom - top) == (case["left"], case["top"], case["out_width"],
                                                       case["out_height"])


def crop_graph(**box) -> dict:
    g = standard_graph()
    g["30"] = {"class_type": "ImageCrop", "inputs": {"image": ["8", 0], "width": 100, "height": 60, "x": 20,
                                                     "y": 16, **box}}
    g["9"]["inputs"]["images"] = ["30", 0]
    return g


def test_the_node_is_the_jobs_crop_and_back():
    job = graph_to_job(crop_graph())
    assert job.spec["crop"] == {"width": 100, "height": 60, "x": 20, "y": 16} and job.nodes["crop"] == "30"
    assert job.spec == {**graph_to_job(standard_graph()).spec, "crop": job.spec["crop"]}
    back = job_to_graph(job.spec)
    crops = [n for n in back.values() if n["class_type"] == "ImageCrop"]
    assert len(crops) == 1 and graph_to_job(back).spec["crop"] == job.spec["crop"]


def test_crops_a_job_cannot_say_are_refused_on_the_node():
    g = crop_graph()
    g["31"] = {"class_type": "ImageCrop", "inputs": {"image": ["30", 0], "width": 8, "height": 8, "x": 0, "y": 0}}
    g["9"]["inputs"]["images"] = ["31", 0]
    with pytest.raises(GraphError) as e:
        graph_to_job(g)
    assert e.value.node_errors["31"]["errors"][0]["extra_info"]["input_name"] == "image"
    with pytest.raises(GraphError) as e:
        graph_to_job(edited(crop_graph(), "30", width=0))
    assert e.value.node_errors["30"]["errors"][0]["type"] == "value_smaller_than_min"
    with pytest.raises(PromptError) as p:
        parse_prompt_obj({"prompt": "a", "crop": {"width": 8, "height": 8, "x": -1}})
    assert p.value.field == "crop.x"


def test_the_plan_cuts_after_every_decode():
    spec = parse_prompt_obj({"prompt": "a", "width": 64, "height": 64, "batch": 2,
                             "crop": {"width": 32, "height": 16}})
    names = [(s.name, s.inputs, s.outputs) for s in build_plan(spec).steps][-6:-1]
    assert names == [("Decode[0]", ("latent.npy",), ("decoded.png",)),
                     ("Decode[1]", ("latent_1.npy",), ("decoded_1.png",)),
                     ("CropImage[0]", ("decoded.png",), ("image.png",)),
                     ("CropImage[1]", ("decoded_1.png",), ("image_1.png",)),
                     ("Deliver", ("image.png", "image_1.png"), ())]
    plain = build_plan(parse_prompt_obj({"prompt": "a", "width": 64, "height": 64}))
    assert [s.name for s in plain.steps][-3:] == ["Decode[0]", "Deliver", "Report"]


def test_the_step_cuts_the_decoded_png_keeping_its_text(tmp_path):
    rgb = np.random.default_rng(3).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    info = PngInfo()
    info.add_text("prompt", '{"3": {}}')
    info.add_text("parameters", "a girl\nSteps: 2")
    Image.fromarray(rgb).save(tmp_path / "decoded.png", pnginfo=info)
    spec = parse_prompt_obj({"prompt": "a", "crop": {"width": 30, "height": 100, "x": 50, "y": 8}})
    runner = SimpleNamespace(dir=tmp_path, spec=spec)
    step = SimpleNamespace(inputs=("decoded.png",), outputs=("image.png",))
    ImageSteps._step_crop_image(runner, step)
    first = (tmp_path / "image.png").read_bytes()
    with Image.open(io.BytesIO(first)) as im:
        np.testing.assert_array_equal(np.asarray(im), rgb[8:, 50:56])      # x 50 + 30 and y 8 + 100 cut at the end
        assert im.text == {"prompt": '{"3": {}}', "parameters": "a girl\nSteps: 2"}
    ImageSteps._step_crop_image(runner, step)
    assert (tmp_path / "image.png").read_bytes() == first
    (tmp_path / "decoded.png").write_bytes(b"torn")
    from orchestrator.engine.stage_control import StageFailed
    with pytest.raises(StageFailed, match="decode it again"):
        ImageSteps._step_crop_image(runner, step)
