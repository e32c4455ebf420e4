"""Building blocks: matrix products, RMS norm, rotary embedding, attention over the KV cache,
gated MLP."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import RopeScaling
from jaxspec.errors import UserError
from jaxspec.models.quant import Int8, linear_int8

MIN_ROWS = 3  # bfloat16 products on CPU run at least this many rows (see `linear`)
# XLA:CPU's product of a query's heads with the keys rounds differently for different query
# counts (SmolLM2, 3 heads a group: 3 rows against 6), so up to this many queries (a verify pass)
# each query gets a product of its own and a verify pass scores as one-position steps do.
PER_QUERY_SCORES = 32
_MASKED = -1e30  # finite, so a fully masked (padding) query gives a uniform softmax, not NaN


def linear(x_BxSxD, w_FxD):
    """x @ w.T in float32, w stored [out, in] (a tied embedding serves as the output head as it
    is). Every weight product of the model goes through here.

    On CPU the weight is the left operand and the [F, rows] result is transposed after a
    barrier: XLA then streams the weight near memory bandwidth (Gemma 3 270M's body products
    twice as fast as with the weight on the right, its head 1.5x). XLA runs bfloat16 products
    over two or more rows in a library GEMM (YNNPACK), but a single row in a slow loop (about 10x
    the two-row time), and its kernel for two rows rounds differently from the one for three or
    more, so fewer rows are padded to `MIN_ROWS`: a row's result is then the same whatever the
    row count, and a verify pass picks the tokens one-position steps pick
    (tests/models/test_row_invariance.py). Float32 takes XLA's choice: a matrix-vector product
    for one row, a GEMM for more. Other backends: a plain dot. int8 weights: `quant`.
    """
    B, S, D = x_BxSxD.shape
    if isinstance(w_FxD, Int8):
        return linear_int8(x_BxSxD.reshape(B * S, D).astype(jnp.float32), w_FxD,
                           MIN_ROWS).reshape(B, S, -1)
    x_RxD = x_BxSxD.reshape(B * S, D).astype(w_FxD.dtype)
    if jax.default_backend() != "cpu":
        y_RxF = jax.lax.dot_general(x_RxD, w_FxD, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
        return y_RxF.reshape(B, S, -1)
    rows = MIN_ROWS if w_FxD.dtype == jnp.bfloat16 else 1
    padded_RxD = jnp.pad(x_RxD, ((0, max(0, rows - B * S)), (0, 0)))
    y_FxR = jax.lax.dot_general(w_FxD, padded_RxD, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
    y_RxF = jax.lax.optimization_barrier(y_FxR).T
    return y_RxF[:B * S].reshape(B, S, -1)


def embed(table_VxD, tokens):
    """Rows `tokens` of an embedding table, as float32. XLA:CPU gathers bfloat16 by converting
    the whole table to float32 first (Gemma 3: 671 MB written, 0.1-0.4 s per call, hoisted out
    of the decode loop); gathered as 16-bit integers instead, behind a barrier with the tokens
    so that the table's reinterpretation is not hoisted (and copied) either. An int8 table
    gathers its int8 rows and their scales."""
    if isinstance(table_VxD, Int8):
        return (table_VxD.q[tokens].astype(jnp.float32) * table_VxD.scale[tokens][..., None]
                * table_VxD.col)
    if table_VxD.dtype != jnp.bfloat16:
        return table_VxD[tokens].astype(jnp.float32)
    table_VxD, tokens = jax.lax.optimization_barrier((table_VxD, tokens))
    bits_VxD = jax.lax.bitcast_convert_type(table_VxD, jnp.uint16)
    return jax.lax.bitcast_convert_type(bits_VxD[tokens], jnp.bfloat16).astype(jnp.float32)


def ordered_sum(x, lanes: int = 16):
    """Sum over the last axis in one fixed order whatever the leading shape (XLA:CPU's reduce
    vectorises across rows differently for different row counts): lanes of `lanes` values are
    added as a tree of elementwise adds (zero padding is exact), then the lanes in turn."""
    D = x.shape[-1]
    n = 1 << (max(1, -(-D // lanes)) - 1).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n * lanes - D)])
    x = x.reshape(x.shape[:-1] + (n, lanes))
    while x.shape[-2] > 1:
        half = x.shape[-2] // 2
        x = x[..., :half, :] + x[..., half:, :]
    total = x[..., 0, 0]
    for i in range(1, lanes):
        total = total + x[..., 0, i]
    return total


def rms_norm(x, scale, eps: float):
    """x * rsqrt(mean(x^2) + eps) * scale, computed in float32. `scale` is the full multiplier
    (Gemma's `1 + w` is folded in when loading)."""
    x32 = x.astype(jnp.float32)
    mean_sq = ordered_sum(x32 * x32)[..., None] / x.shape[-1]  # the same for 1 row or 8
    y = x32 * jax.lax.rsqrt(mean_sq + eps)
    scale = scale.astype(jnp.float32).reshape((1,) * (x.ndim - scale.ndim) + scale.shape)
    return (y * scale).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jnp.ndarray:
    """Inverse frequencies [head_dim // 2], with linear or Llama 3 scaling."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind != "llama3":
        raise UserError(f"unsupported rope scaling {scaling.kind!r}; use 'linear' or 'llama3'")
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_angles(positions_BxS, inv_freq_H2):
    """cos, sin of shape [batch, seq, head_dim // 2]."""
    angles = positions_BxS.astype(jnp.float32)[..., None] * inv_freq_H2[None, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BxSxQxH, cos_BxSxH2, sin_BxSxH2):
    """Rotary embedding in the half-split (rotate_half) layout used by Hugging Face."""
    x = x_BxSxQxH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos_BxSxH2[:, :, None, :], sin_BxSxH2[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxSxQxH.dtype)


def write_cache(cache_BxTxJxH, new_BxSxJxH, positions_BxS):
    """Write each token's key/value at its position's slot; positions past the cache are dropped.

    A single position is written as two, the second past the cache: with one kv head XLA turns
    a one-position write into a select over the old slot and a dynamic update, and in a decode
    loop then copies every cache array four times a step (Gemma 3 270M, one row: 144 copies a
    plain step); a scatter of two positions writes in place
    (tests/decoding/test_runner.py::test_one_row_decode_loop_writes_the_cache_in_place)."""
    B, S = positions_BxS.shape
    T = cache_BxTxJxH.shape[1]
    if S == 1:
        positions_BxS = jnp.concatenate([positions_BxS, jnp.full_like(positions_BxS, T)], 1)
        new_BxSxJxH = jnp.concatenate([new_BxSxJxH, new_BxSxJxH], 1)
    return cache_BxTxJxH.at[jnp.arange(B)[:, None], positions_BxS].set(
        new_BxSxJxH.astype(cache_BxTxJxH.dtype), mode="drop")


def tree_view(T: int, base_B, depth_M, visible_SxM, ordered: bool = True):
    """How S queries see a cache of T slots whose slots base .. base + M - 1 hold a token tree
    (slot base + m: position base + depth_M[m]), as (kv_pos [B, T], seen [B, S, T], order
    [B, S, T]): the position each slot holds, which slots each query may see (outside the tree
    every slot, by position as usual; inside only those `visible_SxM` marks, e.g. the query's
    ancestors), and for each query the slots in the order of the positions they hold as that
    query sees them (`order[b, s, t]`: the slot holding position t, itself outside the tree, T
    where the query sees no such slot), so it can attend as a chain's query would; None when
    not `ordered` (a drafter's queries, which need no bit-exactness, skip that cost). A tree of
    its own per row (a dynamic tree) gives depth [B, M] and visible [B, S, M]."""
    B, M = base_B.shape[0], np.shape(depth_M)[-1]
    S = np.shape(visible_SxM)[-2]
    t_T = jnp.arange(T)
    off_BxT = t_T - base_B[:, None]
    inside_BxT = (off_BxT >= 0) & (off_BxT < M)
    at_BxT = jnp.clip(off_BxT, 0, M - 1)
    depth_BxM = jnp.broadcast_to(jnp.asarray(depth_M), (B, M))
    visible_BxSxM = jnp.broadcast_to(jnp.asarray(visible_SxM), (B, S, M))
    kv_pos_BxT = jnp.where(inside_BxT,
                           base_B[:, None] + jnp.take_along_axis(depth_BxM, at_BxT, axis=1), t_T)
    seen_BxSxT = jnp.take_along_axis(visible_BxSxM, at_BxT[:, None, :], axis=2)
    if not ordered:
        return kv_pos_BxT, seen_BxSxT | ~inside_BxT[:, None], None
    # The node query s sees at each depth d ([B, S, depth, node]); T (no slot) for none.
    at_BxSxAxM = visible_BxSxM[:, :, None, :] & (depth_BxM[:, None, None, :]
                                                 == jnp.arange(M)[:, None])
    slot_BxSxA = jnp.where(jnp.any(at_BxSxAxM, axis=-1),
                           base_B[:, None, None] + jnp.argmax(at_BxSxAxM, axis=-1), T)
    order_BxSxT = jnp.where(inside_BxT[:, None], jnp.take_along_axis(
        slot_BxSxA, jnp.broadcast_to(at_BxT[:, None], (B, S, T)), axis=2), t_T)
    return kv_pos_BxT, seen_BxSxT | ~inside_BxT[:, None], order_BxSxT


def attention(q_BxSxQxH, k_BxTxJxH, v_BxTxJxH, positions_BxS, scale: float, window, view=None,
              blocks=None, dtype=jnp.float32, per_query: bool = True):
    """Grouped-query attention of the new queries over the cache, masked by position:
    [batch, seq, heads * head_dim].

    A query at position p sees slots t <= p, and with a sliding `window` (an int, or None)
    only t > p - window (static). `blocks` = (the queries' block ids [B, S], the slots' [B, T];
    -1: none) also lets a query see every slot of its own block, later ones too (an image's
    tokens attend to each other both ways), within the window. `view` (from `tree_view`) gives
    the slots' positions and a visibility mask when the cache holds a token tree; by default
    slot t holds position t. The probabilities are rounded to `dtype` (the model's precision)
    before their product with the values, as a product in that precision would.
    On CPU up to PER_QUERY_SCORES queries each get products of their own, so a verify pass
    rounds as one-position steps do (`per_query` False: one product for all, as a prefill
    chunk); tree queries also attend over the slots in the order of their positions (`view`'s
    order): the softmax's sum and the product with the values round by where each term sits,
    and in the tree's own slot order a query would round unlike the one-position step at its
    position.
    """
    B, S, Q, H = q_BxSxQxH.shape
    J = k_BxTxJxH.shape[2]
    q = q_BxSxQxH.reshape(B, S, J, Q // J, H)  # Q per group: query heads of one J
    per_query = per_query and jax.default_backend() == "cpu" and S <= PER_QUERY_SCORES
    # The keys are the left operand, as weights are in `linear`: XLA:CPU then reads the cache
    # as it lies instead of copying it transposed; the small [.., T, queries] result is
    # transposed to [B, J, Q, S, T] instead.
    if per_query:
        scores = jnp.stack([jnp.einsum("BTJH,BJQH->BJTQ", k_BxTxJxH, q[:, s],
                                       preferred_element_type=jnp.float32) for s in range(S)],
                           axis=3)
    else:
        scores = jnp.einsum("BTJH,BSJQH->BJTSQ", k_BxTxJxH, q,
                            preferred_element_type=jnp.float32)
    scores = jnp.transpose(jax.lax.optimization_barrier(scores), (0, 1, 4, 3, 2)) * scale
    T = k_BxTxJxH.shape[1]
    kv_pos_1x1xT = jnp.arange(T)[None, None, :]
    ordered = view is not None and per_query and view[2] is not None
    if ordered:  # slot t of each query's order holds position t
        order_BxSxT = view[2]
        scores = jnp.take_along_axis(scores, order_BxSxT[:, None, None], axis=-1,
                                     mode="fill", fill_value=_MASKED)
        mask_BxSxT = (kv_pos_1x1xT <= positions_BxS[:, :, None]) & (order_BxSxT < T)
    elif view is not None:
        kv_pos_1x1xT = view[0][:, None, :]
        mask_BxSxT = (kv_pos_1x1xT <= positions_BxS[:, :, None]) & view[1]
    else:
        mask_BxSxT = kv_pos_1x1xT <= positions_BxS[:, :, None]
    if blocks is not None:
        q_BxS, kv_BxT = blocks
        mask_BxSxT |= (q_BxS[:, :, None] == kv_BxT[:, None, :]) & (q_BxS[:, :, None] >= 0)
    if window is not None:
        mask_BxSxT &= kv_pos_1x1xT > positions_BxS[:, :, None] - window
    scores = jnp.where(mask_BxSxT[:, None, None], scores, _MASKED)
    exp = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs = (exp / ordered_sum(exp)[..., None]).astype(dtype).astype(v_BxTxJxH.dtype)
    # Products in [B, J, Q, S, H] order, or XLA:CPU copies the values transposed.
    if per_query:
        rows_Bx1 = jnp.arange(B)[:, None]
        values_for = ((lambda s: v_BxTxJxH[rows_Bx1, jnp.minimum(order_BxSxT[:, s], T - 1)])
                      if ordered else lambda s: v_BxTxJxH)
        out = jnp.concatenate([jnp.einsum("BJQST,BTJH->BJQSH", probs[:, :, :, s:s + 1],
                                          values_for(s)) for s in range(S)], axis=3)
    else:
        out = jnp.einsum("BJQST,BTJH->BJQSH", probs, v_BxTxJxH)
    out = jnp.transpose(jax.lax.optimization_barrier(out), (0, 3, 1, 2, 4))
    # Without the barrier XLA:CPU moves this small transpose onto the output projection's
    # weight and copies [heads, head_dim, embed] every call (a third of a decode step).
    return jax.lax.optimization_barrier(out.reshape(B, S, Q * H))


def gated_mlp(x_BxSxD, w_gate_FxD, w_up_FxD, w_down_DxF, activation):
    gate = activation(linear(x_BxSxD, w_gate_FxD))
    return linear(gate * linear(x_BxSxD, w_up_FxD), w_down_DxF)
