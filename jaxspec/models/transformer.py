"""The forward pass of every architecture, over a plain param pytree.

Architectures differ by the flags of their table (`jaxspec.archs`): scaled embeddings, QK-norm,
norms after attention and MLP, the MLP's activation; sliding-window layers with their own rope
base are read off the config.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec import archs
from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.models import layers as L
from jaxspec.models.cache import KVCache


# Positions per prefill forward. Each chunk's queries are scored in one product (not one per
# query, as a verify pass is), so a prompt's keys and values round alike whatever its length
# and offset: a refilled row (which starts after a shared prefix) gets generate's bits.
PREFILL_CHUNK = 16

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda a: jax.nn.gelu(a, approximate=True)}


def _layer(x, lp, k_cache, v_cache, positions, rope, window, config: ModelConfig, slots=None,
           view=None, blocks=None, per_query=True):
    arch = archs.get(config.arch)
    B, S, D = x.shape
    h = L.rms_norm(x, lp["attn_norm"], config.rms_eps)
    q = L.linear(h, lp["wq"].reshape(-1, D)).reshape(B, S, config.num_heads, config.head_dim)
    k = L.linear(h, lp["wk"].reshape(-1, D)).reshape(B, S, config.num_kv_heads, config.head_dim)
    v = L.linear(h, lp["wv"].reshape(-1, D)).reshape(B, S, config.num_kv_heads, config.head_dim)
    if config.qkv_bias:
        q, k, v = q + lp["bq"][None, None], k + lp["bk"][None, None], v + lp["bv"][None, None]
    if arch.qk_norm:
        q = L.rms_norm(q, lp["q_norm"], config.rms_eps)
        k = L.rms_norm(k, lp["k_norm"], config.rms_eps)
    q, k = L.apply_rope(q, *rope), L.apply_rope(k, *rope)
    at = positions if slots is None else slots
    k_cache = L.write_cache(k_cache, k, at)
    v_cache = L.write_cache(v_cache, v, at)
    scale = config.query_scale or config.head_dim ** -0.5
    attn = L.attention(q, k_cache, v_cache, positions, scale, window, view, blocks,
                       lp["wq"].dtype, per_query)
    attn = L.linear(attn, lp["wo"].reshape(D, -1))
    if arch.sandwich_norms:
        attn = L.rms_norm(attn, lp["post_attn_norm"], config.rms_eps)
    x = x + attn
    h = L.rms_norm(x, lp["mlp_norm"], config.rms_eps)
    mlp = L.gated_mlp(h, lp["w_gate"], lp["w_up"], lp["w_down"], _ACTIVATIONS[arch.activation])
    if arch.sandwich_norms:
        mlp = L.rms_norm(mlp, lp["post_mlp_norm"], config.rms_eps)
    return x + mlp, k_cache, v_cache


def forward(params, config: ModelConfig, tokens_BxS, positions_BxS, cache: KVCache,
            layers: tuple[int, ...] | None = None, features: bool = False, slots_BxS=None,
            tree=None, keep_layers=None, feature_layer: int | None = None, inputs_BxSxD=None,
            blocks=None, per_query: bool = True):
    """Logits [batch, seq, vocab] (float32) and the updated cache; with `features`, also the last
    layer's output before the final norm [batch, seq, hidden] (what hidden-state drafters read),
    or with `feature_layer` (static) the input of that layer (speculative streams).
    `inputs_BxSxD` enters the first listed layer in place of the tokens' embeddings (the
    streams run the top layers from a lower layer's states).

    `layers` (static) runs only those layers, in order, for self-speculative drafting; the cache
    then holds one entry per listed layer. Positions at or past the cache length are not written.
    Tokens go to the slots of their positions, or to `slots_BxS`; `tree` = (base_B, depth_M,
    visible_SxM[, ordered]) says the cache holds a token tree (`layers.tree_view`).
    `keep_layers` (bool, one per layer; data) passes a skipped layer's input through: one
    compiled function for every skip set. `blocks`: spans that attend both ways (an image's
    tokens; `layers.attention`). `per_query` False scores all S queries in one attention product
    (a prefill chunk) instead of one each (a verify pass).
    """
    layer_ids = tuple(range(config.num_layers)) if layers is None else tuple(layers)
    if cache.num_layers != len(layer_ids):
        raise UserError(f"cache has {cache.num_layers} layers, model runs {len(layer_ids)}")
    if positions_BxS.shape[1] > cache.max_len:
        raise UserError(f"{positions_BxS.shape[1]} tokens do not fit a cache of "
                        f"{cache.max_len} slots")
    x = (embed(params, config, tokens_BxS) if inputs_BxSxD is None
         else inputs_BxSxD.astype(jnp.float32))
    rope_global = L.rope_angles(positions_BxS, L.rope_inv_freq(
        config.head_dim, config.rope_theta, config.rope_scaling))
    rope_local = L.rope_angles(positions_BxS, L.rope_inv_freq(
        config.head_dim, config.rope_local_theta, None))
    view = None if tree is None else L.tree_view(cache.max_len, *tree)
    keys, values, feats = [], [], None
    for c, i in enumerate(layer_ids):
        if i == feature_layer:
            feats = x
        rope = rope_local if config.sliding_layers[i] else rope_global
        window = config.sliding_window if config.sliding_layers[i] else None
        y, k, v = _layer(x, params["layers"][i], cache.keys[c], cache.values[c], positions_BxS,
                         rope, window, config, slots_BxS, view, blocks, per_query)
        x = y if keep_layers is None else jnp.where(keep_layers[i], y, x)
        keys.append(k)
        values.append(v)
    logits = head(params, config, x)
    cache = KVCache(tuple(keys), tuple(values))
    if not features:
        return logits, cache
    return logits, cache, x if feature_layer is None else feats


def embed(params, config: ModelConfig, tokens_BxS):
    """The tokens' input embeddings (float32 in every precision; Gemma's scaled)."""
    x = L.embed(params["embed"], tokens_BxS)
    if archs.get(config.arch).embed_scale:
        x = x * jnp.asarray(config.hidden_size ** 0.5, x.dtype)
    return x


def image_blocks(tokens_BxT, image_token_id: int):
    """Each slot's image block id (-1 for text): runs of image tokens, numbered per row."""
    image_BxT = tokens_BxT == image_token_id
    start_BxT = image_BxT & ~jnp.pad(image_BxT, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(image_BxT, jnp.cumsum(start_BxT, axis=1) - 1, -1)


def with_images(params, config: ModelConfig, tokens_BxT, images_BxMxD, image_token_id: int):
    """Input embeddings [B, T, D] where each image token takes the next of its row's image
    embeddings (`vision.encode`, images in order of appearance)."""
    x_BxTxD = embed(params, config, tokens_BxT)
    image_BxT = tokens_BxT == image_token_id
    at_BxT = jnp.clip(jnp.cumsum(image_BxT, axis=1) - 1, 0, images_BxMxD.shape[1] - 1)
    picked_BxTxD = jnp.take_along_axis(images_BxMxD.astype(x_BxTxD.dtype), at_BxT[..., None],
                                       axis=1)
    return jnp.where(image_BxT[..., None], picked_BxTxD, x_BxTxD)


def head(params, config: ModelConfig, x_BxSxD, rows=None):
    """Logits of hidden states: the final norm, then the output head (the tied embedding when
    there is no `lm_head`); `rows` [K] keeps only those vocabulary rows."""
    x = L.rms_norm(x_BxSxD, params["final_norm"], config.rms_eps)
    w_VxD = params["lm_head"] if "lm_head" in params else params["embed"]
    return L.linear(x, w_VxD if rows is None else w_VxD[rows])


def fill_cache(params, config: ModelConfig, tokens_BxT, n_B, cache: KVCache,
               layers: tuple[int, ...] | None = None, chunk: int = PREFILL_CHUNK,
               features: bool = False, first=0, feature_layer: int | None = None, images=None):
    """Write the keys/values of each row's tokens `first` .. `n_B` - 1 (the slots before `first`
    already hold theirs), `chunk` positions per forward in a loop whose trip count is data, so
    one compiled function serves every prompt length. Slots past a row's `n_B` get padding, which
    later writes replace before any query reads them. With `features`, returns (cache, features
    [B, T, hidden]) (see `forward`, also for `feature_layer`; positions before `first` get
    zeros). `images` = (image embeddings [B, M, hidden], the image token id): image tokens
    take them (`with_images`) and each image attends to itself both ways, so the prompt goes
    in one chunk (an image's later tokens must be in the cache when its first attends)."""
    B, T = tokens_BxT.shape
    chunk = min(chunk, cache.max_len)
    if images is not None:
        inputs_BxTxD = with_images(params, config, tokens_BxT, *images)
        blocks_BxT = image_blocks(tokens_BxT, images[1])
        _, cache, x_BxTxD = forward(params, config, tokens_BxT,
                                    jnp.broadcast_to(jnp.arange(T), (B, T)), cache, layers,
                                    features=True, feature_layer=feature_layer,
                                    inputs_BxSxD=inputs_BxTxD, blocks=(blocks_BxT, blocks_BxT))
        return (cache, x_BxTxD) if features else cache
    tokens_BxT = jnp.pad(tokens_BxT, ((0, 0), (0, chunk)))  # slices never clamp
    feats_BxTxD = jnp.zeros((B, tokens_BxT.shape[1], config.hidden_size if features else 0))

    def body(i, carry):
        cache, feats_BxTxD = carry
        start = first + i * chunk
        tokens_BxC = jax.lax.dynamic_slice_in_dim(tokens_BxT, start, chunk, axis=1)
        positions_BxC = jnp.broadcast_to(start + jnp.arange(chunk), (B, chunk))
        _, cache, x_BxCxD = forward(params, config, tokens_BxC, positions_BxC, cache, layers,
                                    features=True, feature_layer=feature_layer, per_query=False)
        if features:
            feats_BxTxD = jax.lax.dynamic_update_slice_in_dim(feats_BxTxD, x_BxCxD, start, 1)
        return cache, feats_BxTxD

    cache, feats_BxTxD = jax.lax.fori_loop(0, (jnp.max(n_B) - first + chunk - 1) // chunk, body,
                                           (cache, feats_BxTxD))
    return (cache, feats_BxTxD[:, :T]) if features else cache
