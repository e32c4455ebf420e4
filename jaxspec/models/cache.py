"""The KV cache: fixed-shape arrays indexed by absolute position.

Slot `t` of a row holds the key/value of the token at position `t`. A forward pass writes its
tokens' slots before attending, and a query at position `p` reads only slots `<= p`, so every slot
it reads was written by the row's current text: rolling back rejected draft tokens needs no copy,
the decoder just lowers the row's length and later writes overwrite the stale slots.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp

from jaxspec.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    k_LxBxTxKxH: jnp.ndarray
    v_LxBxTxKxH: jnp.ndarray

    @property
    def max_len(self) -> int:
        return self.k_LxBxTxKxH.shape[2]

    @property
    def batch(self) -> int:
        return self.k_LxBxTxKxH.shape[1]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32,
               num_layers: int | None = None) -> KVCache:
    """Zeros of shape [layers, batch, max_len, kv_heads, head_dim]."""
    shape = (num_layers or config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
