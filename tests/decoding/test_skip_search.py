"""`jaxspec tune-layer-skip`: teacher-forced agreement of a skip set, the greedy elimination, and
the bench config it writes."""

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import jaxspec
from jaxspec.decoding import skip_search
from jaxspec.errors import UserError
from jaxspec.loading import parse_drafter
from jaxspec.models.cache import init_cache
from jaxspec.models.transformer import forward

IDENTITY = (1, 3, 4)  # layers whose outputs are zeroed: skipping them changes nothing
FLAT = {"1": 1.0, "2": 1.05, "4": 1.1, "8": 1.2}
PROMPTS = [[1, 5, 2, 7, 1, 5, 2], [3, 3, 9], [4, 8, 15, 16, 23, 42, 4, 8, 15]]


@pytest.fixture(scope="module")
def model(tiny):
    m = tiny.model(tiny.config(num_layers=6), seed=0)
    layers = list(m.params["layers"])
    for i in IDENTITY:
        layers[i] = {**layers[i], "wo": jnp.zeros_like(layers[i]["wo"]),
                     "w_down": jnp.zeros_like(layers[i]["w_down"])}
    return jaxspec.Model(m.config, {**m.params, "layers": type(m.params["layers"])(layers)},
                         None, "six")


@pytest.fixture(scope="module")
def texts(model):
    return skip_search.greedy_texts(model, PROMPTS, max_new_tokens=20)


def test_texts_weigh_exactly_the_generated_positions(model, texts):
    tokens_BxL, weight_BxL = texts
    plain = jaxspec.generate(model, PROMPTS, max_new_tokens=20)
    assert weight_BxL.sum(axis=1).tolist() == [len(t) for t in plain.token_ids]
    for b, (p, new) in enumerate(zip(PROMPTS, plain.token_ids)):
        assert tokens_BxL[b, :len(p) + len(new)].tolist() == p + new


def test_agreement_equals_the_skipped_models_own_forward(model, texts):
    """The data mask gives what the static layer list (the drafter's own forward) gives."""
    tokens_BxL, weight_BxL = texts
    agreement = skip_search.agreement_fn(model, tokens_BxL, weight_BxL)
    c = model.config
    B, L = tokens_BxL.shape
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))

    def static(keep):
        logits, _ = forward(model.params, c, jnp.asarray(tokens_BxL), pos,
                            init_cache(c, B, L, num_layers=len(keep)), keep)
        return np.asarray(jnp.argmax(logits, -1))

    full = static(tuple(range(6)))
    for skip in [(0,), (2, 5), IDENTITY, (0, 1, 2, 3, 4)]:
        keep = tuple(i for i in range(6) if i not in skip)
        want = np.sum((static(keep) == full) * weight_BxL) / np.sum(weight_BxL)
        assert agreement(skip) == pytest.approx(want, abs=1e-6), skip
    assert agreement(IDENTITY) == 1.0
    assert agreement((0, 1, 2, 3, 4)) < 1.0


def test_search_skips_the_identity_layers(model, texts):
    agreement = skip_search.agreement_fn(model, *texts)
    found = skip_search.search(agreement, 6, FLAT, c_one=0.2, c_full=1.0, gamma_max=4)
    assert found.best.skip == IDENTITY and found.best.agreement == 1.0
    assert found.best.gamma == 4  # every draft accepted: the longest draft pays most
    sizes = [len(c.skip) for c in found.candidates]
    assert sizes == list(range(1, len(sizes) + 1))
    for c in found.candidates[:3]:
        assert set(c.skip) <= set(IDENTITY) and c.agreement == 1.0
    kept = 6 - len(IDENTITY)
    assert found.best.c == pytest.approx(0.2 + (kept - 1) * 0.8 / 5)
    assert "best: skip 1,3,4 at gamma 4" in found.describe()


def test_search_says_when_nothing_pays(model, texts):
    agreement = skip_search.agreement_fn(model, *texts)
    found = skip_search.search(agreement, 6, {"1": 1.0, "8": 3.0}, c_one=0.9, c_full=1.0,
                               max_skip=2)
    assert len(found.candidates) <= 2 and found.best.expected < 1
    assert "no skip set pays" in found.describe()


def test_bad_settings_are_clear_errors(model, texts):
    agreement = skip_search.agreement_fn(model, *texts)
    with pytest.raises(UserError, match="max_skip"):
        skip_search.search(agreement, 6, FLAT, 0.2, 1.0, max_skip=6)
    with pytest.raises(UserError, match="at least 2 layers"):
        skip_search.search(agreement, 1, FLAT, 0.2, 1.0)


def test_bench_config_names_the_best_set(model, texts):
    agreement = skip_search.agreement_fn(model, *texts)
    found = skip_search.search(agreement, 6, FLAT, c_one=0.2, c_full=1.0)
    text = skip_search.bench_config(found, (1.31, 3.9), {"target": "six", "questions": "q.jsonl"})
    cfg = yaml.safe_load(text)
    assert cfg == {"target": "six", "questions": "q.jsonl", "gammas": [4],
                   "methods": ["ar", "layerskip:1,3,4"]}
    assert "measured on the search prompts: 1.310x, tau 3.900" in text.lower()
    d = parse_drafter(cfg["methods"][1], model)
    assert d.spec.layers == (0, 2, 5)
