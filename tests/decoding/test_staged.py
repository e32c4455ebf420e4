"""Staged drafting: n-gram lookup speeds up a transformer drafter without changing its drafts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.decoding import trees
from jaxspec.decoding.sampling import Sampling
from jaxspec.drafters.base import DraftInput
from jaxspec.errors import UserError
from jaxspec.loading import parse_drafter

T = 64


def rows(seed, model=None):
    """Four ragged rows [4, T] and their lengths: random tokens, or `model`'s own greedy text
    from a random first token."""
    rng = np.random.default_rng(seed)
    lengths = np.array([9, 23, 14, 30])
    tokens = np.zeros((4, T), np.int32)
    for b, n in enumerate(lengths):
        text = rng.integers(0, 64, n if model is None else 1).tolist()
        if model is not None:
            text += jaxspec.generate(model, [text], max_new_tokens=int(n) - 1).token_ids[0]
        tokens[b, :n] = text
    return jnp.asarray(tokens), jnp.asarray(lengths)


def bigram(model):
    """`model` with every layer's output projections zeroed and a random untied head: its next
    token is a function of the last token alone, so its greedy text soon cycles and n-gram
    lookup then proposes its own drafts."""
    layers = [{**lp, "wo": 0 * lp["wo"], "w_down": 0 * lp["w_down"]}
              for lp in model.params["layers"]]
    cfg = model.config
    head = jax.random.normal(jax.random.key(5), (cfg.vocab_size, cfg.hidden_size))
    return jaxspec.Model(cfg.replace(tie_embeddings=False),
                         {**model.params, "layers": layers, "lm_head": head}, None, "bigram")


def drafts(drafter, tokens_BxT, lengths_B, gamma):
    spec, params = drafter.spec, drafter.params
    empty = jnp.zeros(tokens_BxT.shape + (0,))
    state = spec.init(params, DraftInput(tokens_BxT, lengths_B - 2, empty, 64))
    out = spec.propose(params, state, DraftInput(tokens_BxT, lengths_B, empty, 64),
                       jax.random.key(0), Sampling(), trees.chain(gamma))
    return np.asarray(out.tokens_BxN)


@pytest.fixture(scope="module")
def first_drafters(target, near_model, tiny):
    return {"model": jaxspec.model_drafter(near_model),
            "bigram": jaxspec.model_drafter(bigram(near_model)),
            "subset": tiny.subset_head_drafter(target, np.arange(0, 64, 2)),
            "layer_skip": jaxspec.layer_skip_drafter(target, [1])}


@pytest.mark.parametrize("kind", ["model", "bigram", "subset", "layer_skip"])
@pytest.mark.parametrize("gamma,k", [(1, 3), (3, 1), (4, 2), (5, 5)])
def test_staged_drafts_are_the_drafters_own(first_drafters, near_model, kind, gamma, k):
    first = first_drafters[kind]
    staged = jaxspec.staged_drafter(first, jaxspec.ngram_drafter(3), k)
    kept = []
    for text_of in (None, bigram(near_model)):
        tokens_BxT, lengths_B = rows(gamma * 10 + k, text_of)
        want = drafts(first, tokens_BxT, lengths_B, gamma)
        np.testing.assert_array_equal(drafts(staged, tokens_BxT, lengths_B, gamma), want)
        kept += list(drafts(jaxspec.ngram_drafter(3), tokens_BxT, lengths_B, 1)[:, 0]
                     == want[:, 0])
    if kind == "bigram":  # n-gram lookup's first proposal was kept in some rows, refused in others
        assert 2 <= sum(kept) <= len(kept) - 2


@pytest.mark.parametrize("gamma", [1, 3])
def test_staged_output_equals_greedy(target, near_model, gamma):
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 11], [7, 7, 8, 7, 7, 8, 7, 7, 8, 7], [40]]
    want = jaxspec.generate(target, prompts, max_new_tokens=[12, 7, 16, 10])
    staged = jaxspec.staged_drafter(jaxspec.model_drafter(near_model), k=2)
    got = jaxspec.speculative_generate(target, staged, prompts, gamma=gamma,
                                       max_new_tokens=[12, 7, 16, 10])
    assert got.token_ids == want.token_ids
    assert got.tau > 1.0


def test_staged_settings_errors(target, near_model):
    model = jaxspec.model_drafter(near_model)
    with pytest.raises(UserError, match="transformer drafter"):
        jaxspec.staged_drafter(jaxspec.ngram_drafter(3))
    with pytest.raises(UserError, match="second stage must be n-gram"):
        jaxspec.staged_drafter(model, model)
    with pytest.raises(UserError, match="k >= 1"):
        jaxspec.staged_drafter(model, k=0)
    with pytest.raises(UserError, match="ngram"):
        parse_drafter("layerskip:1+layerskip:0", target)
    staged = parse_drafter("layerskip:1+ngram:2:4", target)
    assert (staged.spec.second.max_ngram, staged.spec.k) == (2, 4)
    with pytest.raises(UserError, match="cannot draft trees"):
        jaxspec.speculative_generate(target, staged, [[1, 2, 3]], tree=[(0,), (1,)],
                                     max_new_tokens=4)


def test_bench_methods_draft_staged():
    from jaxspec.bench import specbench

    methods = specbench.parse_methods(["layerskip:14,16+ngram:3:2"], [2], [0.0], ((0,), (1,)))
    assert [m.name for m in methods] == ["layerskip-14_16+ngram-3-2-g2-t0"]  # no tree: staged
    assert methods[0].arg == "14,16+ngram:3:2"  # what parse_drafter gets
    with pytest.raises(UserError, match="only layerskip and drafter"):
        specbench.parse_methods(["ngram:3+ngram:2"], [2], [0.0])
    with pytest.raises(UserError, match="needs an argument"):
        specbench.parse_methods(["layerskip:+ngram"], [2], [0.0])
