"""Images a job starts from: bounded decoding of uploaded files into float arrays (ComfyUI's LoadImage and
LoadImageMask, A1111's mask) and A1111's resize modes for an image of another size (`decode`, `fit`)."""
from models.images.decode import (CHANNELS, FORMATS, MAX_PIXELS, ImageInputError, LoadedImage, a1111_mask,
                                  a1111_mask8, image_size, load_image, load_image_mask, load_rgb8,
                                  open_bounded)
from models.images.fit import RESIZE_MODES, ImageSizeError, fit_image

__all__ = ["CHANNELS", "FORMATS", "MAX_PIXELS", "ImageInputError", "ImageSizeError", "LoadedImage", "RESIZE_MODES",
           "a1111_mask", "a1111_mask8", "fit_image", "image_size", "load_image", "load_image_mask", "load_rgb8",
           "open_bounded"]
