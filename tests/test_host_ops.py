"""Host ops (numpy) against direct definitions and, composed into a whole forward, against the torch reference."""
from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from models.dit import host_ops as H
from models.dit.checkpoint import DiTCheckpoint
from models.dit.rope import rope_axes, rope_tables


# -- patchify / unpatchify ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("c,h,w", [(16, 8, 8), (16, 7, 9), (3, 5, 6), (16, 1, 1), (4, 64, 3)])
def test_patchify_matches_definition_and_round_trips(c, h, w):
    z = np.random.default_rng(h * 100 + w).standard_normal((c, h, w)).astype(np.float32)
    tokens, (hp, wp) = H.patchify(z)
    assert (hp, wp) == ((h + 1) // 2, (w + 1) // 2) and tokens.shape == (hp * wp, (c + 1) * 4)
    for r in range(hp):
        for q in range(wp):
            for ch in range(c + 1):
                for dy in range(2):
                    for dx in range(2):
                        # circular pad: padded row/col y wraps to y % h; channel c is the zero mask
                        want = 0.0 if ch == c else z[ch, (2 * r + dy) % h, (2 * q + dx) % w]
                        assert tokens[r * wp + q, ch * 4 + dy * 2 + dx] == want
    # out-order features (dy*2C + dx*C + ch) from the same tokens -> unpatchify must give z back exactly
    out = np.empty((hp * wp, c * 4), np.float32)
    for ch in range(c):
        for dy in range(2):
            for dx in range(2):
                out[:, dy * 2 * c + dx * c + ch] = tokens[:, ch * 4 + dy * 2 + dx]
    back = H.unpatchify(out, hp, wp, h, w, c)
    assert back.shape == (c, h, w)
    np.testing.assert_array_equal(back, z)


def test_unpatchify_rejects_wrong_shape():
    with pytest.raises(ValueError, match="expected"):
        H.unpatchify(np.zeros((4, 64), np.float32), 2, 3, 4, 6, 16)


# -- RoPE ------------------------------------------------------------------------------------------------------------------
def test_rope_axes():
    assert rope_axes(128) == (44, 42, 42)
    assert rope_axes(64) == (24, 20, 20)


@pytest.mark.parametrize("hp,wp,hd", [(4, 6, 128), (3, 5, 64)])
def test_rope_tables_direct_formula(hp, wp, hd):
    cos, sin = rope_tables(hp, wp, hd)
    assert cos.shape == sin.shape == (hp * wp, hd // 2) and cos.dtype == np.float32
    n_hw = (hd // 6) * 2
    n_t = hd - 2 * n_hw
    theta_hw = 10000.0 * 4.0 ** (n_hw / (n_hw - 2))
    if hd == 128:
        assert abs(theta_hw - 42870.94) < 0.01
    for i in range(hp):
        for j in range(wp):
            for k in range(hd // 2):
                if k < n_t // 2:
                    phi = 0.0                                              # frame 0
                elif k < n_t // 2 + n_hw // 2:
                    phi = i * theta_hw ** (-2 * (k - n_t // 2) / n_hw)
                else:
                    phi = j * theta_hw ** (-2 * (k - n_t // 2 - n_hw // 2) / n_hw)
                assert abs(cos[i * wp + j, k] - math.cos(phi)) < 2e-7
                assert abs(sin[i * wp + j, k] - math.sin(phi)) < 2e-7


def test_timestep_sinusoid_cos_first():
    e = H.timestep_sinusoid(0.5, 8)
    f = [math.exp(-math.log(10000) * k / 4) for k in range(4)]
    np.testing.assert_allclose(e, [math.cos(0.5 * x) for x in f] + [math.sin(0.5 * x) for x in f], rtol=1e-6)


def test_gate_residual_f16_branch_output_fp32_residual():
    x = np.full((2, 3), 1e4, np.float32)
    y = np.array([[1.5, -2.0, 0.25]] * 2, np.float16)
    out = H.gate_residual(x, np.float32(0.5), y)
    assert out is x and out.dtype == np.float32
    np.testing.assert_array_equal(out[0], [10000.75, 9999.0, 10000.125])


def test_host_path_imports_no_torch():
    code = ("import sys, models.dit.host_ops, models.dit.rope, models.dit.checkpoint, models.dit.synth; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- numpy branch math for the composed forward (written here, apart from both the reference and the graphs) -------------
def _rms(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * w


def _mha(q, k, v, hd):
    L, S = q.shape[0], k.shape[0]
    q, k, v = (t.reshape(-1, t.shape[1] // hd, hd).transpose(1, 0, 2) for t in (q, k, v))   # [H, *, hd]
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)                                               # [H, L, S]
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(1, 0, 2).reshape(L, -1)


def _rope(t, cos, sin, hd):
    t = t.reshape(t.shape[0], -1, hd)                       # [L, H, hd]
    a, b = t[..., : hd // 2], t[..., hd // 2:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([a * c - b * s, b * c + a * s], -1).reshape(t.shape[0], -1)


def _np_self(w, xn, cos, sin, hd):
    q = _rms((xn @ w["q_proj.weight"].T).reshape(len(xn), -1, hd), w["q_norm.weight"]).reshape(len(xn), -1)
    k = _rms((xn @ w["k_proj.weight"].T).reshape(len(xn), -1, hd), w["k_norm.weight"]).reshape(len(xn), -1)
    return _mha(_rope(q, cos, sin, hd), _rope(k, cos, sin, hd), xn @ w["v_proj.weight"].T, hd) @ w["output_proj.weight"].T


def _np_cross(w, xn, ctx, hd):
    q = _rms((xn @ w["q_proj.weight"].T).reshape(len(xn), -1, hd), w["q_norm.weight"]).reshape(len(xn), -1)
    k = _rms((ctx @ w["k_proj.weight"].T).reshape(len(ctx), -1, hd), w["k_norm.weight"]).reshape(len(ctx), -1)
    return _mha(q, k, ctx @ w["v_proj.weight"].T, hd) @ w["output_proj.weight"].T


def _erf(x):
    """Abramowitz & Stegun 7.1.26 in float64 (|error| < 1.5e-7): numpy has no erf and scipy is not a dependency."""
    x = x.astype(np.float64)
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.sign(x) * (1.0 - poly * np.exp(-x * x))


def _np_ffn(w, xn):
    h = xn @ w["layer1.weight"].T
    return (0.5 * h * (1 + _erf(h / np.sqrt(2)))).astype(np.float32) @ w["layer2.weight"].T


def _cos(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def ckpt(tiny_dit):
    # One torch thread: these matmuls are tiny, and on a shared 2-core machine thread spin-waits cost 5x.
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield DiTCheckpoint.open(tiny_dit)
    torch.set_num_threads(n)


@pytest.mark.parametrize("h,w,sigma", [(16, 16, 0.7), (11, 14, 0.05)])
def test_composed_host_forward_matches_reference(ckpt, h, w, sigma):
    from models.dit.reference import reference_forward
    cfg = ckpt.config
    rng = np.random.default_rng(3)
    x = rng.standard_normal((cfg.latent_channels, h, w)).astype(np.float32)
    ctx = rng.standard_normal((40, cfg.context_dim)).astype(np.float32)
    ctx[30:] = 0.0                                          # zero-padded rows take part (no mask)
    v_ref, trace = reference_forward(ckpt, x, sigma, ctx, trace=True)
    assert len(trace) == cfg.blocks

    hw = ckpt.host_weights()
    assert set(hw) == set(H.host_keys(cfg))
    tokens, (hp, wp) = H.patchify(x)
    hs = H.embed(tokens, hw["x_embedder.proj.1.weight"])                     # [L, D]
    emb, lora = H.t_embedding(hw, sigma, cfg)
    mods = H.block_modulations(hw, emb, lora, cfg)                           # [blocks, 3, 3, D]
    assert mods.shape == (cfg.blocks, 3, 3, cfg.width)
    np.testing.assert_allclose(hs, trace.start["x"], atol=1e-5)
    np.testing.assert_allclose(lora, trace.start["adaln_lora"], atol=1e-5)
    cos, sin = rope_tables(hp, wp, cfg.head_dim)
    for i in range(cfg.blocks):
        for j, kind in enumerate(("self", "cross", "ffn")):
            shift, scale, gate = mods[i, j]
            xn = H.layernorm_modulate(hs, shift, scale)
            bw = ckpt.branch_weights(i, kind)
            if kind == "self":
                y = _np_self(bw, xn, cos, sin, cfg.head_dim)
            elif kind == "cross":
                y = _np_cross(bw, xn, ctx, cfg.head_dim)
            else:
                y = _np_ffn(bw, xn)
            if i in (0, cfg.blocks - 1):                  # branch-level agreement with the trace
                assert _cos(xn, trace[i][kind]["xn"]) >= 0.9999999
                assert _cos(y, trace[i][kind]["y"]) >= 0.9999999
            hs = H.gate_residual(hs, gate, y)
        assert _cos(hs, trace[i]["x_out"]) >= 0.9999999, f"block {i}"
    out = H.final_layer(hw, hs, emb, lora, cfg)
    v = H.unpatchify(out, hp, wp, h, w, cfg.latent_channels)
    assert v.shape == v_ref.shape == (16, h, w)
    assert np.isfinite(v).all()
    assert _cos(v, v_ref) >= 0.9999999
    assert np.abs(v - v_ref).max() <= 1e-4 * np.abs(v_ref).max()


def test_reference_branch_front_doors(ckpt):
    from models.dit import reference as R
    cfg = ckpt.config
    rng = np.random.default_rng(5)
    xn = rng.standard_normal((12, cfg.width)).astype(np.float32)
    ctx = rng.standard_normal((9, cfg.context_dim)).astype(np.float32)
    cos, sin = rope_tables(3, 4, cfg.head_dim)
    w = ckpt.branch_weights(7, "self")
    assert _cos(R.ref_self_attn(w, xn, cos, sin), _np_self(w, xn, cos, sin, cfg.head_dim)) >= 0.9999999
    w = ckpt.branch_weights(7, "cross")
    assert _cos(R.ref_cross_attn(w, xn, ctx), _np_cross(w, xn, ctx, cfg.head_dim)) >= 0.9999999
    w = ckpt.branch_weights(7, "ffn")
    y = R.ref_ffn(w, xn)
    assert y.shape == (12, cfg.width) and _cos(y, _np_ffn(w, xn)) >= 0.9999999
