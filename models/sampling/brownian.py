"""The Brownian-tree noise ComfyUI's DPM++ SDE samplers draw (torchsde's BrownianTree), in numpy.

ComfyUI's BrownianTreeNoiseSampler (comfy/k_diffusion/sampling.py) builds a torchsde.BrownianTree on the CPU over
[sigma_min, sigma_max] of the schedule, entropy = the job's seed, and returns for a step sigma -> sigma_next the
increment W(sigma_next) - W(sigma) divided by sqrt(|sigma_next - sigma|): unit-variance noise that is the same for a
given seed whatever the query order. Facts of torchsde's BrownianInterval (halfway_tree=True, tol=1e-6,
pool_size=24, no Levy area) that decide every bit:
- every time is rounded to 6 decimals (tol 1e-6) before it is compared or stored; the root's increment uses the
  unrounded ends: W = randn(seed_W) * sqrt(t1 - t0);
- the tree is dyadic: a node splits at round((start + end) / 2) and keeps splitting towards a query point until a
  split lands on it, so its shape and values depend only on the entropy;
- a node's four child seeds come from numpy's SeedSequence(entropy, spawn_key=(key, depth), pool_size=24)
  .generate_state(4) (W, H, left Levy, right Levy), the root's from SeedSequence(entropy, pool_size=24)
  .generate_state(3); children keys are 2·key and 2·key + 1 at depth + 1;
- a child's increment is the Brownian bridge of its parent's: left = (l/h)·W + sqrt(l·r/h)·randn(parent seed_W),
  right = W - left (l, r the parts left and right of the split, h = l + r), in float32, each torch randn seeded
  with that seed on the CPU (models.sampling.noise.comfy_noise, the same stream);
- an interval query sums the increments of the nodes that tile it, left to right.
Nothing here changes as queries are made, so a sampler resumed after any step asks again and gets the same noise:
the tree's whole state is (seed, shape, sigma_min, sigma_max).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional

import numpy as np

from models.sampling.noise import comfy_noise

TOL_DIGITS = 6           # torchsde BrownianTree's tol = 1e-6 -> round(t, 6)
POOL_SIZE = 24           # torchsde BrownianTree's pool_size
CACHE_NODES = 128        # increments kept (a 6..200-step run touches a few hundred nodes)


def _round(t: float) -> float:
    return round(t, TOL_DIGITS)


def _seeds(entropy: int, n: int, key: Optional[tuple] = None) -> np.ndarray:
    if key is None:
        return np.random.SeedSequence(entropy=entropy, pool_size=POOL_SIZE).generate_state(n)
    return np.random.SeedSequence(entropy=entropy, spawn_key=key, pool_size=POOL_SIZE).generate_state(n)


class _Node:
    __slots__ = ("start", "end", "parent", "is_left", "key", "depth", "midway", "w_seed", "left", "right")

    def __init__(self, start: float, end: float, parent: Optional["_Node"], is_left: bool, key: int, depth: int):
        self.start, self.end = _round(start), _round(end)
        self.parent, self.is_left, self.key, self.depth = parent, is_left, key, depth
        self.midway = self.w_seed = self.left = self.right = None


class BrownianTree:
    """W over [t0, t1] for one latent shape and entropy; `increment(ta, tb)` = W(tb) - W(ta) as float32 `shape`."""

    def __init__(self, t0: float, t1: float, shape, entropy: int):
        t0, t1 = float(t0), float(t1)
        if not t0 < t1:
            raise ValueError(f"Brownian tree needs t0 < t1, got {t0} and {t1}")
        self.shape = tuple(int(s) for s in shape)
        self.entropy = int(entropy)
        self.root = _Node(t0, t1, None, False, 0, 0)
        w_seed = int(_seeds(self.entropy, 3)[0])
        self._root_w = comfy_noise(w_seed, self.shape) * np.float32(math.sqrt(t1 - t0))    # shape f32
        self._cache: OrderedDict = OrderedDict()             # (key, depth) -> increment, least recently used first

    # ---- the tree --------------------------------------------------------------------------------------------------
    def _split(self, node: _Node, target: float) -> None:
        """Split `node` at its half, then its children towards `target`, until a split lands on `target`."""
        while True:
            if node.midway is None:
                node.midway = _round(0.5 * (node.end + node.start))
                node.w_seed = int(_seeds(self.entropy, 4, (node.key, node.depth))[0])
                node.left = _Node(node.start, node.midway, node, True, 2 * node.key, node.depth + 1)
                node.right = _Node(node.midway, node.end, node, False, 2 * node.key + 1, node.depth + 1)
            if target > node.midway:
                node = node.right
            elif target < node.midway:
                node = node.left
            else:
                return

    def _tile(self, ta: float, tb: float) -> list:
        """The nodes whose intervals tile [ta, tb] (rounded), left to right, splitting where needed."""
        out, stack = [], [(self.root, ta, tb)]
        while stack:
            node, a, b = stack.pop()
            if a == node.start and b == node.end:
                out.append(node)
                continue
            if node.midway is None:
                self._split(node, b if a == node.start else a)
            if b <= node.midway:
                stack.append((node.left, a, b))
            elif a >= node.midway:
                stack.append((node.right, a, b))
            else:
                stack.append((node.right, node.midway, b))          # popped after the left half
                stack.append((node.left, a, node.midway))
        return out

    def _w(self, node: _Node) -> np.ndarray:
        """The node's increment (float32 `shape`), from its parent's by the Brownian bridge."""
        chain = []
        while node.parent is not None and (node.key, node.depth) not in self._cache:
            chain.append(node)
            node = node.parent
        if node.parent is None:
            w = self._root_w
        else:
            w = self._cache[(node.key, node.depth)]
            self._cache.move_to_end((node.key, node.depth))
        for child in reversed(chain):
            p = child.parent
            h_rec = 1 / (p.end - p.start)
            l, r = p.midway - p.start, p.end - p.midway
            mean = np.float32(l) * w * np.float32(h_rec)                              # shape f32
            left = mean + np.float32(math.sqrt(l * r * h_rec)) * comfy_noise(p.w_seed, self.shape)
            w = left if child.is_left else w - left
            self._cache[(child.key, child.depth)] = w
            while len(self._cache) > CACHE_NODES:
                self._cache.popitem(last=False)
        return w

    def increment(self, ta: float, tb: float) -> np.ndarray:
        """W(tb) - W(ta) for t0 <= ta <= tb <= t1 (clamped to the tree's ends as torchsde does): float32 `shape`."""
        ta = min(max(float(ta), self.root.start), self.root.end)
        tb = min(max(float(tb), self.root.start), self.root.end)
        if ta > tb:
            raise ValueError(f"Brownian increment needs ta <= tb, got {ta} and {tb}")
        if ta == tb:
            return np.zeros(self.shape, np.float32)
        nodes = self._tile(_round(ta), _round(tb))
        w = self._w(nodes[0])
        for n in nodes[1:]:
            w = w + self._w(n)
        return w


class BrownianTreeNoise:
    """ComfyUI's BrownianTreeNoiseSampler on the CPU: `noise(sigma, sigma_next)` -> unit-variance float32 `shape`.

    sigma_min / sigma_max: the smallest non-zero and the largest sigma of the schedule (before any sampler moves its
    first sigma off 1); seed: the job's seed (no +1, unlike the Gaussian noise sampler)."""

    def __init__(self, shape, sigma_min: float, sigma_max: float, seed: int):
        lo, hi = sorted((float(np.float32(sigma_min)), float(np.float32(sigma_max))))
        self.tree = BrownianTree(lo, hi, shape, seed)

    def __call__(self, sigma: float, sigma_next: float) -> np.ndarray:
        s0, s1 = np.float32(sigma), np.float32(sigma_next)
        lo, hi, sign = (s0, s1, 1) if s0 < s1 else (s1, s0, -1)
        w = self.tree.increment(float(lo), float(hi))
        if sign < 0:
            w = -w
        return w / np.sqrt(np.abs(s1 - s0))
