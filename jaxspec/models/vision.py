"""Gemma 3's image side: the SigLIP vision encoder and the projector into the decoder's width.

`encode` turns preprocessed images [N, H, W, 3] (`jaxspec.images`) into the embeddings that take
the places of the image tokens in the text [N, tokens_per_image, text hidden]: patches (a
strided convolution as one product), learned positions, pre-norm transformer layers with
bidirectional attention (LayerNorm with bias, biased projections, GELU-tanh MLP), a final
LayerNorm; then the projector average-pools the patch grid to `tokens_per_image`, applies
Gemma's RMSNorm and one product. Matrices are stored [out, in], as the decoder's are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.config import VisionConfig
from jaxspec.models import layers as L

_LAYER_AXES = {
    "ln1": ("vision_embed",), "ln1_b": ("vision_embed",),
    "wq": ("vision_heads", "vision_embed"), "bq": ("vision_heads",),
    "wk": ("vision_heads", "vision_embed"), "bk": ("vision_heads",),
    "wv": ("vision_heads", "vision_embed"), "bv": ("vision_heads",),
    "wo": ("vision_embed", "vision_heads"), "bo": ("vision_embed",),
    "ln2": ("vision_embed",), "ln2_b": ("vision_embed",),
    "w1": ("vision_mlp", "vision_embed"), "b1": ("vision_mlp",),
    "w2": ("vision_embed", "vision_mlp"), "b2": ("vision_embed",),
}


@dataclasses.dataclass
class Vision:
    """A vision-language model's image side (`Model.vision`): config, params, and how images are
    prepared for it (`images.Preprocess`)."""

    config: VisionConfig
    params: Any
    preprocess: Any


def param_axes(vc: VisionConfig) -> dict:
    """Logical axis names of the image side's params (`sharding.RULES` maps them)."""
    return {"patch": ("vision_embed", None), "patch_b": ("vision_embed",),
            "position": (None, "vision_embed"),
            "layers": [dict(_LAYER_AXES) for _ in range(vc.num_layers)],
            "post_ln": ("vision_embed",), "post_ln_b": ("vision_embed",),
            "mm_norm": ("vision_embed",), "mm_proj": ("embed", "vision_embed")}


def param_shapes(vc: VisionConfig, text_hidden: int) -> dict:
    dims = {"vision_embed": vc.hidden_size, "vision_heads": vc.hidden_size,
            "vision_mlp": vc.intermediate_size, "embed": text_hidden}
    fixed = {"patch": (vc.hidden_size, 3 * vc.patch_size ** 2),
             "position": (vc.patches_per_side ** 2, vc.hidden_size)}
    shapes = jax.tree.map(lambda names: tuple(dims.get(n) for n in names), param_axes(vc),
                          is_leaf=lambda x: isinstance(x, tuple))
    return {**shapes, **fixed}


def init_params(vc: VisionConfig, text_hidden: int, key, std: float = 0.02) -> dict:
    """Random params: normal(std) matrices, unit norms, zero biases (tests, benchmarks)."""
    shapes = param_shapes(vc, text_hidden)
    flat, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = path[-1].key
        if name in ("ln1", "ln2", "post_ln", "mm_norm"):
            leaves.append(jnp.ones(shape))
        elif name.endswith("_b") or (name.startswith("b") and len(shape) == 1):
            leaves.append(jnp.zeros(shape))
        else:
            leaves.append(std * jax.random.normal(k, shape))
    return jax.tree.unflatten(treedef, leaves)


def _layer_norm(x, w, b, eps: float):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


def _dense(x_NxPxD, w_FxD, b_F=None):
    """`layers.linear` (every weight product goes through it), plus a bias."""
    y = L.linear(x_NxPxD, w_FxD)
    return y if b_F is None else y + b_F.astype(jnp.float32)


def _encoder_layer(x_NxPxD, lp, vc: VisionConfig):
    N, P, D = x_NxPxD.shape
    heads = lambda y: y.reshape(N, P, vc.num_heads, vc.head_dim)  # noqa: E731
    h = _layer_norm(x_NxPxD, lp["ln1"], lp["ln1_b"], vc.layer_norm_eps)
    q, k, v = (heads(_dense(h, lp[w], lp[b])) for w, b in (("wq", "bq"), ("wk", "bk"),
                                                           ("wv", "bv")))
    scores_NxQxPxP = jnp.einsum("NSQH,NTQH->NQST", q, k) * vc.head_dim ** -0.5
    attn = jnp.einsum("NQST,NTQH->NSQH", jax.nn.softmax(scores_NxQxPxP, axis=-1), v)
    x_NxPxD = x_NxPxD + _dense(attn.reshape(N, P, D), lp["wo"], lp["bo"])
    h = _layer_norm(x_NxPxD, lp["ln2"], lp["ln2_b"], vc.layer_norm_eps)
    h = jax.nn.gelu(_dense(h, lp["w1"], lp["b1"]), approximate=True)
    return x_NxPxD + _dense(h, lp["w2"], lp["b2"])


def encode(params, vc: VisionConfig, pixels_NxHxWx3):
    """Image embeddings in the decoder's width [N, tokens_per_image, text hidden] (float32)."""
    N, S, p, G = pixels_NxHxWx3.shape[0], vc.image_size, vc.patch_size, vc.patches_per_side
    if pixels_NxHxWx3.shape[1:] != (S, S, 3):
        raise ValueError(f"images must be [N, {S}, {S}, 3], got {pixels_NxHxWx3.shape}")
    # Patches in the convolution's order: (channel, row, column) within a patch.
    patches = pixels_NxHxWx3.astype(jnp.float32).reshape(N, G, p, G, p, 3)
    patches_NxPxC = patches.transpose(0, 1, 3, 5, 2, 4).reshape(N, G * G, 3 * p * p)
    x_NxPxD = (_dense(patches_NxPxC, params["patch"], params["patch_b"])
               + params["position"].astype(jnp.float32))
    for lp in params["layers"]:
        x_NxPxD = _encoder_layer(x_NxPxD, lp, vc)
    x_NxPxD = _layer_norm(x_NxPxD, params["post_ln"], params["post_ln_b"], vc.layer_norm_eps)
    side = round(vc.tokens_per_image ** 0.5)
    k = G // side  # the pooling window
    pooled = x_NxPxD.reshape(N, side, k, side, k, -1).mean(axis=(2, 4))
    pooled_NxMxD = pooled.reshape(N, vc.tokens_per_image, -1)
    normed = L.rms_norm(pooled_NxMxD, params["mm_norm"], vc.layer_norm_eps)
    return _dense(normed, params["mm_proj"])
