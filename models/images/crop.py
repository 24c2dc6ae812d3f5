"""ComfyUI's ImageCrop (comfy_extras/nodes_images.py) as a box: x and y clamped to the image's last column and row,
the width and height cut where the image ends (a slice past the end is shorter, never an error)."""
from __future__ import annotations

MAX_CROP_SIDE = 16384           # ImageCrop's width, height, x and y bound (nodes.MAX_RESOLUTION)


def crop_box(image_w: int, image_h: int, x: int, y: int, width: int, height: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) in pixels of ImageCrop(width, height, x, y) on an image_w x image_h image."""
    left, top = min(x, image_w - 1), min(y, image_h - 1)
    return left, top, min(left + width, image_w), min(top + height, image_h)
