"""EAGLE-2 dynamic trees (trees.DynamicTree): a topology per row and step, greedy.

A per-row topology equal for every row gives the static tree's attention view and verify logits
bit for bit; a width-1 dynamic tree is the EAGLE head's own chain; every drafted tree is
prefix-closed with distinct siblings; greedy output equals `generate`'s on the ragged batch and
on one prompt, with a head that is accepted often (so deep paths are accepted) and a random one;
and bad settings are refused.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.decoding import speculative, trees
from jaxspec.decoding.sampling import Sampling
from jaxspec.drafters.hidden import head_params, hidden_drafter
from jaxspec.errors import UserError
from jaxspec.models import layers as L


PROMPTS = [[5, 17, 3, 22, 9, 41, 5, 17, 3], [7], [12, 30] * 9 + [1], [60, 2, 33]]
MAX_NEW = [23, 31, 9, 17]


@pytest.fixture(scope="module")
def one_layer(tiny):
    return tiny.model(tiny.config(num_layers=1), 0, "one-layer")


@pytest.fixture(scope="module")
def clone(one_layer):
    """An EAGLE head that is nearly its one-layer target (its layer, fed the drafted token's
    embedding scaled to the target's; test_hidden_drafters.py): most drafts are accepted."""
    D = one_layer.config.hidden_size
    head = head_params("eagle", one_layer.config, 4, jax.random.key(0), one_layer.params)
    fc = jnp.concatenate([jnp.zeros((D, D)), 0.5 * jnp.eye(D)], axis=1)
    return hidden_drafter(one_layer, "eagle", {**head, "fc": fc})


@pytest.fixture(scope="module")
def random_eagle(target):
    return hidden_drafter(target, "eagle", head_params("eagle", target.config, 4,
                                                       jax.random.key(8), target.params))


def _row_tree(tree: trees.Tree, B: int) -> trees.RowTree:
    return trees.RowTree(jnp.broadcast_to(jnp.asarray(tree.parent_N), (B, tree.size)),
                         jnp.broadcast_to(jnp.asarray(tree.depth_N1), (B, tree.size + 1)))


def test_a_row_tree_equal_in_every_row_is_the_static_tree(target):
    tree = trees.make_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    rows = _row_tree(tree, 3)
    np.testing.assert_array_equal(rows.ancestors_BxN1xN1,
                                  np.broadcast_to(tree.ancestors_N1xN1, (3, 7, 7)))
    base_B = jnp.array([4, 9, 20])
    for a, b in zip(L.tree_view(32, *tree.region(base_B)), L.tree_view(32, *rows.region(base_B))):
        np.testing.assert_array_equal(a, b)
    # The target's verify logits over either are bit-identical.
    prompts = [[5, 17, 3, 22, 9], [7, 1], [12, 30, 12, 30]]
    state = speculative.prefill(
        target.params, target.config, None,
        jnp.asarray([p + [0] * (32 - len(p)) for p in prompts]), jnp.array([5, 2, 4]),
        jnp.full((3,), 8), jax.random.key(0))
    draft_BxN = jnp.asarray(np.random.default_rng(0).integers(0, 64, (3, tree.size)))
    static = speculative.verify(target.params, target.config, state, draft_BxN, tree)[0]
    per_row = speculative.verify(target.params, target.config, state, draft_BxN, rows)[0]
    np.testing.assert_array_equal(static, per_row)


def _dynamic(drafter, target, prompts, dtree):
    """Drafts and topology of the first step after `prompts` (ragged)."""
    B, T = len(prompts), 32
    tokens_BxT = jnp.asarray([p + [0] * (T - len(p)) for p in prompts])
    lengths_B = jnp.asarray([len(p) for p in prompts])
    state = speculative.prefill(target.params, target.config, drafter, tokens_BxT, lengths_B,
                                jnp.full((B,), 8), jax.random.key(0))
    d = drafter.spec.propose(drafter.params, state.drafter_state, state.draft_input(64),
                             jax.random.key(0), Sampling(), dtree)
    return (d.tokens_BxN, d.rows, d.state), state


def test_width_one_is_the_heads_chain(one_layer, clone):
    prompts = [[5, 17, 3, 22, 9], [7, 1], [12, 30, 12, 30, 12]]
    (draft_BxN, rows, _), state = _dynamic(clone, one_layer, prompts, trees.DynamicTree(4, 4, 1))
    chain_BxG = clone.spec.propose(clone.params, state.drafter_state, state.draft_input(64),
                                   jax.random.key(1), Sampling(), trees.chain(4)).tokens_BxN
    np.testing.assert_array_equal(draft_BxN, chain_BxG)
    np.testing.assert_array_equal(rows.parent_BxN, np.broadcast_to([0, 1, 2, 3], (3, 4)))
    np.testing.assert_array_equal(rows.depth_N1, np.broadcast_to(np.arange(5), (3, 5)))


@pytest.mark.parametrize("budget,depth,width", [(5, 4, 4), (8, 3, 3), (12, 4, 2)])
def test_drafted_trees_are_prefix_closed_with_distinct_siblings(one_layer, clone, budget, depth,
                                                                width):
    prompts = [[5, 17, 3, 22, 9], [7, 1], [12, 30, 12, 30, 12], [60, 2, 33]]
    (draft_BxN, rows, _), _ = _dynamic(clone, one_layer, prompts,
                                       trees.DynamicTree(budget, depth, width))
    draft, parent, depth_N1 = map(np.asarray, (draft_BxN, rows.parent_BxN, rows.depth_N1))
    assert draft.shape == parent.shape == (4, budget)
    shapes = set()
    for b in range(4):
        assert (parent[b] >= 0).all() and (parent[b] <= np.arange(budget)).all()  # parents first
        assert (depth_N1[b, 1:] == depth_N1[b, parent[b]] + 1).all()
        assert depth_N1[b].max() <= depth
        for p in set(parent[b]):
            kids = draft[b][parent[b] == p]
            assert len(kids) == len(set(kids)) <= width
        shapes.add(tuple(parent[b]))
    assert len(shapes) > 1  # the shape is each row's own


@pytest.mark.parametrize("tree", ["dynamic:5:4:4", "dynamic:8:3:3", "dynamic:3:2:2"])
def test_ragged_batch_matches_generate(one_layer, clone, tree):
    ref = jaxspec.generate(one_layer, PROMPTS, MAX_NEW)
    res = jaxspec.speculative_generate(one_layer, clone, PROMPTS, tree=tree,
                                       max_new_tokens=MAX_NEW)
    assert res.token_ids == ref.token_ids
    depth = trees.make_tree(tree).depth
    for toks, gains in zip(res.token_ids, res.accept_lengths):
        assert sum(gains) == len(toks) and all(1 <= g <= depth + 1 for g in gains)
    assert max(g for row in res.accept_lengths for g in row) == depth + 1  # whole paths accepted
    chain = jaxspec.speculative_generate(one_layer, clone, PROMPTS, gamma=1,
                                         max_new_tokens=MAX_NEW)
    assert res.tau > chain.tau


def test_random_head_and_single_prompt_match_generate(target, random_eagle):
    res = jaxspec.speculative_generate(target, random_eagle, PROMPTS, tree="dynamic:6:3:3",
                                       max_new_tokens=MAX_NEW)
    assert res.token_ids == jaxspec.generate(target, PROMPTS, MAX_NEW).token_ids
    one = jaxspec.speculative_generate(target, random_eagle, PROMPTS[0], tree="dynamic:6:3:3",
                                       max_new_tokens=40)
    assert one.token_ids == jaxspec.generate(target, PROMPTS[0], max_new_tokens=40).token_ids


def test_bad_dynamic_trees_are_refused(target, random_eagle):
    for text in ["dynamic", "dynamic:x", "dynamic:1:2:3:4"]:
        with pytest.raises(UserError, match="dynamic:BUDGET"):
            trees.make_tree(text)
    with pytest.raises(UserError, match="budget 30 is more"):
        trees.DynamicTree(30, 3, 2)
    with pytest.raises(UserError, match=">= 1"):
        trees.DynamicTree(4, 0, 2)
    with pytest.raises(UserError, match="greedy only"):
        jaxspec.speculative_generate(target, random_eagle, [[1, 2, 3]], tree="dynamic:4",
                                     temperature=1.0, max_new_tokens=4)
    with pytest.raises(UserError, match="drafted by EAGLE heads"):
        jaxspec.speculative_generate(target, jaxspec.ngram_drafter(3), [[1, 2, 3]],
                                     tree="dynamic:4", max_new_tokens=4)


def test_cli_and_bench_take_dynamic_trees():
    from jaxspec import cli
    from jaxspec.bench import specbench

    tree = cli._tree("dynamic:6:3:2")
    assert tree == trees.DynamicTree(6, 3, 2)
    methods = specbench.parse_methods(["drafter:gemma3-270m-deen-drafter"], [2], [0.0], tree)
    assert [m.name for m in methods][-1] == "drafter-gemma3-270m-deen-drafter-dyn6d3w2-t0"
