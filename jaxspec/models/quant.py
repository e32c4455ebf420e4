"""int8 weights: each matrix row (output channel) stored as int8 with one float32 scale.

XLA:CPU does not fuse an int8 -> bfloat16 conversion into a product: dequantising the weight
first reads it at ~1 GB/s, 20x slower than the bfloat16 product it replaces. So a product runs
int8 x int8 -> int32, its input written as two int8 digits per value (x / a = hi + lo / 254 for
the row's scale a = max |x| / 127): the two digits are two more rows of one product, which reads
the weight once, and the input keeps ~15 bits (one int8 digit, as dynamic quantisation has it,
changed 6-8% of Gemma 3's greedy tokens alone). Integer sums are exact, so a row's result does
not depend on the other rows of the product (a verify pass equals one-position steps). Norms and
biases stay bfloat16.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@flax.struct.dataclass
class Int8:
    """A matrix [out..., in...] as int8 `q` times float32 `scale` [out...] (a row's) times
    float32 `col` [in...] (an input column's): w = q * scale[:, None] * col[None, :]."""

    q: jax.Array
    scale: jax.Array
    col: jax.Array

    dtype = jnp.dtype(jnp.bfloat16)  # the precision it stands in for (caches, drafters)

    @property
    def shape(self):
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + self.col.nbytes

    def reshape(self, out: int, inner: int) -> "Int8":
        """As a 2-D [out, in] matrix (`-1` allowed, as in numpy)."""
        q = self.q.reshape(out, inner)
        return Int8(q, self.scale.reshape(q.shape[0]), self.col.reshape(q.shape[1]))

    def __getitem__(self, rows) -> "Int8":
        return Int8(self.q[rows], self.scale[rows], self.col)


def quantize(w, out_axes: int = 1, by_column: bool = True) -> Int8:
    """Symmetric int8 per output channel (the first `out_axes` axes); `by_column`, of the
    weight with each input column divided by its largest magnitude: columns of large range
    (Gemma's embedding has some) then cost the other columns no resolution, and the product
    multiplies its input by `col` instead (exact in real numbers). Zero rows and columns get 1.
    """
    w = np.asarray(w, np.float32)
    out_shape, in_shape = w.shape[:out_axes], w.shape[out_axes:]
    w2 = w.reshape(int(np.prod(out_shape)), -1)
    cmax = np.abs(w2).max(0) if by_column else np.ones(w2.shape[1], np.float32)
    col = np.where(cmax > 0, cmax, 1.0).astype(np.float32)
    w2 = w2 / col
    amax = np.abs(w2).max(-1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w2 / scale[:, None]), -127, 127).astype(np.int8)
    return Int8(jnp.asarray(q.reshape(w.shape)), jnp.asarray(scale.reshape(out_shape)),
                jnp.asarray(col.reshape(in_shape)))


def dequantize(w: Int8) -> jax.Array:
    return (w.q.astype(jnp.float32) * w.scale.reshape(w.scale.shape + (1,) * w.col.ndim)
            * w.col)


def quantize_params(params: dict) -> dict:
    """bfloat16 norms and biases, int8 matrices: the embedding (and tied head), any lm_head,
    each layer's projections (q, k, v per head: their first two axes are output channels).
    The products whose inputs have the widest range, the output projections of attention and
    MLP, are scaled by row only: moving their columns' range onto those inputs cost more than
    it gained (Gemma 3 270M, teacher-forced tokens equal to bfloat16's on 8 fr->en sentences,
    that product alone in int8: down projection 94.6% scaled by column, 97.7% by row only)."""
    out_axes = {"wq": 2, "wk": 2, "wv": 2}
    by_row_only = ("wo", "w_down")

    def layer(lp):
        return {k: quantize(v, out_axes.get(k, 1), k not in by_row_only) if k in MATRICES
                else jnp.asarray(v, jnp.bfloat16) for k, v in lp.items()}

    out = {k: quantize(v) if k in ("embed", "lm_head") else jnp.asarray(v, jnp.bfloat16)
           for k, v in params.items() if k != "layers"}
    out["layers"] = [layer(lp) for lp in params["layers"]]
    return out


def linear_int8(x_RxD, w: Int8, min_rows: int):
    """x @ dequantize(w).T, float32 [R, F], each input row as two int8 digits with its own
    scale, one int8 product summed in int32 (weight on the left on CPU, as `layers.linear`)."""
    R = x_RxD.shape[0]
    x_RxD = x_RxD * w.col[None, :]
    amax_R = jnp.max(jnp.abs(x_RxD), axis=-1)
    a_R = jnp.where(amax_R > 0, amax_R / 127.0, 1.0)
    u_RxD = x_RxD / a_R[:, None]
    hi_RxD = jnp.round(u_RxD)
    lo_RxD = jnp.round((u_RxD - hi_RxD) * 254.0)
    xq_2RxD = jnp.concatenate([hi_RxD, lo_RxD]).astype(jnp.int8)
    if jax.default_backend() != "cpu":
        y_2RxF = jax.lax.dot_general(xq_2RxD, w.q, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.int32)
    else:  # a single row runs a slow loop, as in bfloat16: padded
        padded_RxD = jnp.pad(xq_2RxD, ((0, max(0, min_rows - 2 * R)), (0, 0)))
        y_Fx2R = jax.lax.dot_general(w.q, padded_RxD, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.int32)
        y_2RxF = jax.lax.optimization_barrier(y_Fx2R).T[:2 * R]
    y_2RxF = y_2RxF.astype(jnp.float32)
    return (y_2RxF[:R] + y_2RxF[R:] / 254.0) * a_R[:, None] * w.scale[None, :]


def from_restored(tree):
    """Params as a checkpoint without a target restores them (an `Int8` as {"q", "scale"})."""
    if isinstance(tree, dict) and set(tree) == {"q", "scale", "col"}:
        return Int8(*(jnp.asarray(tree[k]) for k in ("q", "scale", "col")))
    if isinstance(tree, dict):
        return {k: from_restored(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [from_restored(v) for v in tree]
    return tree
