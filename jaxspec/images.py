"""Images for vision-language targets: read (paths, arrays, PIL images), resized and normalised
as the model's processor configuration says (`preprocessor_config.json`), with PIL and numpy."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from jaxspec.errors import UserError


@dataclasses.dataclass(frozen=True)
class Preprocess:
    """How a model's images are prepared: resized to `size` x `size` with PIL's `resample`
    filter, scaled by `rescale`, then (x - mean) / std per channel."""

    size: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: int = 2  # PIL.Image.Resampling.BILINEAR

    @classmethod
    def from_hf(cls, d: dict, image_size: int) -> "Preprocess":
        """From a `preprocessor_config.json` dict; `image_size` (the vision config's) when it
        gives no size."""
        if d.get("do_pan_and_scan"):
            raise UserError("pan-and-scan preprocessing (several crops per image) is not "
                            "supported: set do_pan_and_scan to false")
        size = d.get("size") or {}
        h, w = size.get("height", image_size), size.get("width", image_size)
        if h != w or h != image_size:
            raise UserError(f"the processor resizes to {h}x{w}, the vision encoder takes "
                            f"{image_size}x{image_size}")
        three = lambda v, default: tuple(float(x) for x in (  # noqa: E731
            v if isinstance(v, (list, tuple)) else [v] * 3)) if v is not None else default
        return cls(int(h), three(d.get("image_mean"), cls.mean), three(d.get("image_std"),
                                                                          cls.std),
                   float(d.get("rescale_factor", cls.rescale)), int(d.get("resample", 2)))


def open_image(image):
    """A PIL image in RGB from a path, a PIL image, or an array [H, W, 3] (uint8, or floats in
    [0, 1]); a clear error for anything else or a file PIL cannot read."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise UserError(f"image {str(path)!r} does not exist")
        try:
            with Image.open(path) as im:
                im.load()
                return im.convert("RGB")
        except (UnidentifiedImageError, OSError) as e:
            raise UserError(f"image {str(path)!r} cannot be read as an image: {e}") from None
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    arr = np.asarray(image)
    if arr.ndim != 3 or arr.shape[-1] != 3:
        raise UserError(f"an image array must be [height, width, 3], got shape {arr.shape}")
    if np.issubdtype(arr.dtype, np.floating):
        if arr.min() < 0 or arr.max() > 1:
            raise UserError("a float image array must hold values in [0, 1]")
        arr = np.round(arr * 255)
    return Image.fromarray(arr.astype(np.uint8), "RGB")


def prepare(images, pre: Preprocess) -> np.ndarray:
    """Pixel arrays [N, size, size, 3] (float32) for the vision encoder."""
    out = np.empty((len(images), pre.size, pre.size, 3), np.float32)
    mean, std = np.asarray(pre.mean, np.float32), np.asarray(pre.std, np.float32)
    for i, image in enumerate(images):
        im = open_image(image).resize((pre.size, pre.size), resample=pre.resample)
        out[i] = (np.asarray(im, np.float32) * np.float32(pre.rescale) - mean) / std
    return out
