"""Image operations after decoding (the daemon alone, no stage): CropImage, ComfyUI's ImageCrop of a decoded PNG,
written as the job's image with the PNG's text chunks (its ComfyUI graph, A1111's parameters) kept."""
from __future__ import annotations

import io

from models.base.durable import atomic_write
from models.images.crop import crop_box
from orchestrator.engine.stage_control import StageFailed


class ImageSteps:
    """The image operations of a job's runner (orchestrator.engine.plan.run.PlanRunner)."""

    def _step_crop_image(self, step) -> None:
        """CropImage: decoded.png (decoded_N.png) cut by the job's `crop` into image.png (image_N.png), atomically; a
        resume cuts the same PNG the same way (bitwise)."""
        from PIL import Image
        from PIL.PngImagePlugin import PngInfo
        src, c = self.dir / step.inputs[0], self.spec.crop
        try:
            with Image.open(src) as im:
                im.load()
                text = dict(im.text)
                cut = im.crop(crop_box(im.width, im.height, c.x, c.y, c.width, c.height))
        except (OSError, ValueError) as e:       # torn or removed: decoded again by a resume
            raise StageFailed("orchestrator", f"{src} is unusable ({e}); resume the job to decode it again") from None
        info = PngInfo()
        for key, value in text.items():
            info.add_text(key, value)
        buf = io.BytesIO()
        cut.save(buf, format="PNG", pnginfo=info)
        atomic_write(self.dir / step.outputs[0], buf.getvalue())
