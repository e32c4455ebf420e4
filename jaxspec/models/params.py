"""Param layout: shapes, logical axis names, and random initialisation.

`params["layers"]` is a list with one dict per layer: the forward pass runs them unrolled, since on
XLA:CPU slicing stacked weights inside a scan copied every layer each step (a decode step took
1.5x as long). Matrices are stored [out, in] (as torch's Linear): on XLA:CPU a product streams
the weight fastest as the left operand (`layers.linear`). Norm weights hold the full multiplier
(Gemma's `1 + w` is folded in), so one `rms_norm` serves both families.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import archs
from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.models.quant import Int8

_LAYER_AXES = {
    "attn_norm": ("embed",),
    "wq": ("heads", "head_dim", "embed"),
    "wk": ("kv_heads", "head_dim", "embed"),
    "wv": ("kv_heads", "head_dim", "embed"),
    "wo": ("embed", "heads", "head_dim"),
    "bq": ("heads", "head_dim"),
    "bk": ("kv_heads", "head_dim"),
    "bv": ("kv_heads", "head_dim"),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "post_attn_norm": ("embed",),
    "mlp_norm": ("embed",),
    "w_gate": ("mlp", "embed"),
    "w_up": ("mlp", "embed"),
    "w_down": ("embed", "mlp"),
    "post_mlp_norm": ("embed",),
}


def layer_params(config: ModelConfig) -> tuple[str, ...]:
    """The names of one layer's params: those of the architecture's table, biases if any."""
    names = archs.get(config.arch).layer_names
    return tuple(n for n in names if config.qkv_bias or n not in archs.base.BIASES)


def param_axes(config: ModelConfig) -> dict:
    """Logical axis names of every param, as a pytree parallel to the params."""
    lay = {name: _LAYER_AXES[name] for name in layer_params(config)}
    axes = {"embed": ("vocab", "embed"), "layers": [dict(lay) for _ in range(config.num_layers)],
            "final_norm": ("embed",)}
    if not config.tie_embeddings:
        axes["lm_head"] = ("head_vocab" if config.head_vocab_size else "vocab", "embed")
    return axes


def param_shapes(config: ModelConfig) -> dict:
    c = config
    dims = {"embed": c.hidden_size, "heads": c.num_heads,
            "kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "mlp": c.intermediate_size,
            "vocab": c.vocab_size, "head_vocab": c.head_vocab_size}
    return jax.tree.map(lambda names: tuple(dims[n] for n in names), param_axes(c),
                        is_leaf=lambda x: isinstance(x, tuple))


# How each matrix moved when params went from [in, out] to [out, in] (jaxspec checkpoints of
# format 2 and head files of format 1 hold the old layout).
TO_OUT_MAJOR = {"wq": (1, 2, 0), "wk": (1, 2, 0), "wv": (1, 2, 0), "wo": (2, 0, 1),
                 "w_gate": (1, 0), "w_up": (1, 0), "w_down": (1, 0)}


def draw_in_major(name: str, shape: tuple[int, ...], draw):
    """`draw(shape)` for the param `name` of today's `shape`, a matrix drawn in the [in, out]
    layout of old and turned: a random key or seed gives the values it gave before."""
    perm = TO_OUT_MAJOR.get(name, (1, 0) if name == "lm_head" else None)
    if perm is None:
        return draw(shape)
    return draw(tuple(shape[perm.index(i)] for i in range(len(shape)))).transpose(perm)


def init_params(config: ModelConfig, key, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random params: normal(std) for matrices, ones for norms, zeros for biases. Matrices are
    drawn in the [in, out] layout params had before and turned, so a key gives the model it
    gave then (tests pick seeds whose models exercise what they test)."""
    shapes = param_shapes(config)
    flat, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = path[-1].key
        if name.endswith("norm"):
            leaves.append(jnp.ones(shape, dtype))
        elif name in ("bq", "bk", "bv"):
            leaves.append(jnp.zeros(shape, dtype))
        else:
            w = draw_in_major(name, shape, lambda s: jax.random.normal(k, s, jnp.float32))
            leaves.append((std * w).astype(dtype))
    return jax.tree.unflatten(treedef, leaves)


def layer_from_in_major(lp: dict) -> dict:
    """A layer's params saved in the old [in, out] layout, in today's."""
    return {k: np.transpose(np.asarray(v), TO_OUT_MAJOR[k]) if k in TO_OUT_MAJOR else v
            for k, v in lp.items()}


def from_in_major(params: dict) -> dict:
    """A model's params saved in the old [in, out] layout, in today's."""
    params = {**params, "layers": [layer_from_in_major(lp) for lp in params["layers"]]}
    if "lm_head" in params:
        params["lm_head"] = np.asarray(params["lm_head"]).T
    return params


def check_params(params: dict, config: ModelConfig) -> None:
    """Raise UserError naming the first param whose presence or shape disagrees with config."""
    want = param_shapes(config)
    want_flat = dict(jax.tree.flatten_with_path(want, is_leaf=lambda x: isinstance(x, tuple))[0])
    got_flat = dict(jax.tree.flatten_with_path(params, is_leaf=lambda x: isinstance(x, Int8))[0])
    for path in want_flat.keys() - got_flat.keys():
        raise UserError(f"param {jax.tree_util.keystr(path)} is missing")
    for path in got_flat.keys() - want_flat.keys():
        raise UserError(f"unexpected param {jax.tree_util.keystr(path)}")
    for path, shape in want_flat.items():
        if tuple(got_flat[path].shape) != shape:
            raise UserError(f"param {jax.tree_util.keystr(path)} has shape "
                             f"{tuple(got_flat[path].shape)}, config expects {shape}")

