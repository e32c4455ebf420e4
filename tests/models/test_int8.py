"""int8 weights (`models.quant`): the round trip is bounded, products are close to float32 and
row-invariant, speculative decoding on an int8 target emits exactly int8 greedy decoding for every
drafter kind, and an int8 checkpoint saves and loads."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.checkpoints import store
from jaxspec.drafters.hidden import head_params, hidden_drafter
from jaxspec.models import layers as L
from jaxspec.models.params import init_params
from jaxspec.models.quant import Int8, dequantize, quantize, quantize_params

CONFIG = jaxspec.ModelConfig(arch="gemma3", vocab_size=64, hidden_size=32, num_layers=3,
                             num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                             max_position=512, layer_types=("sliding", "full", "sliding"),
                             sliding_window=4)
PROMPTS = [[5, 17, 3, 22, 9, 41, 5, 17, 3], [7], [12, 30] * 9 + [1], [60, 2, 33]]
MAX_NEW = [23, 31, 9, 17]


@pytest.mark.parametrize("by_column", [True, False])
@pytest.mark.parametrize("shape, out_axes", [((96, 40), 1), ((4, 8, 40), 2), ((5, 1), 1)])
def test_round_trip_is_within_half_a_step(shape, out_axes, by_column):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w[0] = 0.0  # all-zero output channels
    w[..., -1] *= 50.0  # an input column of wide range
    qw = quantize(w, out_axes, by_column)
    assert qw.q.dtype == jnp.int8 and qw.scale.shape == shape[:out_axes]
    assert qw.col.shape == shape[out_axes:]
    rows, cols = int(np.prod(shape[:out_axes])), int(np.prod(shape[out_axes:]))
    step = np.asarray(qw.scale).reshape(rows, 1) * np.asarray(qw.col).reshape(1, cols)
    got = np.asarray(dequantize(qw)).reshape(rows, cols)
    assert np.all(np.abs(got - w.reshape(rows, cols)) <= step / 2 * (1 + 1e-6))
    assert np.all(got[:shape[1] if out_axes == 2 else 1] == 0)


def test_column_scaling_keeps_narrow_columns_fine():
    """One input column 50x wider than the rest: scaled by row only, it sets every row's step;
    scaled by column too, the other columns keep their resolution."""
    w = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    w[:, -1] *= 50.0
    err = {c: np.abs(np.asarray(dequantize(quantize(w, 1, c)))[:, :-1] - w[:, :-1]).mean()
           for c in (True, False)}
    assert err[True] < 0.1 * err[False]


def test_product_close_to_float_and_row_invariant():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 9, 64)), jnp.float32)
    w = rng.standard_normal((200, 64)).astype(np.float32)
    got = jax.jit(L.linear)(x, quantize(w))
    want = np.einsum("bsd,fd->bsf", np.asarray(x), w)
    # int8 on both sides: error about 1% of the product's scale
    assert np.abs(np.asarray(got) - want).max() < 0.03 * np.abs(want).max()
    for rows in range(1, 9):
        np.testing.assert_array_equal(np.asarray(jax.jit(L.linear)(x[:, :rows], quantize(w)))[0],
                                      np.asarray(got)[0, :rows], err_msg=f"{rows} rows")


@pytest.fixture(scope="module")
def target():
    params = init_params(CONFIG, jax.random.key(0), std=0.5)
    return jaxspec.Model(CONFIG, quantize_params(params), None, "int8-target")


@pytest.fixture(scope="module")
def reference(target):
    res = jaxspec.generate(target, PROMPTS, MAX_NEW)
    assert [len(t) for t in res.token_ids] == MAX_NEW
    return res.token_ids


def _drafters(target, reference):
    near = init_params(CONFIG, jax.random.key(0), std=0.5)
    near = jax.tree.map(lambda p: p * 1.02 if p.ndim > 1 else p, near)
    common = [t for t, _ in Counter(t for row in reference for t in row).most_common(12)]
    eagle = hidden_drafter(target, "eagle", head_params("eagle", CONFIG, 1, jax.random.key(4)),
                           depth=4)
    return {
        "model": jaxspec.model_drafter(jaxspec.Model(CONFIG, quantize_params(near), None, "d")),
        "layer_skip": jaxspec.layer_skip_drafter(target, [1]),
        "ngram": jaxspec.ngram_drafter(3),
        "eagle": eagle,
        "eagle+ngram-tree": jaxspec.hybrid_drafter(eagle, 3, 4),
        "lookahead": jaxspec.lookahead_drafter(3, 3, 3),
        "subset_vocab": sorted(common),
    }


def test_every_drafter_kind_equals_int8_greedy(target, reference):
    drafters = _drafters(target, reference)
    drafters.pop("subset_vocab")
    taus = {}
    for kind, drafter in drafters.items():
        kw = {"gamma": 3} if kind in ("model", "layer_skip", "ngram") else {}
        if kind == "eagle":
            kw = {"tree": [(0,), (1,), (0, 0), (0, 1)]}
        res = jaxspec.speculative_generate(target, drafter, PROMPTS, max_new_tokens=MAX_NEW,
                                           **kw)
        assert res.token_ids == reference, kind
        taus[kind] = res.tau
    assert taus["model"] > 1.5  # the near int8 drafter is accepted: both paths are exercised


def test_int8_checkpoint_saves_and_loads(target, reference, tmp_path):
    path = store.save(tmp_path / "int8", target.params, CONFIG)
    loaded = jaxspec.load(path)
    assert isinstance(loaded.params["embed"], Int8)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(target.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jaxspec.generate(loaded, PROMPTS, MAX_NEW).token_ids == reference
    with pytest.raises(ValueError, match="holds int8 weights"):
        jaxspec.load(path, dtype="bfloat16")
