"""The A1111 routes' refusals say what is not done, and nothing that is: batch_size / n_iter and enable_hr run
(orchestrator/http/a1111.py), so no refusal may still claim "one image per request, no hires fix"."""
from __future__ import annotations

import pytest

from orchestrator.http.a1111 import to_spec
from orchestrator.http.common import BadRequest

STALE = ("one image per request", "no hires fix", "one image")

CASES = [  # (field, a value asking for what is not done here, the words the refusal must use)
    ("restore_faces", True, "face restoration"), ("tiling", True, "tiling"),
    ("subseed_strength", 0.5, "variation seeds"), ("styles", ["anime"], "styles"),
    ("script_name", "x/y/z plot", "scripts"), ("script_args", [1], "scripts"),
    ("alwayson_scripts", {"ControlNet": {"args": []}}, "scripts"),
    ("override_settings", {"CLIP_stop_at_last_layers": 2}, "setting overrides"),
    ("seed_resize_from_w", 512, "seed resize"), ("seed_resize_from_h", 512, "seed resize"),
    ("refiner_checkpoint", "sdxl_refiner", "refiner"), ("hr_checkpoint_name", "other.safetensors", "checkpoint"),
    ("init_images", ["aGVsbG8="], "/sdapi/v1/img2img"),
]


@pytest.mark.parametrize("field,value,words", CASES, ids=[c[0] for c in CASES])
def test_each_refusal_names_what_is_not_done(field, value, words):
    with pytest.raises(BadRequest) as e:
        to_spec({"prompt": "a girl", field: value})
    body = e.value.body
    assert e.value.status == 422 and body["field"] == field, body
    assert words in body["error"], body
    assert not any(s in body["error"] for s in STALE), body


def test_batches_and_hires_are_not_refused_by_the_request_check():
    spec = to_spec({"prompt": "a girl", "batch_size": 3, "n_iter": 2, "enable_hr": True})
    assert spec["prompt"] == "a girl"
