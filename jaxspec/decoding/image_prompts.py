"""Host side of prompts with images: where each image goes in a row's tokens, and the image
embeddings the target reads there.

A row's images go, in order, to its `<start_of_image>` tokens, each expanded as Gemma 3's
processor writes an image: "\\n\\n", `<start_of_image>`, `tokens_per_image` image tokens,
`<end_of_image>`, "\\n\\n" (the newlines only when the model has a tokenizer). A row without
markers gets one per image at its start (after BOS). A row that already holds image tokens
(transformers' processor's output) is taken as it is: each run of image tokens is one image.
"""

from __future__ import annotations

import os

import numpy as np

from jaxspec.errors import UserError


def per_row(images, rows: int) -> list[list]:
    """`images` as one list per prompt: one image (a path, array or PIL image) for a single
    prompt, or a list with an entry per prompt (an image, a list of them, or None)."""
    single = isinstance(images, (str, os.PathLike)) or hasattr(images, "convert") or (
        isinstance(images, np.ndarray) and images.ndim == 3)
    if single:
        images = [images]
    images = list(images)
    if len(images) != rows:
        raise UserError(f"{len(images)} image entries for {rows} prompts: give one entry "
                        f"(an image, a list of images, or None) per prompt")
    return [[] if im is None else list(im) if isinstance(im, (list, tuple)) else [im]
            for im in images]


def _newlines(model) -> list[int]:
    tok = model.tokenizer
    return [] if tok is None else list(tok("\n\n", add_special_tokens=False).input_ids)


def expand(model, ids: list[int], n_images: int) -> list[int]:
    """A row's tokens with its `n_images` images in place (module docstring)."""
    vc = model.vision.config
    runs = sum(1 for i, t in enumerate(ids) if t == vc.image_token_id
               and (i == 0 or ids[i - 1] != vc.image_token_id))
    if runs:
        if runs != n_images:
            raise UserError(f"a prompt holds {runs} images' tokens but {n_images} images were "
                            f"given")
        return ids
    marks = [i for i, t in enumerate(ids) if t == vc.boi_token_id]
    if not marks:
        at = 1 if ids and ids[0] == model.config.bos_token_id else 0
        ids = ids[:at] + [vc.boi_token_id] * n_images + ids[at:]
        marks = list(range(at, at + n_images))
    if len(marks) != n_images:
        raise UserError(f"a prompt has {len(marks)} <start_of_image> markers but {n_images} "
                        f"images were given")
    nl = _newlines(model)
    span = nl + [vc.boi_token_id] + [vc.image_token_id] * vc.tokens_per_image \
        + [vc.eoi_token_id] + nl
    out, last = [], 0
    for i in marks:
        out += ids[last:i] + span
        last = i + 1
    return out + ids[last:]


def pixels(model, rows: list[list]) -> np.ndarray:
    """Every row's images in order, prepared for the model's vision encoder [N, S, S, 3]."""
    from jaxspec.images import prepare

    return prepare([im for row in rows for im in row], model.vision.preprocess)


def encode(vision_params, pixels_NxHxWx3, *, config):
    """Image embeddings [N, tokens_per_image, D] (jit with the `VisionConfig` static)."""
    from jaxspec.models.vision import encode as encode_images

    return encode_images(vision_params, config, pixels_NxHxWx3)


def arrange(emb_NxMxD, rows: list[list], batch: int) -> np.ndarray:
    """Each row's image embeddings in order [batch, max images * M, D] (zeros past a row's
    images and for padding rows)."""
    emb_NxMxD = np.asarray(emb_NxMxD)
    M = emb_NxMxD.shape[1]
    out = np.zeros((batch, max(1, max(map(len, rows))) * M, emb_NxMxD.shape[-1]), np.float32)
    n = 0
    for b, row in enumerate(rows):
        out[b, :len(row) * M] = emb_NxMxD[n:n + len(row)].reshape(-1, emb_NxMxD.shape[-1])
        n += len(row)
    return out


def placeholder_ids(model, placeholder) -> tuple[int, ...]:
    """The drafter's stand-in for an image: token ids, or a text (the target's tokenizer); None
    or "" drops the image."""
    if not placeholder:
        return ()
    if isinstance(placeholder, str):
        if model.tokenizer is None:
            raise UserError("a text image_placeholder needs a target with a tokenizer; give "
                            "token ids")
        return tuple(model.tokenizer(placeholder, add_special_tokens=False).input_ids)
    return tuple(int(t) for t in placeholder)
