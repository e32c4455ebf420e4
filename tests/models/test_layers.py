"""`linear`, the model's one matrix product, against a float64 numpy product; chunked prefill
against a single forward; bfloat16 weights against float32."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.models import layers as L
from jaxspec.models.cache import init_cache
from jaxspec.models.params import init_params
from jaxspec.models.transformer import fill_cache, forward

SHAPES = [(1, 1, 16, 24), (1, 2, 16, 24), (2, 1, 40, 97), (1, 3, 64, 1001), (3, 5, 17, 130),
          (1, 16, 32, 257)]


def _case(B, S, D, F, seed):
    """x [B, S, D] and a weight stored [F, D], as the model stores its weights."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, S, D)).astype(np.float32), \
        rng.standard_normal((F, D)).astype(np.float32)


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_linear_equals_the_plain_product(shape):
    x, w_FxD = _case(*shape, seed=sum(shape))
    want = np.einsum("bsd,fd->bsf", x.astype(np.float64), w_FxD.astype(np.float64))
    got = jax.jit(L.linear)(jnp.asarray(x), jnp.asarray(w_FxD))
    assert got.dtype == jnp.float32 and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("shape", SHAPES)
def test_bfloat16_linear_accumulates_in_float32(shape):
    """Single rows take the padded path on CPU; every shape must equal the float64 product of
    the bfloat16-rounded inputs, to float32 error."""
    x, w_FxD = _case(*shape, seed=sum(shape) + 1)
    xb, wb = (np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)
              for a in (x, w_FxD))
    want = np.einsum("bsd,fd->bsf", xb, wb)
    got = jax.jit(L.linear)(jnp.asarray(x), jnp.asarray(w_FxD, jnp.bfloat16))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


CONFIG = ModelConfig(arch="gemma3", vocab_size=80, hidden_size=32, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, intermediate_size=48, max_position=512,
                     sliding_window=5, layer_types=("sliding", "full"))


@pytest.mark.parametrize("n_B", [(1, 1), (7, 30), (64, 3), (65, 100)])
def test_fill_cache_in_chunks_equals_one_forward(n_B):
    """Chunks of 16 over a 128-slot cache: each row's first n slots equal one full forward's."""
    params = init_params(CONFIG, jax.random.key(0), std=0.3)
    B, T = 2, 128
    tokens = np.random.default_rng(1).integers(0, 80, (B, T)).astype(np.int32)
    n = jnp.asarray(n_B, jnp.int32)
    chunked = jax.jit(fill_cache, static_argnames=("config", "layers", "chunk"))(
        params, CONFIG, jnp.asarray(tokens), n, init_cache(CONFIG, B, T), chunk=16)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    _, whole = forward(params, CONFIG, jnp.asarray(tokens), positions, init_cache(CONFIG, B, T))
    for layer in range(CONFIG.num_layers):
        for b, length in enumerate(n_B):
            for got, want in ((chunked.keys[layer], whole.keys[layer]),
                              (chunked.values[layer], whole.values[layer])):
                np.testing.assert_allclose(np.asarray(got[b, :length]),
                                           np.asarray(want[b, :length]), atol=2e-5)


def test_bfloat16_weights_stay_close_to_float32():
    params = init_params(CONFIG, jax.random.key(2), std=0.3)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 80, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    f32 = forward(params, CONFIG, tokens, positions, init_cache(CONFIG, 2, 16))[0]
    bf16_params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    bf16 = forward(bf16_params, CONFIG, tokens, positions, init_cache(CONFIG, 2, 16))[0]
    assert bf16.dtype == jnp.float32
    err = float(jnp.max(jnp.abs(bf16 - f32)) / jnp.max(jnp.abs(f32)))
    assert 1e-5 < err < 3e-2  # rounded, so not equal; close enough to keep most argmaxes
    agree = float(jnp.mean(jnp.argmax(bf16, -1) == jnp.argmax(f32, -1)))
    assert agree >= 0.8


def test_bfloat16_embedding_rows_are_gathered_without_copying_the_table():
    """`embed` gives table[tokens] as float32, bit for bit, and a compiled decode loop over it
    holds no converted copy of a bfloat16 table (XLA:CPU converted Gemma 3's whole table to
    float32 once per call, 0.1-0.4 s, to gather a few rows)."""
    V, D = 1000, 24
    rng = np.random.default_rng(0)
    for dtype in (jnp.bfloat16, jnp.float32):
        table = jnp.asarray(rng.standard_normal((V, D)), dtype)
        tokens = jnp.asarray([[3, 999, 0], [7, 7, 500]], jnp.int32)
        got = jax.jit(L.embed)(table, tokens)
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got),
                                      np.asarray(table.astype(jnp.float32))[np.asarray(tokens)])

    def decode(table, tokens):
        step = lambda i, acc: acc + L.embed(table, (tokens + i) % V).sum()
        return jax.lax.fori_loop(0, 5, step, jnp.float32(0))

    hlo = jax.jit(decode).lower(table.astype(jnp.bfloat16), tokens).compile().as_text()
    # An instruction whose value is a whole table other than the bfloat16 one passed in.
    copies = re.findall(rf"= (?!bf16)\w+\[{V},{D}\]\S* (?!parameter)[\w-]+\(.*", hlo)
    copies = [c for c in copies if "bitcast-convert(" not in c or " fusion(" in c]
    assert not copies, copies


@pytest.mark.parametrize("S", [1, 4])
def test_attention_reads_the_cache_where_it_lies(S):
    """On CPU a bfloat16 model's cache is float32 (`storage_dtype`): a write stores each value
    exactly and attention's products read the cache in place. The compiled write + attention
    holds no other array of a cache's size (XLA:CPU used to convert the whole cache to float32
    and copy it transposed, per layer and step: most of a batched decode step)."""
    config = ModelConfig(arch="llama", vocab_size=16, hidden_size=8, num_layers=1, num_heads=4,
                         num_kv_heads=1, head_dim=32, intermediate_size=8, max_position=64)
    cache = init_cache(config, 4, 64, jnp.bfloat16)
    assert cache.keys[0].dtype == (jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    new = jax.random.normal(jax.random.key(0), (4, S, 1, 32))
    pos = jnp.array([[0], [5], [30], [60]]) + jnp.arange(S)
    written = jax.jit(L.write_cache)(cache.keys[0], new, pos)
    want = np.zeros((4, 64, 1, 32), np.float32)
    want[np.arange(4)[:, None], np.asarray(pos)] = np.asarray(new)
    np.testing.assert_array_equal(np.asarray(written), want)

    def step(k, v, q):
        k, v = L.write_cache(k, new, pos), L.write_cache(v, new, pos)
        return L.attention(q, k, v, pos, 0.1, None, dtype=jnp.bfloat16), k, v

    q = jax.random.normal(jax.random.key(1), (4, S, 4, 32))
    hlo = (jax.jit(step, donate_argnums=(0, 1)).lower(cache.keys[0], cache.values[0], q)
           .compile().as_text())
    instrs = re.findall(r"%(\S+) = \w+\[([\d,]+)\]\S* ([\w-]+)\(", hlo)
    cache_sized = [(name, op) for name, dims, op in instrs
                   if np.prod([int(d) for d in dims.split(",")]) == 4 * 64 * 32
                   and op not in ("parameter", "bitcast") and "scatter" not in name]
    assert not cache_sized, cache_sized


def test_tree_queries_attend_as_a_chain_would():
    """Queries of a token tree on a path through rank-1 nodes (feed indices 2 and 5, apart in
    scratch slots) get bit for bit what the same keys and values laid out as a chain give (slots
    in a row), Gemma 3 270M's shapes (one kv head of 256 dims), bfloat16: each query attends
    over its own arrangement of the cache. Reduced over the tree's own slot order, 4 of these
    30 draws differed, and in bfloat16 a near-tie then flips greedy output (real Japanese
    sentences with a head + n-gram tree did)."""
    from jaxspec.decoding import trees

    tree = trees.make_tree([(0,), (1,), (0, 0), (1, 0), (1, 1), (1, 2)])
    T, N, H = 256, 4, 256
    attend = jax.jit(L.attention, static_argnames=("scale", "window"))
    rng = np.random.default_rng(0)
    for _ in range(30):
        base = int(rng.integers(10, T - 10))
        k, v = (jnp.asarray(rng.normal(size=(1, T, 1, H)), jnp.bfloat16) for _ in range(2))
        q = jnp.asarray(rng.normal(size=(1, tree.size + 1, N, H)), jnp.bfloat16)
        view = L.tree_view(T, jnp.asarray([base]), tree.depth_N1, tree.ancestors_N1xN1)
        got = attend(q, k, v, base + jnp.asarray(tree.depth_N1)[None], scale=H ** -0.5,
                     window=None, view=view)
        k2, v2 = (x.at[0, base + 1].set(x[0, base + 2]).at[0, base + 2].set(x[0, base + 5])
                  for x in (k, v))
        want = attend(q[:, np.array([0, 2, 5])], k2, v2, base + jnp.arange(3)[None],
                      scale=H ** -0.5, window=None)
        np.testing.assert_array_equal(np.asarray(got[:, np.array([0, 2, 5])]),
                                      np.asarray(want))
