"""models/sampling/latent_mix.py against a second computation in torch: LatentComposite written per row on Anima's
[1, 16, 1, h, w] latent as ComfyUI's indexing lands there (x // 8 rows down, the pasted part's first feather // 8
rows ramped (r + 1) / f, y >= 8 pasting nothing), LatentBlend as torch.lerp's complement."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models.sampling.latent_mix import LatentMixError, blend, composite, mix_image


def _rows_reference(to: torch.Tensor, frm: torch.Tensor, x: int, y: int, feather: int) -> torch.Tensor:
    """[C, h, w] latents of one size: row r of the output is `to`'s above the paste, else from's row r - x//8 mixed
    in with its ramp weight."""
    out = to.clone()
    if y // 8 >= 1:                         # the frame axis has one entry: nothing is selected
        return out
    shift, f = x // 8, feather // 8
    for r in range(shift, to.shape[1]):
        k = r - shift
        w = (k + 1) / f if f and shift and k < f else 1.0
        w = torch.tensor(w, dtype=torch.float32)
        out[:, r] = frm[:, k] * w + to[:, r] * (1 - w)
    return out


@pytest.mark.parametrize("x,y,feather", [(0, 0, 0), (8, 0, 0), (40, 0, 0), (16, 0, 24), (8, 0, 8), (0, 0, 32),
                                         (0, 8, 0), (64, 16, 16), (7, 7, 7), (255, 0, 0), (512, 0, 0)])
def test_composite_on_anima_latents_matches_the_row_reference(x, y, feather):
    rng = np.random.default_rng(x * 1000 + y * 10 + feather)
    to, frm = (rng.standard_normal((16, 32, 24), dtype=np.float32) for _ in range(2))
    got = mix_image("composite", to, frm, x=x, y=y, feather=feather)
    want = _rows_reference(torch.from_numpy(to), torch.from_numpy(frm), x, y, feather).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    if x // 8 < 32 and y < 8:               # the node changes the latent (so the test could fail)
        assert np.abs(got - to).max() > 0.1


def test_composite_of_a_smaller_latent_on_4d_axes_against_torch_indexing():
    """A smaller samples_from on an SD-style [B, C, H, W] latent, feathered on all four sides."""
    rng = np.random.default_rng(3)
    to = rng.standard_normal((2, 4, 12, 10), dtype=np.float32)
    frm = rng.standard_normal((1, 4, 5, 4), dtype=np.float32)
    got = composite(to, frm, 16, 24, 16)
    t, f = torch.from_numpy(to), torch.from_numpy(frm)
    weight_rows = torch.tensor([0.5, 1.0, 1.0, 1.0, 0.5]).view(5, 1)
    weight_cols = torch.tensor([0.5, 1.0, 1.0, 0.5]).view(1, 4)
    m = weight_rows * weight_cols
    want = t.clone()
    want[:, :, 3:8, 2:6] = f * m + t[:, :, 3:8, 2:6] * (1 - m)
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-6)


def test_composite_cannot_put_a_batch_into_one_image():
    with pytest.raises(LatentMixError, match="does not fit"):
        composite(np.zeros((1, 16, 1, 4, 4), np.float32), np.zeros((2, 16, 1, 4, 4), np.float32), 0, 0)


@pytest.mark.parametrize("factor", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_blend_is_factor_of_the_first_and_the_rest_of_the_second(factor):
    rng = np.random.default_rng(5)
    a, b = (rng.standard_normal((16, 8, 8), dtype=np.float32) for _ in range(2))
    want = torch.lerp(torch.from_numpy(b), torch.from_numpy(a), factor).numpy()
    np.testing.assert_allclose(mix_image("blend", a, b, factor=factor), want, rtol=0, atol=1e-6)
    with pytest.raises(LatentMixError, match="shape"):
        blend(a, b[:, :4], factor)


REC = np.load(__import__("pathlib").Path(__file__).parent / "data" / "comfy_latent_mix.npz")


@pytest.mark.parametrize("case", json.loads(str(REC["cases"])), ids=lambda c: c[0])
def test_each_node_gives_comfyuis_recorded_latent(case):
    """ComfyUI's own nodes on [B, 16, 1, h, w] latents (tests/data/comfy_latent_mix.npz, bench/
    comfy_latent_mix_cases.py): a batch of 2 under one image, a smaller paste, unaligned offsets, y >= 8, blends."""
    name, node, (a, b), values = case
    if node == "LatentComposite":
        got = composite(REC[a], REC[b], values["x"], values["y"], values["feather"])
    else:
        got = blend(REC[a], REC[b], values["blend_factor"])
    want = REC[f"{name}/out"]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    if name != "y8":                            # every other case changes its samples_to / samples1
        assert np.abs(want - np.broadcast_to(REC[a], want.shape)).max() > 0.1
    else:
        np.testing.assert_array_equal(got, REC[a])
