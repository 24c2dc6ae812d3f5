"""The front's memory for image work at once (uploads checked by decoding, A1111 img2img's decoding, resizing,
blurring and paste-back), bounded in bytes rather than in requests: each request's cost is estimated from its
images' headers (models.images.image_size: nothing decoded yet) and taken from BUDGET_BYTES before the heavy work;
a request that does not fit beside the ones under way is 503 with Retry-After (a client sends it again).

    cost = img2img_cost(init=(w, h), mask=(w, h) or None, job=(w, h), raw_bytes=n, full_res=True)
    with BUDGET.hold(cost, "img2img"):      # BadRequest 503 + Retry-After when it does not fit now
        ...the work...
    async with BUDGET.wait_hold(cost, "paste-back"):    # waits for room (a job's result is not refused)

The estimates are upper bounds of the Python heap and Pillow's image memory a request's work reaches, per pixel of
each picture (measured: tests/test_image_budget.py runs the worst shapes in a fresh process and checks VmHWM's rise
against them). A request whose estimate passes the whole budget can never fit: 413 naming its size.
"""
from __future__ import annotations

import asyncio
import contextlib

from orchestrator.http.common import refuse
from stages.memory import return_freed_memory

# the largest request fits alone (4096² init + mask, only masked, a 32 MB body: ~570 MB estimated, 332 measured);
# the front idles at ~60-100 MB, so its peak stays under bench/fuzz_http.py's bound of 1000 MB
BUDGET_BYTES = 576 * 2**20
RETRY_AFTER_S = 10              # what a request past the budget is told to wait
# bytes a pixel, upper bounds of what was measured (4096² images, VmHWM's rise in a fresh process: an RGB init image
# 7.7; RGBA init + mask 15; the same only masked at a 1024² job 19.8; at 2048², 16 and 27.6: fixed costs weigh
# more). Pillow keeps RGB/RGBA at 4 bytes a pixel.
DECODE_PX = 8                   # a decoded picture and its one copy (open_bounded: EXIF orientation applied)
INIT_PX = 10                    # img2img's init image: decoded, copied, converted to 8-bit RGB, and its PNG
MASK_PX = 8                     # its mask: an RGBA mask decoded and copied, its alpha, the 8-bit mask
FULL_RES_PX = 10                # only masked: the mask blurred and its overlay at full size, the region cut out
JOB_PX = 12                     # at the job's size: the fitted images, the fill's blurred RGBA layers, the PNGs
PASTE_PX = 30                   # paste-back: the original as RGBA and RGBa, its layer and the result at full size
RAW = 3                         # a file's bytes: the request's, Pillow's copy, the PNG written


def img2img_cost(init: tuple, mask: tuple | None, job: tuple, raw_bytes: int, full_res: bool) -> int:
    """Bytes A1111 img2img's preparation may hold at once for an init image of `init` pixels (w, h), its mask,
    the job's size and the images' file bytes; `full_res`: only masked (both kept whole)."""
    px = init[0] * init[1]
    cost = INIT_PX * px + JOB_PX * job[0] * job[1] + RAW * raw_bytes
    if mask is not None:
        cost += MASK_PX * mask[0] * mask[1] + (FULL_RES_PX * px if full_res else 0)
    return cost


def paste_cost(init: tuple, job: tuple) -> int:
    """Bytes the paste-back of a job's image over its full-size original holds."""
    return PASTE_PX * init[0] * init[1] + JOB_PX * job[0] * job[1]


def decode_cost(size: tuple, raw_bytes: int, images: int = 1) -> int:
    """Bytes decoding `images` pictures of `size` (an upload's check; /upload/mask's original and mask) holds."""
    return images * DECODE_PX * size[0] * size[1] + RAW * raw_bytes


class ImageBudget:
    """Bytes of image work under way in this front (one process, one event loop: no lock needed)."""

    def __init__(self, total: int = BUDGET_BYTES):
        self.total, self.used = total, 0

    @contextlib.contextmanager
    def hold(self, nbytes: int, what: str):
        if nbytes > self.total:
            raise refuse(413, f"{what}: its images need ~{nbytes >> 20} MB to prepare, over the front's "
                              f"{self.total >> 20} MB for image work; send smaller images")
        if self.used + nbytes > self.total:
            raise refuse(503, f"{what}: the front's {self.total >> 20} MB for image work is in use ({self.used >> 20} "
                              f"MB); send it again in {RETRY_AFTER_S} s", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.used += nbytes
        try:
            yield
        finally:
            self._release(nbytes)

    @contextlib.asynccontextmanager
    async def wait_hold(self, nbytes: int, what: str):
        """`hold`, waiting for room instead of a 503: for work whose request must not fail now (a job's image is
        pasted back after the job ran)."""
        while self.used and self.used + nbytes > self.total:
            await asyncio.sleep(WAIT_S)
        self.used += nbytes
        try:
            yield
        finally:
            self._release(nbytes)

    def _release(self, nbytes: int) -> None:
        """The request's bytes back; the pages its work freed handed back to the OS (glibc keeps them in the worker
        thread's malloc arena otherwise: each of the pool's threads would keep its largest request's worth)."""
        self.used -= nbytes
        return_freed_memory()


WAIT_S = 0.05
BUDGET = ImageBudget()
