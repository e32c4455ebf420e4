"""The KV cache: fixed-shape arrays indexed by absolute position, one pair per layer.

Slot `t` of a row holds the key/value of the token at position `t`. A forward pass writes its
tokens' slots before attending, and a query at position `p` reads only slots `<= p`, so every slot
it reads was written by the row's current text: rolling back rejected draft tokens needs no copy,
the decoder just lowers the row's length and later writes overwrite the stale slots. Layers are
separate arrays, not one stacked array, so each layer's write updates its own buffer in place.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig

CACHE_AXES = ("batch", "length", "kv_heads", "head_dim")  # logical names of a layer's keys/values


@flax.struct.dataclass
class KVCache:
    keys: tuple  # per layer: [batch, max_len, kv_heads, head_dim]
    values: tuple

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32,
               num_layers: int | None = None) -> KVCache:
    """Zeros: per layer [batch, max_len, kv_heads, head_dim], in `storage_dtype(dtype)`."""
    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    n = num_layers or config.num_layers
    dtype = storage_dtype(dtype)
    return KVCache(tuple(jnp.zeros(shape, dtype) for _ in range(n)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(n)))


def storage_dtype(dtype):
    """How keys and values of a model in `dtype` are stored: float32 on CPU, where XLA runs
    bfloat16 scatters and batched attention products by converting the whole cache to float32
    first (per layer and step: most of a batched decode step); `dtype` elsewhere."""
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else dtype)
