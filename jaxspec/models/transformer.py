"""The forward pass shared by the Llama family and Gemma 3, over a plain param pytree.

Gemma 3 differs from Llama by flags read off the config: scaled embeddings, QK-norm, norms after
attention and MLP, GeGLU, and interleaved sliding-window layers with their own rope base.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.models import layers as L
from jaxspec.models.cache import KVCache


def _layer(x, lp, k_cache, v_cache, positions, rope_global, rope_local, is_sliding,
           config: ModelConfig):
    gemma = config.arch == "gemma3"
    h = L.rms_norm(x, lp["attn_norm"], config.rms_eps)
    q = jnp.einsum("BSD,DNH->BSNH", h, lp["wq"])
    k = jnp.einsum("BSD,DKH->BSKH", h, lp["wk"])
    v = jnp.einsum("BSD,DKH->BSKH", h, lp["wv"])
    if config.qkv_bias:
        q, k, v = q + lp["bq"][None, None], k + lp["bk"][None, None], v + lp["bv"][None, None]
    if gemma:
        q = L.rms_norm(q, lp["q_norm"], config.rms_eps)
        k = L.rms_norm(k, lp["k_norm"], config.rms_eps)
    cos = jnp.where(is_sliding, rope_local[0], rope_global[0])
    sin = jnp.where(is_sliding, rope_local[1], rope_global[1])
    q, k = L.apply_rope(q, cos, sin), L.apply_rope(k, cos, sin)
    k_cache = L.write_cache(k_cache, k, positions)
    v_cache = L.write_cache(v_cache, v, positions)
    window = None
    if config.sliding_window:
        # A full layer gets a window no position can fall out of.
        window = jnp.where(is_sliding, config.sliding_window, k_cache.shape[1] + 1)
    scale = config.query_scale or config.head_dim ** -0.5
    attn = L.attention(q, k_cache, v_cache, positions, scale, window)
    attn = jnp.einsum("BSNH,NHD->BSD", attn, lp["wo"])
    if gemma:
        attn = L.rms_norm(attn, lp["post_attn_norm"], config.rms_eps)
    x = x + attn
    h = L.rms_norm(x, lp["mlp_norm"], config.rms_eps)
    act = (lambda a: jax.nn.gelu(a, approximate=True)) if gemma else jax.nn.silu
    mlp = L.gated_mlp(h, lp["w_gate"], lp["w_up"], lp["w_down"], act)
    if gemma:
        mlp = L.rms_norm(mlp, lp["post_mlp_norm"], config.rms_eps)
    return x + mlp, k_cache, v_cache


def forward(params, config: ModelConfig, tokens_BxS, positions_BxS, cache: KVCache,
            layers: tuple[int, ...] | None = None):
    """Logits [batch, seq, vocab] (float32) and the updated cache.

    `layers` (static) runs only those layers, in order, for self-speculative drafting; the cache
    then holds one entry per listed layer. Positions at or past the cache length are not written.
    """
    layer_ids = tuple(range(config.num_layers)) if layers is None else tuple(layers)
    if cache.k_LxBxTxKxH.shape[0] != len(layer_ids):
        raise ValueError(f"cache has {cache.k_LxBxTxKxH.shape[0]} layers, model runs "
                         f"{len(layer_ids)}")
    if tokens_BxS.shape[1] > cache.max_len:
        raise ValueError(f"{tokens_BxS.shape[1]} tokens do not fit a cache of {cache.max_len} "
                         f"slots")
    embed_VxD = params["embed"]
    x = embed_VxD[tokens_BxS]
    if config.arch == "gemma3":
        x = x * jnp.asarray(config.hidden_size ** 0.5, x.dtype)
    rope_global = L.rope_angles(positions_BxS, L.rope_inv_freq(
        config.head_dim, config.rope_theta, config.rope_scaling))
    rope_local = L.rope_angles(positions_BxS, L.rope_inv_freq(
        config.head_dim, config.rope_local_theta, None))
    sliding = jnp.asarray([config.sliding_layers[i] for i in layer_ids])

    def body(x, xs):
        idx, is_sliding, k_cache, v_cache = xs
        lp = jax.tree.map(lambda p: p[idx], params["layers"])
        x, k_cache, v_cache = _layer(x, lp, k_cache, v_cache, positions_BxS, rope_global,
                                     rope_local, is_sliding, config)
        return x, (k_cache, v_cache)

    x, (k, v) = jax.lax.scan(
        body, x, (jnp.asarray(layer_ids), sliding, cache.k_LxBxTxKxH, cache.v_LxBxTxKxH))
    x = L.rms_norm(x, params["final_norm"], config.rms_eps)
    head_DxV = params["lm_head"] if "lm_head" in params else embed_VxD.T
    logits = jnp.einsum("BSD,DV->BSV", x, head_DxV, preferred_element_type=jnp.float32)
    return logits, KVCache(k, v)
