"""Drafter initialisation: layers cut from the target, a reduced head, saving."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.config import ModelConfig
from jaxspec.models.cache import init_cache
from jaxspec.models.params import check_params, init_params
from jaxspec.models.transformer import forward
from jaxspec.training import data, drafter_init

TARGET = ModelConfig(arch="gemma3", vocab_size=264, hidden_size=32, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=8, intermediate_size=64, sliding_window=4,
                     layer_types=("sliding", "full", "sliding", "full"), eos_token_ids=(2,))


def _logits(params, config, tokens_BxS, layers=None):
    B, S = tokens_BxS.shape
    cache = init_cache(config, B, S, num_layers=len(layers) if layers else None)
    positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    return forward(params, config, tokens_BxS, positions, cache, layers=layers)[0]


@pytest.fixture(scope="module")
def target_params():
    return jax.jit(init_params, static_argnums=0)(TARGET, jax.random.key(0))


TOKENS = jnp.array([[1, 40, 50, 60, 70, 80, 2]])


def test_from_target_copies_the_first_layers(target_params):
    config, params = drafter_init.from_target(TARGET, target_params, 2)
    assert config.num_layers == 2 and config.layer_types == ("sliding", "full")
    check_params(params, config)
    assert len(params["layers"]) == 2
    for lp, target_lp in zip(params["layers"], target_params["layers"]):
        for name, p in lp.items():
            np.testing.assert_array_equal(p, target_lp[name])
    np.testing.assert_array_equal(params["embed"], target_params["embed"])
    # The drafter is the target with its last layers skipped.
    np.testing.assert_allclose(_logits(params, config, TOKENS),
                               _logits(target_params, TARGET, TOKENS, layers=(0, 1)), atol=1e-5)
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 4\]"):
        drafter_init.from_target(TARGET, target_params, 5)


def test_frequent_vocab_picks_the_most_frequent_ids_and_eos():
    ids = [[5, 5, 5, 7, 7, 9], [7, 11, 11, 3], [3, 3]]  # counts: 5:3 7:3 3:3 11:2 9:1
    np.testing.assert_array_equal(
        drafter_init.frequent_vocab(ids, 4, 20, always=[2]), [2, 3, 5, 7])
    np.testing.assert_array_equal(drafter_init.frequent_vocab(ids, 5, 20), [3, 5, 7, 9, 11])
    with pytest.raises(ValueError, match="cannot hold"):
        drafter_init.frequent_vocab(ids, 1, 20, always=[1, 2])


def test_reduced_head_gives_the_full_logits_of_its_ids(target_params):
    config, params = drafter_init.from_target(TARGET, target_params, 2)
    full = _logits(params, config, TOKENS)
    vocab_ids = np.array([2, 40, 50, 99, 263], np.int32)
    small_cfg, small = drafter_init.reduce_head(config, params, vocab_ids)
    assert small_cfg.head_vocab_size == 5 and not small_cfg.tie_embeddings
    check_params(small, small_cfg)
    np.testing.assert_allclose(_logits(small, small_cfg, TOKENS), full[..., vocab_ids], atol=1e-5)
    with pytest.raises(ValueError, match="already reduced"):
        drafter_init.reduce_head(small_cfg, small, vocab_ids)


def test_saved_drafter_loads_with_its_vocab_ids(tmp_path, target_params):
    config, params = drafter_init.from_target(TARGET, target_params, 1)
    vocab_ids = np.arange(2, 66, dtype=np.int32)
    config, params = drafter_init.reduce_head(config, params, vocab_ids)
    path = drafter_init.save_drafter(tmp_path / "d", config, params, data.byte_tokenizer(),
                                     vocab_ids, extra={"note": "x"})
    drafter = jaxspec.load_drafter(path)
    np.testing.assert_array_equal(drafter.params["vocab_ids"], vocab_ids)
    model = jaxspec.load(path)
    assert model.config == config and model.tokenizer is not None
    np.testing.assert_array_equal(model.params["lm_head"], params["lm_head"])
    full = jaxspec.load_drafter(drafter_init.save_drafter(tmp_path / "full", TARGET,
                                                          target_params))
    assert "vocab_ids" not in full.params


def test_random_init_matches_the_config():
    config = TARGET.replace(num_layers=1, layer_types=("full",))
    check_params(drafter_init.random_init(config, seed=3), config)
