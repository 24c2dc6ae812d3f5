"""The scheduler's ETA: calls still to come after each branch call, checked against the whole call sequence written
out; with a constant time per call the ETA is exact."""
import pytest

from models.dit.partition import KINDS
from models.sampling.spectrum import SpectrumSettings, plan
from stages.scheduler import calls_left, eta_s


@pytest.mark.parametrize("blocks,computed", [(3, [1, 2, 3]), (28, plan(SpectrumSettings(), 20)[0]),
                                             (2, [1, 4, 7])])
def test_calls_left_counts_the_rest_of_the_sequence(blocks, computed):
    seq = [(s, b, k) for s in computed for b in range(blocks) for k in KINDS]     # what the executor will serve
    for i, (s, b, k) in enumerate(seq):
        assert calls_left(s, b, k, blocks, computed) == len(seq) - i - 1


def test_eta_is_exact_at_a_constant_rate():
    computed, blocks, per_call = [1, 2, 4], 4, 0.25
    seq = [(s, b, k) for s in computed for b in range(blocks) for k in KINDS]
    for i, (s, b, k) in enumerate(seq, start=1):
        left = calls_left(s, b, k, blocks, computed)
        assert eta_s(i, i * per_call, left) == pytest.approx((len(seq) - i) * per_call)
