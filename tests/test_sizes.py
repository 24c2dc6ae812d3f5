"""Sizes as users pick them: `bundle --resolution A,B,C` builds every size; ComfyUI's /object_info and A1111's
txt2img offer the sizes with packs (the default pack's size when a request names none); a size without a pack is
refused naming the sizes there are."""
from __future__ import annotations

import shutil
import tempfile
import types
from pathlib import Path

import pytest
import requests

from orchestrator.http.comfy_graph import GraphError, graph_to_job
from orchestrator.http.comfy_nodes import ModelNames, node_table, object_info
from tests.comfy_graphs import standard_graph

ONE_MP = ((1024, 1024), (896, 1152), (1152, 896))


def test_bundle_takes_a_comma_list_of_sizes(tmp_path, monkeypatch, capsys):
    import models.setup.bundle
    from models.commands import cli
    got = []

    def build_bundle(models_dir, sizes, target, out, **kw):
        got.append(list(sizes))
        return {"sizes": [f"{w}x{h}" for w, h in sizes], "target": target, "toolkit": None}

    monkeypatch.setattr(models.setup.bundle, "build_bundle", build_bundle)
    monkeypatch.setattr(models.setup.bundle, "total_bytes", lambda data: 0)
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    base = ["bundle", "--models", str(models_dir), "--target", "none", "--out", str(tmp_path / "b")]
    assert cli.main(base + ["--resolution", "1024x1024,896x1152,1152x896"]) == 0
    assert cli.main(base + ["--resolution", "1024x1024", "--resolution", "896x1152,1152x896"]) == 0
    assert got == [list(ONE_MP), list(ONE_MP)]
    assert "1024x1024, 896x1152, 1152x896" in capsys.readouterr().out
    assert cli.main(base + ["--resolution", "1024x1024,1000x"]) == 2
    assert "'1000x'" in capsys.readouterr().err and len(got) == 2         # nothing built


def _latent_inputs(sizes) -> dict:
    info = object_info(node_table(ModelNames(sizes=tuple(sizes))))
    return {cls: info[cls]["input"]["required"] for cls in ("EmptyLatentImage", "EmptySD3LatentImage")}


def test_object_info_offers_the_sizes_with_packs():
    for cls, inputs in _latent_inputs(ONE_MP).items():
        for axis, name in enumerate(("width", "height")):
            kind, opts = inputs[name]
            assert kind == "INT" and opts["default"] == ONE_MP[0][axis], (cls, name, opts)
            # the widget's values (min + k * step up to max) are exactly the sides the packs have
            offered = set(range(opts["min"], opts["max"] + 1, opts["step"]))
            assert offered == {s[axis] for s in ONE_MP}, (cls, name, opts)
            assert all(f"{w}x{h}" in opts["tooltip"] for w, h in ONE_MP)
    # one size: that size only
    for inputs in _latent_inputs([(832, 1216)]).values():
        assert [inputs[n][1]["min"] for n in ("width", "height")] == [832, 1216]
        assert [inputs[n][1]["max"] for n in ("width", "height")] == [832, 1216]
    # no packs known (a daemon that is down): ComfyUI's own defaults
    plain = _latent_inputs(())
    assert plain["EmptyLatentImage"]["width"][1]["default"] == 512
    assert plain["EmptySD3LatentImage"]["width"][1]["default"] == 1024


@pytest.mark.parametrize("size", [(512, 512), (896, 896), (2048, 2048)])
def test_a_graph_of_another_size_is_refused_naming_the_sizes(size):
    names = ModelNames(sizes=ONE_MP)
    g = standard_graph(width=size[0], height=size[1], steps=3)
    with pytest.raises(GraphError) as e:
        graph_to_job(g, names=names, sizes=list(ONE_MP))
    text = str(e.value.body)
    assert f"{size[0]}x{size[1]} has no model pack" in text and "1024x1024, 896x1152, 1152x896" in text
    assert graph_to_job(standard_graph(width=896, height=1152, steps=3), names=names, sizes=list(ONE_MP)).spec[
        "width"] == 896


def test_the_fronts_names_carry_the_packs_sizes():
    from orchestrator.http.views import model_names
    pack = lambda w, h: types.SimpleNamespace(width=w, height=h, source_name="anima.safetensors")  # noqa: E731
    pipe = types.SimpleNamespace(packs=[pack(*s) for s in ONE_MP], models={}, loras=[])
    assert model_names(pipe).sizes == ONE_MP


def test_a1111_without_a_size_gets_the_default_pack_and_object_info_follows_the_packs():
    from tests.doubles_harness import Doubles
    sizes = [(64, 32), (64, 64)]
    root = Path(tempfile.mkdtemp(prefix="anima-sizes-"))
    d = Doubles.start(root, sizes)
    try:
        url = d.http_url()
        info = requests.get(url + "object_info/EmptyLatentImage", timeout=30).json()
        width, height = (info["EmptyLatentImage"]["input"]["required"][n][1] for n in ("width", "height"))
        assert (width["default"], height["default"]) == (64, 32) and (height["min"], height["max"]) == (32, 64)
        r = requests.post(url + "sdapi/v1/txt2img", json={"prompt": "a girl", "steps": 2, "seed": 1}, timeout=120)
        assert r.status_code == 200, r.text
        assert (r.json()["parameters"]["width"], r.json()["parameters"]["height"]) == (64, 32)
        r = requests.post(url + "sdapi/v1/txt2img", json={"prompt": "a girl", "steps": 2, "width": 512,
                                                           "height": 512}, timeout=60)
        assert r.status_code == 422 and "64x32, 64x64" in r.text and "512x512" in r.text
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
