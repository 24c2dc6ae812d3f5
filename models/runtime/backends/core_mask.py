"""NPU core masks: the words `core_mask` / `dual_masks` / `--core-mask` take, the RKNNLite constant each one names
(rknnlite.api.RKNNLite.NPU_CORE_*), and the RK3588 NPU cores a context on it may use. NPU_CORE_0_1_2 only speeds up
conv-type ops (docs/board.md)."""
from __future__ import annotations

from typing import NamedTuple


class CoreMask(NamedTuple):
    constant: str            # the RKNNLite attribute
    cores: tuple             # the NPU cores a context on this mask may use
    spread: bool             # one context over all of `cores` at once (else one of them: `auto` takes an idle one)


CORE_MASKS = {
    "auto": CoreMask("NPU_CORE_AUTO", (0, 1, 2), False),
    "0": CoreMask("NPU_CORE_0", (0,), False),
    "1": CoreMask("NPU_CORE_1", (1,), False),
    "2": CoreMask("NPU_CORE_2", (2,), False),
    "0_1": CoreMask("NPU_CORE_0_1", (0, 1), True),
    "0_1_2": CoreMask("NPU_CORE_0_1_2", (0, 1, 2), True),
    "all": CoreMask("NPU_CORE_ALL", (0, 1, 2), True),
}


def core_mask_word(mask) -> str:
    """A core mask as written ("0_1", "NPU_CORE_0_1", " Auto ") -> its word in CORE_MASKS; ValueError naming the
    choices."""
    word = str(mask).strip().lower().removeprefix("npu_core_")
    if word not in CORE_MASKS:
        raise ValueError(f"core_mask {mask!r}: choose one of {list(CORE_MASKS)}")
    return word
