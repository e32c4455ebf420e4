"""A hidden-state head and prompt lookup in one tree (drafters/hybrid.py).

The branch's topology; greedy acceptance keeping the longer of two paths that begin alike;
greedy output equal to `generate`'s on a target where both branches are accepted (a one-layer
target with its attention output zeroed, so it maps each token to the next on its own and its
continuations cycle: lookup then finds them, and an EAGLE head cloned from that layer drafts
them too); sampled output with the target's exact joint distribution with the branch matching
(the prompt repeats) and without a match; and clear errors.
"""

import importlib.util
import pathlib
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.decoding import speculative, trees
from jaxspec.decoding.sampling import Sampling
from jaxspec.drafters.hidden import head_params, hidden_drafter
from jaxspec.errors import UserError
from jaxspec.loading import parse_drafter

spec_ = importlib.util.spec_from_file_location(
    "test_sampling_exact", pathlib.Path(__file__).with_name("test_sampling_exact.py"))
_exact = importlib.util.module_from_spec(spec_)
spec_.loader.exec_module(_exact)

PROMPTS = [[5, 17, 3, 22, 9, 41, 5, 17, 3], [7], [12, 30] * 9 + [1], [60, 2, 33]]
MAX_NEW = [23, 31, 9, 17]


def test_branch_is_added_and_split_off():
    head = trees.make_tree([(0,), (1,), (0, 0), (1, 0)])
    tree = trees.with_branch(head, 3)
    assert (2,) in tree.paths and (2, 0, 0) in tree.paths and tree.size == 7
    rest, rest_idx, branch_idx = trees.branch(tree)
    assert rest == head
    assert [tree.paths[i] for i in rest_idx] == list(head.paths)
    assert [tree.paths[i] for i in branch_idx] == [(2,), (2, 0), (2, 0, 0)]
    with pytest.raises(UserError, match="no branch"):
        trees.branch(trees.make_tree([(0,), (1,), (1, 0), (1, 1)]))


def test_greedy_keeps_the_longer_of_two_paths_that_begin_alike():
    """Both root children draft 5, the target's argmax; under the second, 9 is accepted too:
    the row keeps that path (a first-match descent would stop after the first child)."""
    tree = trees.with_branch(trees.chain(1), 2)  # (0,), (1,), (1, 0)
    V = 16
    logits = jnp.zeros((1, 4, V)).at[0, 0, 5].set(1.0).at[0, 2, 9].set(1.0).at[0, 3, 4].set(1.0)
    n, emitted, path = speculative.accept(jax.random.key(0), logits, jnp.asarray([[5, 5, 9]]),
                                          None, Sampling(), tree=tree)
    assert int(n[0]) == 2
    assert path.tolist() == [[0, 2, 3]]
    assert emitted.tolist() == [[5, 9, 4]]


@pytest.fixture(scope="module")
def cycling(tiny):
    """A one-layer target without attention output: its next token is a function of the last,
    so its continuations cycle within a few tokens."""
    t = tiny.model(tiny.config(num_layers=1), 0, "cycling")
    layer = {**t.params["layers"][0], "wo": jnp.zeros_like(t.params["layers"][0]["wo"])}
    return jaxspec.Model(t.config, {**t.params, "layers": [layer]}, None, "cycling")


@pytest.fixture(scope="module")
def clone_head(cycling):
    """EAGLE's decoder layer is the target's and fc passes it the drafted token's embedding:
    it drafts what the target writes."""
    D = cycling.config.hidden_size
    head = head_params("eagle", cycling.config, 4, jax.random.key(0), cycling.params)
    fc = jnp.concatenate([jnp.zeros((D, D)), 0.5 * jnp.eye(D)], axis=1)
    return hidden_drafter(cycling, "eagle", {**head, "fc": fc})


def _gains(res):
    return Counter(g for row in res.accept_lengths for g in row)


@pytest.mark.parametrize("shape", [dict(gamma=1), dict(tree=[(0,), (1,), (0, 0)])],
                         ids=["chain1", "tree3"])
def test_both_branches_are_accepted_and_output_equals_generate(cycling, clone_head, shape):
    ref = jaxspec.generate(cycling, PROMPTS, MAX_NEW).token_ids
    hybrid = jaxspec.hybrid_drafter(clone_head, 3, 4)
    res = jaxspec.speculative_generate(cycling, hybrid, PROMPTS, max_new_tokens=MAX_NEW, **shape)
    assert res.token_ids == ref
    ngram = jaxspec.speculative_generate(cycling, jaxspec.ngram_drafter(3), PROMPTS, gamma=4,
                                         max_new_tokens=MAX_NEW)
    head = jaxspec.speculative_generate(cycling, clone_head, PROMPTS, max_new_tokens=MAX_NEW,
                                        **shape)
    assert ngram.token_ids == ref and head.token_ids == ref
    assert res.tau >= 1.5
    # Deeper than the head's shape: the branch was accepted, where it began as the head's own
    # candidate did (the clone drafts the target's token).
    assert max(_gains(res)) == 5 and max(_gains(head)) <= 3
    # More than either alone: the head's nodes were accepted where lookup had nothing.
    assert res.tau > max(ngram.tau, head.tau) + 0.2


def test_a_step_without_a_match_verifies_the_head_alone(cycling, clone_head):
    """A prompt of one token has nothing to look up: the first step drafts the head's chain of
    1 alone; once the text cycles, steps carry the branch of 4 too. Either way the output is
    `generate`'s; with two rows, a step carries the branch when either row has a match."""
    hybrid = jaxspec.hybrid_drafter(clone_head, 3, 4)
    for prompts in ([[7]], [[7], PROMPTS[0]]):
        res = jaxspec.speculative_generate(cycling, hybrid, prompts, max_new_tokens=20, gamma=1)
        assert res.token_ids == jaxspec.generate(cycling, prompts, 20).token_ids
        firsts = [row[0] for row in res.draft_lengths]
        assert firsts == ([1] if len(prompts) == 1 else [5, 5])
        assert 5 in res.draft_lengths[0]


@pytest.mark.parametrize("prompt,branch", [(_exact.PROMPT, 7), ([1, 5, 2, 7, 3, 6, 4], 4)],
                         ids=["branch-matches", "no-match"])
def test_sampling_matches_target_distribution(small_target, prompt, branch):
    """With PROMPT lookup proposes 7 then 1; the other prompt has no repeat, so its first
    step drafts the head alone (the second may find the first token drawn). The target gives
    the branch's first token real but not full mass, and the head's own draws are sometimes
    that token as well."""
    s = Sampling(1.0)
    cfg = small_target.config
    head = hidden_drafter(small_target, "eagle",
                          head_params("eagle", cfg, 4, jax.random.key(8), small_target.params))
    exact, p1 = _exact.exact_joint(small_target, s, prompt)
    assert 0.05 < p1[branch] < 0.95
    got = _exact.empirical_joint(small_target, jaxspec.hybrid_drafter(head, 3, 2), s, 2,
                                 prompt=prompt)
    assert _exact.tv(got, exact) < _exact.TV_BOUND


def test_settings_errors(cycling, clone_head, target, near_model):
    hybrid = jaxspec.hybrid_drafter(clone_head, 3, 4)
    for shape, msg in [(dict(gamma="auto"), "fixed shape"), (dict(tree="dynamic:4"),
                                                             "static tree")]:
        with pytest.raises(UserError, match=msg):
            jaxspec.speculative_generate(cycling, hybrid, [[1, 2, 3]], max_new_tokens=4, **shape)
    with pytest.raises(UserError, match="hidden-state head"):
        jaxspec.hybrid_drafter(jaxspec.model_drafter(near_model))
    with pytest.raises(UserError, match="length >= 1"):
        jaxspec.hybrid_drafter(clone_head, 3, 0)
    with pytest.raises(UserError, match="up to 15 deep"):
        jaxspec.speculative_generate(cycling, jaxspec.hybrid_drafter(clone_head, 3, 16),
                                     [[1, 2, 3]], gamma=1, max_new_tokens=4)
    with pytest.raises(UserError, match="ngram-tree"):
        parse_drafter("layerskip:1+tree", target)


def test_name_parser_builds_it(target, tmp_path):
    """A saved head followed by +ngram-tree:N:L (what `jaxspec bench` methods take)."""
    from jaxspec.checkpoints import heads

    head = head_params("eagle", target.config, 4, jax.random.key(0), target.params)
    heads.save(tmp_path / "h", "eagle", jax.device_get(head), np.arange(target.config.vocab_size),
               target, 4)
    d = parse_drafter(f"drafter:{tmp_path / 'h'}+ngram-tree:2:3", target)
    assert (d.spec.ngram.max_ngram, d.spec.length, d.spec.head.kind) == (2, 3, "eagle")
