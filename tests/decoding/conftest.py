"""Tiny random models shared by the decoding tests.

Weights use std 0.5 so the next-token distributions are peaked enough for greedy decoding to be
free of near-ties. A "far" drafter is an independent random model (it rarely agrees with the
target, so the rejection paths run); a "near" drafter is the target with noise added (it often
agrees, so runs of accepted drafts and the bonus token run too).
"""

import importlib.util
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.models.params import draw_in_major, init_params

VOCAB = 64


def tiny_config(**kw):
    base = dict(arch="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, intermediate_size=64, max_position=512)
    return jaxspec.ModelConfig(**{**base, **kw})


def sliding_gemma_config():
    """A tiny Gemma 3 whose first and last layers see a window of 4 positions."""
    return tiny_config(arch="gemma3", num_layers=3, layer_types=("sliding", "full", "sliding"),
                       sliding_window=4, query_scale=0.3, rope_local_theta=100.0)


def tiny_model(cfg, seed, name="t", std=0.5):
    return jaxspec.Model(cfg, init_params(cfg, jax.random.key(seed), std=std), None, name)


def _perturb(params, key, scale):
    """Noise drawn in the [in, out] layout of old and turned (as `init_params` draws): a seed
    gives the drafter it gave then."""
    flat, treedef = jax.tree.flatten_with_path(params)
    keys = jax.random.split(key, len(flat))
    noisy = []
    for (path, p), k in zip(flat, keys):
        if p.ndim < 2:
            noisy.append(p)
            continue
        z = draw_in_major(getattr(path[-1], "key", ""), p.shape, lambda s: jax.random.normal(k, s))
        noisy.append(p + scale * jnp.std(p) * z)
    return jax.tree.unflatten(treedef, noisy)


def perturbed(model, seed, scale, name="near"):
    """`model` with Gaussian noise of `scale` times each matrix's own std added."""
    return jaxspec.Model(model.config, _perturb(model.params, jax.random.key(seed), scale), None,
                         name)


def subset_head_drafter(model, vocab_ids, seed=3, scale=0.3):
    """A reduced-vocabulary drafter: a noisy copy of `model` whose untied head covers only
    `vocab_ids` (head index -> token id), as `model_drafter` expects."""
    vocab_ids = np.asarray(vocab_ids, np.int32)
    cfg = model.config.replace(tie_embeddings=False, head_vocab_size=len(vocab_ids))
    noisy = perturbed(model, seed, scale).params
    head_VxD = noisy["lm_head"] if "lm_head" in noisy else noisy["embed"]
    params = {**noisy, "lm_head": head_VxD[vocab_ids]}
    return jaxspec.model_drafter(jaxspec.Model(cfg, params, None, "subset"), vocab_ids)


@pytest.fixture(scope="session")
def tiny():
    """The helpers above, for test modules (which cannot import conftest by name)."""
    return types.SimpleNamespace(config=tiny_config, model=tiny_model, perturbed=perturbed,
                                 subset_head_drafter=subset_head_drafter,
                                 sliding_gemma_config=sliding_gemma_config)


@pytest.fixture(scope="session")
def target():
    return tiny_model(tiny_config(), 0, "target")


# far_model and near_model share a name (a static part of the drafter pytree), config and shapes,
# so one compiled decode function serves both.
@pytest.fixture(scope="session")
def far_model():
    return tiny_model(tiny_config(), 1, "draft")


@pytest.fixture(scope="session")
def near_model(target):
    return perturbed(target, 2, 0.05, name="draft")


@pytest.fixture(scope="session")
def small_target():
    """An 8-token vocabulary, flatter (std 0.35), for distribution tests; max_position 16 keeps
    the cache short, so 8192 rows decode in about a second."""
    return tiny_model(tiny_config(vocab_size=8, max_position=16), 20, "target", std=0.35)


@pytest.fixture(scope="session")
def exact():
    """test_sampling_exact's exact joint, its empirical twin and the TV bound, for other modules
    (the importlib import mode imports no test module by name)."""
    spec = importlib.util.spec_from_file_location(
        "test_sampling_exact", pathlib.Path(__file__).with_name("test_sampling_exact.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def small_drafter(small_target):
    """A noisy copy: it agrees with `small_target` on roughly a third of the mass."""
    return perturbed(small_target, 22, 0.5, name="draft")


@pytest.fixture(scope="module")
def stop(free):
    """A token that row 0 of the module's continuations `free` emits mid-way and some other row
    never emits: it ends row 0 early and leaves another row to its budget."""
    for i, tok in enumerate(free[0][2:-2], start=2):
        if free[0].index(tok) == i and any(tok not in row for row in free[1:]):
            return tok
    raise AssertionError("no usable stop token in the reference continuation")
