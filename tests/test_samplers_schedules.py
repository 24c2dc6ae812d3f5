"""Schedulers against ComfyUI's, the Beta quantile against scipy, the Brownian tree against torchsde, the noise stream
against torch.

tests/data/samplers/comfy_schedules.npz: an unmodified ComfyUI's KSampler(...).sigmas for Anima (ModelSamplingAuraFlow
shift 3) for every scheduler and 1, 2, 3, 6, 15, 20, 30, 50 steps, with sampler euler and uni_pc (which discards the
penultimate sigma), and its 1000-entry sigma table.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch
import torchsde

from models.sampling.brownian import BrownianTreeNoise
from models.sampling.k_sampling import ksampler_sigmas
from models.sampling.noise import TorchCpuGenerator
from models.sampling.schedules import SCHEDULER_NAMES, beta_ppf, make_sigmas, sigma_table

REF = np.load(Path(__file__).parent / "data" / "samplers" / "comfy_schedules.npz")
KEYS = sorted(k for k in REF.files if k != "table")


def test_sigma_table_is_comfyuis():
    np.testing.assert_allclose(sigma_table().astype(np.float32), REF["table"], rtol=2e-7, atol=0)


@pytest.mark.parametrize("key", KEYS)
def test_schedule_equals_comfyui(key):
    name, steps, sampler = key.split("/")
    steps = int(steps)
    want = REF[key]
    if not np.isfinite(want).all():                 # ComfyUI's kl_optimal for 1 step: 0/0
        assert (name, steps, sampler) == ("kl_optimal", 1, "euler")
        with pytest.raises(ValueError, match="kl_optimal needs at least 2 steps"):
            make_sigmas(name, steps)
        return
    got = ksampler_sigmas(sampler, name, steps)
    assert got.dtype == np.float32 and got.shape == want.shape
    # ComfyUI computes in float32 torch ops, this in float64 rounded once: a few ulp apart at most
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def test_all_nine_schedulers_are_in_the_reference():
    assert {k.split("/")[0] for k in KEYS} == set(SCHEDULER_NAMES)


def test_unknown_schedule_is_refused_naming_the_ones_there_are():
    with pytest.raises(ValueError, match=r"unknown scheduler 'Karras'; choose one of \['simple', 'sgm_uniform', 'karras'"):
        make_sigmas("Karras", 6)
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        make_sigmas("karras", 0)


@pytest.mark.parametrize("q", [1e-9, 0.01, 0.1, 1 / 3, 0.5, 0.77, 0.95, 1 - 1e-7])
@pytest.mark.parametrize("ab", [(0.6, 0.6), (0.5, 0.7), (2.0, 3.0)])
def test_beta_quantile_equals_scipy(q, ab):
    assert beta_ppf(q, *ab) == pytest.approx(scipy.stats.beta.ppf(q, *ab), rel=1e-11, abs=1e-14)


@pytest.mark.parametrize("seed,sigmas", [
    (7, [0.99970, 0.8, 0.6, 0.3, 0.1, 0.0029940]),
    (2**40 + 3, [0.99970, 0.95, 0.41, 0.2, 0.05]),
    (0, [1.0, 0.5, 0.012, 0.0029940]),
])
def test_brownian_noise_equals_torchsde(seed, sigmas):
    """ComfyUI's BrownianTreeNoiseSampler(cpu=True): torchsde.BrownianTree(t0, zeros, t1, entropy=seed), queried
    per step and scaled by 1/sqrt(|dt|)."""
    shape = (1, 16, 1, 4, 8)
    smin, smax = min(s for s in sigmas if s > 0), max(sigmas)
    t0, t1 = torch.tensor(smin, dtype=torch.float32), torch.tensor(smax, dtype=torch.float32)
    tree = torchsde.BrownianTree(t0, torch.zeros(shape), t1, entropy=seed)
    ours = BrownianTreeNoise(shape, smin, smax, seed)
    for a, b in zip(sigmas[:-1], sigmas[1:]):
        ta, tb = torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
        with np.errstate(all="ignore"), torch.no_grad():
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")           # torchsde warns when a query sits on a rounded end
                want = (tree(tb, ta) * -1 / (tb - ta).abs().sqrt()).numpy()
        got = ours(a, b)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
        assert 0.5 < float(got.std()) < 1.5


def test_brownian_noise_does_not_depend_on_query_order():
    shape = (1, 16, 4, 4)
    a = BrownianTreeNoise(shape, 0.003, 1.0, 5)
    b = BrownianTreeNoise(shape, 0.003, 1.0, 5)
    first = a(0.9, 0.5)
    b(0.2, 0.1)
    b(0.6, 0.55)
    np.testing.assert_array_equal(b(0.9, 0.5), first)


def test_noise_stream_equals_successive_torch_randn():
    g = TorchCpuGenerator(1234 + 1)
    tg = torch.Generator().manual_seed(1234 + 1)
    for shape in [(1, 16, 1, 4, 4), (1, 16, 1, 4, 4), (3, 7), (2, 16, 8)]:
        np.testing.assert_allclose(g.randn(shape), torch.randn(shape, generator=tg).numpy(), rtol=0, atol=5e-7)
    state = g.state()
    a = g.randn((16, 8))
    np.testing.assert_array_equal(TorchCpuGenerator.from_state(state).randn((16, 8)), a)
    with pytest.raises(ValueError, match="mt_key"):
        TorchCpuGenerator.from_state({"mt_key": np.zeros(5, np.int64), "mt_pos": np.array([0])})
