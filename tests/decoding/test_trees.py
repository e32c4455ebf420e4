"""Token trees (decoding/trees.py) in the one decode loop.

Topology from "choices" paths and clear errors for bad trees; the drafters' trees (a node's
children are the top candidates of its own distribution, with tree attention in the drafter's
cache too); greedy output equal to `generate`'s for trees of several shapes and every drafter
kind, on the ragged batch of test_greedy_identity.py and on one prompt; sampled output with the
target's exact joint distribution of two tokens (as in test_sampling_exact.py) through a tree of
width 2 at two depths; and cache compaction: after a step accepts a path through rank-1 nodes,
the target cache equals the one of feeding the text token by token, and the next step's logits
agree with a full forward.

A chain given as a tree runs the gamma code path (the tree code path for a chain): the existing
identity and exactness tests cover it.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.decoding import speculative, trees
from jaxspec.decoding.sampling import Sampling
from jaxspec.drafters.base import DraftInput
from jaxspec.drafters.hidden import head_params, hidden_drafter
from jaxspec.errors import UserError
from jaxspec.models.cache import init_cache
from jaxspec.models.transformer import forward


def _sibling(name):
    """A sibling test module (pytest imports these by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name(
        f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The exact joint of two tokens on the 8-token vocabulary, and the sampler's empirical one.
_exact = _sibling("test_sampling_exact")
SMALL_PROMPT, TV_BOUND, tv = _exact.PROMPT, _exact.TV_BOUND, _exact.tv
exact_joint, empirical_joint = _exact.exact_joint, _exact.empirical_joint

PROMPTS = [[5, 17, 3, 22, 9, 41, 5, 17, 3], [7], [12, 30] * 9 + [1], [60, 2, 33]]
MAX_NEW = [23, 31, 9, 17]
MEDUSA = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]
EAGLE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]


def _random_tree(seed, n=9, max_depth=4):
    """A random prefix-closed tree: each new node is the next-ranked child of a random node."""
    rng = np.random.default_rng(seed)
    paths, kids = [()], {(): 0}
    while len(paths) <= n:
        p = paths[rng.integers(len(paths))]
        if len(p) < max_depth:
            child = p + (kids[p],)
            kids[p] += 1
            paths.append(child)
            kids[child] = 0
    return paths[1:]


RANDOM = _random_tree(3)


def _check_stats(res, tree):
    depth = max(map(len, tree))
    for toks, gains in zip(res.token_ids, res.accept_lengths):
        assert sum(gains) == len(toks)
        assert all(1 <= g <= depth + 1 for g in gains)


# -- topology and bad input --------------------------------------------------------------------


def test_topology_from_choices():
    t = trees.make_tree([(1, 0), (0,), (1,), (0, 1), (0, 0)])  # any order
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert t.parent_N.tolist() == [0, 0, 1, 1, 2]  # feed indices: 0 is the root
    assert t.depth_N1.tolist() == [0, 1, 1, 2, 2, 2] and t.max_depth == 2
    assert t.children_N1xW.tolist() == [[0, 1], [2, 3], [4, -1], [-1, -1], [-1, -1], [-1, -1]]
    want = np.zeros((6, 6), bool)
    for k, anc in enumerate([[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5]]):
        want[k, anc] = True
    np.testing.assert_array_equal(t.ancestors_N1xN1, want)
    assert not t.is_chain and trees.make_tree([(0,), (0, 0)]).is_chain
    np.testing.assert_array_equal(trees.chain(3).ancestors_N1xN1, np.tril(np.ones((4, 4), bool)))
    assert trees.full_tree([2, 2]).paths == t.paths[:2] + ((0, 0), (0, 1), (1, 0), (1, 1))
    assert trees.make_tree(RANDOM).size == len(RANDOM) == 9


@pytest.mark.parametrize("choices,msg", [
    ([(0,), (0, 1, 0)], r"not prefix-closed: \(0, 1, 0\) has no parent \(0, 1\)"),
    ([(0,), (1, 0)], r"not prefix-closed: \(1, 0\) has no parent \(1,\)"),
    ([(0,), (0,)], r"tree path \(0,\) is given twice"),
    ([], "at least one node"),
    ([(0,), ()], "non-empty sequence of ranks"),
    ([(0,), (-1,)], "non-empty sequence of ranks >= 0"),
    ([0, 1], "a sequence of ranks"),
])
def test_bad_trees_are_refused(target, choices, msg):
    with pytest.raises(UserError, match=msg):
        trees.make_tree(choices)
    with pytest.raises(ValueError, match=msg):
        jaxspec.speculative_generate(target, jaxspec.ngram_drafter(), [[1, 2]], tree=choices)


def test_tree_settings_are_refused(target, small_target):
    with pytest.raises(ValueError, match="gamma .* or tree, not both"):
        jaxspec.speculative_generate(target, jaxspec.ngram_drafter(), [[1, 2]], gamma=2,
                                     tree=MEDUSA)
    with pytest.raises(ValueError, match="gamma .* or tree, not both"):
        jaxspec.speculative_generate(target, jaxspec.ngram_drafter(), [[1, 2]], gamma="auto",
                                     tree=MEDUSA)
    # More nodes than the cache can take: 7 + 2 + 8 nodes + 1 = 18 > 16 positions.
    with pytest.raises(ValueError, match=r"\+ 8 tree nodes \+ 1 = 18 exceeds the model's 16"):
        jaxspec.speculative_generate(small_target, jaxspec.ngram_drafter(), SMALL_PROMPT,
                                     tree=MEDUSA, max_new_tokens=2)


def test_trees_deeper_than_the_drafter_are_refused(target):
    medusa = hidden_drafter(target, "medusa", head_params("medusa", target.config, 2,
                                                          jax.random.key(0)), depth=2)
    with pytest.raises(ValueError, match="has 2 heads; the tree is 3 deep"):
        jaxspec.speculative_generate(target, medusa, [[1, 2]], tree=MEDUSA, max_new_tokens=4)
    eagle = hidden_drafter(target, "eagle", head_params("eagle", target.config, 2,
                                                        jax.random.key(0), target.params))
    deep = [(0,) * d for d in range(1, 17)] + [(1,)]
    with pytest.raises(ValueError, match="up to 15 deep; the tree is 16 deep"):
        jaxspec.speculative_generate(target, eagle, [[1, 2]], tree=deep, max_new_tokens=4)


def test_cli_and_bench_take_trees():
    from jaxspec import cli
    from jaxspec.bench import specbench

    assert cli._tree("[[0], [1], [0, 0]]") == ((0,), (1,), (0, 0))
    assert cli._tree("2,1") == ((0,), (1,), (0, 0), (1, 0))
    assert cli._tree([[0], [0, 0]]) == ((0,), (0, 0))
    with pytest.raises(UserError, match="not prefix-closed"):
        cli._tree("[[0], [1, 0, 0]]")
    methods = specbench.parse_methods(["ar", "ngram"], [4], [0.0], cli._tree("2,1"))
    assert [m.name for m in methods] == ["ar-t0", "ngram-g4-t0", "ngram-tree4d2-t0"]


# -- drafting trees ----------------------------------------------------------------------------


def test_model_drafter_tree_nodes_are_top_candidates_of_their_own_path(tiny, target):
    """Greedy: node (r1, ..., rd) is the rank-rd token of the drafter's next-token logits after
    the text and the node's path (a full forward, no cache), whatever its siblings' branches
    hold: the drafter's tree attention keeps them apart. Checked after a prompt (cache from
    prefill) and then after a step that accepted nothing and one that accepted a rank-1 node
    (its keys left in scratch slots): the refed window repairs the cache."""
    drafter = tiny.perturbed(target, 2, 0.05, name="draft")
    spec = jaxspec.model_drafter(drafter).spec
    tree = trees.make_tree(EAGLE)
    params = {"model": drafter.params}
    text = [5, 17, 3, 22, 9, 41, 5]
    T = 32
    for step in range(3):
        L = len(text)
        toks = jnp.asarray([text + [0] * (T - L)])
        # The cache holds the text as before this step (prefill, or after earlier steps).
        inp = DraftInput(toks, jnp.asarray([L]), jnp.zeros((1, T, 0)), 64)
        cache = spec.init(params, inp) if step == 0 else cache
        out = spec.propose(params, cache, inp, jax.random.key(0), Sampling(), tree)
        draft, q, cache = out.tokens_BxN, out.q, out.state
        assert q is None
        draft = np.asarray(draft)[0]
        prefixes = [text + [int(draft[tree.paths.index(p[:k])]) for k in range(1, len(p))]
                    for p in tree.paths]
        logits = jaxspec.score(drafter, [p + [0] * (T - len(p)) for p in prefixes])
        for i, (path, prefix) in enumerate(zip(tree.paths, prefixes)):
            ranked = np.argsort(-np.asarray(logits[i, len(prefix) - 1]), kind="stable")
            assert draft[i] == ranked[path[-1]], (step, path)
        # Accept nothing, then node (1,) and the target's token after it.
        text = text + ([int(draft[1]), 3] if step == 1 else [60])


def test_eagle_tree_nodes_along_rank_0_equal_its_chain(target):
    """EAGLE's tree attention: with tree nodes in its cache, the all-rank-0 path drafts what the
    chain does."""
    eagle = hidden_drafter(target, "eagle", head_params("eagle", target.config, 4,
                                                        jax.random.key(8), target.params))
    tree = trees.make_tree(EAGLE)
    state = speculative.prefill(target.params, target.config, eagle,
                                jnp.asarray([PROMPTS[0] + [0] * 23]), jnp.asarray([9]),
                                jnp.asarray([8]), jax.random.key(0))
    args = (eagle.params, state.drafter_state, state.draft_input(64), jax.random.key(0),
            Sampling())
    draft_t = eagle.spec.propose(*args, tree).tokens_BxN
    draft_c = eagle.spec.propose(*args, trees.chain(4)).tokens_BxN
    zeros = [tree.paths.index((0,) * d) for d in range(1, 5)]
    assert np.asarray(draft_t)[0, zeros].tolist() == np.asarray(draft_c)[0].tolist()


def test_ngram_tree_candidates():
    """Distinct continuations by match length, then recency; a missing one repeats the node's
    token. Text "4 7 1 4 9 7 4 7": after "4 7" came 1 (n=2); after "7", 4 (latest) and 1."""
    spec = jaxspec.ngram_drafter(2).spec
    tree = trees.make_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
    toks = jnp.asarray([[4, 7, 1, 4, 9, 7, 4, 7, 0, 0, 0, 0]])
    inp = DraftInput(toks, jnp.asarray([8]), jnp.zeros((1, 12, 0)), 10)
    out = spec.propose({}, (), inp, jax.random.key(0), Sampling(1.0), tree)
    draft, q = out.tokens_BxN, out.q
    # Root: 1 ("4 7"), 4 ("7" at 5), then none left: 7 repeated. Node 1 -> "7 1": after it 4,
    # and after "1" only 4 again: the repeat of 1. Node 4 -> "7 4": 7 (n=2).
    assert np.asarray(draft).tolist() == [[1, 4, 7, 4, 1, 7]]
    assert np.all(np.asarray(q.probs_BxGxK) == 1)


# -- greedy identity ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def free(target):
    return jaxspec.generate(target, PROMPTS, MAX_NEW).token_ids


@pytest.fixture(scope="module")
def reference(target, free, stop):
    res = jaxspec.generate(target, PROMPTS, MAX_NEW, stop=stop)
    assert len(res.token_ids[0]) < MAX_NEW[0]
    return res.token_ids


@pytest.fixture(scope="module")
def drafters(target, near_model):
    D = target.config.hidden_size
    return {
        "near": near_model,
        "layer_skip": jaxspec.layer_skip_drafter(target, [1]),
        "ngram": jaxspec.ngram_drafter(3),
        "medusa": hidden_drafter(target, "medusa", {"w": jax.random.normal(
            jax.random.key(7), (4, D, D)) * D ** -0.5}, depth=4),
        "hydra": hidden_drafter(target, "hydra", head_params("hydra", target.config, 4,
                                                             jax.random.key(8)), depth=4),
        "eagle": hidden_drafter(target, "eagle", head_params("eagle", target.config, 4,
                                                             jax.random.key(8), target.params)),
    }


@pytest.mark.parametrize("kind,tree", [
    ("near", MEDUSA), ("near", EAGLE), ("near", RANDOM), ("layer_skip", RANDOM),
    ("ngram", MEDUSA), ("medusa", MEDUSA), ("hydra", RANDOM), ("eagle", EAGLE),
], ids=lambda x: x if isinstance(x, str) else f"{len(x)}nodes")
def test_ragged_batch_matches_generate(target, drafters, reference, stop, kind, tree):
    res = jaxspec.speculative_generate(target, drafters[kind], PROMPTS, tree=tree,
                                       max_new_tokens=MAX_NEW, stop=stop)
    assert res.token_ids == reference
    _check_stats(res, tree)


def test_single_prompt_and_trees_gain_more_than_chains(target, drafters, stop):
    """One prompt; a tree of depth 3 gains more per step than the chain of 3 (greedy, so this
    is deterministic): rank-1 nodes get accepted."""
    prompt = [3, 14, 15, 9, 26, 5, 3, 14, 15]
    ref = jaxspec.generate(target, prompt, max_new_tokens=40).token_ids
    res = jaxspec.speculative_generate(target, drafters["near"], prompt, tree=RANDOM,
                                       max_new_tokens=40)
    assert res.token_ids == ref
    _check_stats(res, RANDOM)
    # As in the ragged batch tests here and in test_greedy_identity.py (compiled once).
    tree = jaxspec.speculative_generate(target, drafters["near"], PROMPTS, tree=MEDUSA,
                                        max_new_tokens=MAX_NEW, stop=stop)
    chain = jaxspec.speculative_generate(target, drafters["near"], PROMPTS, gamma=3,
                                         max_new_tokens=MAX_NEW, stop=stop)
    assert tree.tau > chain.tau + 0.2


def test_gemma3_sliding_window_tree(tiny):
    """Sliding layers (window 4) see tree nodes by their positions, not their scratch slots."""
    cfg = tiny.sliding_gemma_config()
    target = tiny.model(cfg, 10, "gemma")
    prompts = [[4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23], [9, 1]]
    ref = jaxspec.generate(target, prompts, max_new_tokens=[20, 27])
    res = jaxspec.speculative_generate(target, tiny.perturbed(target, 11, 0.05), prompts,
                                       tree=EAGLE, max_new_tokens=[20, 27])
    assert res.token_ids == ref.token_ids
    assert res.tau > 1.5


# -- sampling: the exact distribution ----------------------------------------------------------

# Width 2 at both depths: 6 nodes, so prompt 7 + 2 tokens + 6 + 1 fills the 16 positions.
WIDE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("s,bound", [(Sampling(1.0), TV_BOUND), (Sampling(0.7, top_k=4), 0.01)],
                         ids=["t1", "t0.7-topk4"])
def test_model_drafter_tree_matches_target_distribution(small_target, small_drafter, s, bound):
    """Drawing the correction without removing the rejected siblings' mass (max(p - q_i, 0)
    for the last sibling only) measured TV 0.036 at T=1 and 0.017 under top-k 4, where at most
    16 cells carry mass and this exact sampler measures 0.007: hence the tighter bound there."""
    exact, _ = exact_joint(small_target, s)
    got = empirical_joint(small_target, small_drafter, s, None, 4, tree=WIDE)
    assert tv(got, exact) < bound
    assert got[exact == 0].sum() == 0


def test_ngram_tree_matches_target_distribution(small_target):
    """One-hot drafts: rank 0 is 7, rank 1 repeats the last token 2 (no other match)."""
    s = Sampling(1.0)
    exact, _ = exact_joint(small_target, s)
    got = empirical_joint(small_target, jaxspec.ngram_drafter(3), s, None, 2, tree=WIDE)
    assert tv(got, exact) < TV_BOUND


# -- cache compaction --------------------------------------------------------------------------


def test_accepted_path_is_moved_into_place(target):
    """Two rows of different lengths; each row's target argmax sits at rank 1 at depth 1 and
    at rank 1 under it, so the accepted path is nodes (1,), (1, 1) (feed 2, 5), kept in scratch
    slots 2 and 5 past the last token. After compaction the cache's slots [0, length) equal
    feeding the new text token by token, and the next step's logits a full forward's."""
    tree = trees.make_tree([(0,), (1,), (0, 0), (1, 0), (1, 1), (1, 2)])
    texts = [[5, 17, 3, 22, 9, 41, 5], [7, 2]]
    T = 32
    ref = jaxspec.generate(target, texts, max_new_tokens=3).token_ids
    toks = jnp.asarray([t + [0] * (T - len(t)) for t in texts])
    lengths = jnp.asarray([len(t) for t in texts])
    state = speculative.prefill(target.params, target.config, None, toks, lengths,
                                jnp.asarray([8, 8]), jax.random.key(0))
    other = lambda t: (t + 1) % 64
    draft = jnp.asarray([[other(a), a, other(b), other(b), b, other(b)] for a, b, _ in ref])
    logits, cache, _ = speculative.verify(target.params, target.config, state, draft, tree)
    n, emitted, path = speculative.accept(jax.random.key(0), logits, draft, None, Sampling(),
                                          tree=tree)
    assert n.tolist() == [2, 2] and path.tolist() == [[0, 2, 5]] * 2
    assert emitted.tolist() == ref
    cache = trees.compact(cache, lengths - 1, path, n)
    state = speculative.advance(state, n, emitted, speculative.no_stops(64), cache, (), state.key,
                                jnp.zeros((2, 3, 0)), tree.size + 1)
    new = [t + r for t, r in zip(texts, ref)]
    assert state.lengths_B.tolist() == [len(t) for t in new]
    one_by_one = init_cache(target.config, 2, T)
    for p in range(max(map(len, new)) - 1):  # rows past their text write slots never compared
        _, one_by_one = forward(target.params, target.config, state.tokens_BxT[:, p:p + 1],
                                jnp.full((2, 1), p), one_by_one)
    for b, t in enumerate(new):
        for got, want in zip(cache.keys + cache.values, one_by_one.keys + one_by_one.values):
            # 1e-6 of the largest value: float32 rounding differs with the shapes fed.
            want = np.asarray(want[b, :len(t) - 1])
            np.testing.assert_allclose(got[b, :len(t) - 1], want, rtol=0,
                                       atol=1e-6 * np.abs(want).max())
    logits, _, _ = speculative.verify(target.params, target.config, state,
                                      jnp.zeros((2, 1), jnp.int32))
    full = jaxspec.score(target, [t + [0] * (12 - len(t)) for t in new])
    for b, t in enumerate(new):
        np.testing.assert_allclose(logits[b, 0], full[b, len(t) - 1], atol=1e-5)
