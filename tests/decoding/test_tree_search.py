"""`jaxspec tune-tree`: acceptance by depth and rank from a replayed full-tree decode (the same
steps as the decode itself, the same ranks as the drafter's plain forward over the text), the
greedy growth and the tree it picks under costs, clear errors, and the bench config."""

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import jaxspec
from jaxspec.cli import _tree
from jaxspec.decoding import tree_search, trees
from jaxspec.errors import UserError
from jaxspec.loading import forward_logits

PROMPTS = [[1, 5, 2, 7, 1, 5, 2], [3, 3, 9], [4, 8, 15, 16, 23, 42, 4, 8, 15]]
W, D, NEW = 2, 3, 20
P = [[0.6, 0.2], [0.5, 0.1]]
ORDER = [(0,), (0, 0), (1,), (1, 0), (0, 1), (1, 1)]  # by path probability:
PROBS = [0.6, 0.3, 0.2, 0.1, 0.06, 0.02]
FLAT = {"1": 1.0, "8": 1.0}
SLOPE = {"1": 1.0, "8": 1.35}  # verifying S positions costs 1 + 0.05 (S - 1)


@pytest.fixture(scope="module")
def measured(target, near_model):
    return tree_search.acceptance(target, near_model, PROMPTS, W, D, max_new_tokens=NEW)


def test_a_perfect_drafter_matches_at_rank_0_at_every_depth(target):
    acc = tree_search.acceptance(target, target, PROMPTS, W, D, max_new_tokens=NEW)
    assert acc.p_AxW.tolist() == [[1.0, 0.0]] * D and (acc.tried_A > 0).all()
    assert all(set(row[:-1]) <= {D + 1} for row in acc.gains)


def test_steps_are_those_of_the_full_tree_decode(target, near_model, measured):
    res = jaxspec.speculative_generate(target, near_model, PROMPTS, max_new_tokens=NEW,
                                       tree=trees.full_tree([W] * D))
    assert measured.gains == res.accept_lengths


def test_counts_equal_the_ranks_of_the_drafters_own_forward(target, near_model, measured):
    """On the accepted path a model drafter's context is the text itself: the matching rank at
    depth d of a step at length t is the rank of token t + d - 1 in the drafter's plain forward
    over the text at position t + d - 2."""
    new = jaxspec.generate(target, PROMPTS, max_new_tokens=NEW).token_ids
    rows = [p + n for p, n in zip(PROMPTS, new)]
    text_BxL = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for b, row in enumerate(rows):
        text_BxL[b, :len(row)] = row
    logits_BxLxV = forward_logits(near_model.params, near_model.config, jnp.asarray(text_BxL))
    top_BxLxW = np.argsort(-np.asarray(logits_BxLxV), axis=-1)[..., :W]
    hits_AxW, tried_A, gains = np.zeros((D, W), int), np.zeros(D, int), []
    for p, row, top_LxW in zip(PROMPTS, rows, top_BxLxW):
        t, end, steps = len(p), len(row), []
        while t < end:
            n = 0
            for d in range(min(D, end - t)):
                tried_A[d] += 1
                rank = np.flatnonzero(top_LxW[t - 1 + d] == row[t + d])
                if not len(rank):
                    break
                hits_AxW[d, rank[0]] += 1
                n += 1
            steps.append(min(n + 1, end - t))
            t += steps[-1]
        gains.append(steps)
    assert measured.gains == gains
    assert measured.hits_AxW.tolist() == hits_AxW.tolist()
    assert measured.tried_A.tolist() == tried_A.tolist()
    assert hits_AxW[:, 1].sum() > 0 and tried_A[-1] > 0  # rank 1 and the last depth are read
    assert "depth  steps  rank 0  rank 1" in measured.describe()


def test_growth_adds_nodes_by_path_probability():
    nodes = tree_search.growth(np.array(P), 6, 2)
    assert [path for path, _ in nodes] == ORDER
    assert [prob for _, prob in nodes] == pytest.approx(PROBS)
    assert [path for path, _ in tree_search.growth(np.array(P), 6, 1)] == [(0,), (1,)]
    assert len(tree_search.growth(np.array(P), 3, 2)) == 3


def test_best_tree_maximises_the_expected_speedup():
    choice = tree_search.best_tree(P, SLOPE, 0.0, 6)
    tau_N = 1 + np.cumsum(PROBS)
    speed_N = tau_N / (1 + 0.05 * np.arange(1, 7))  # N nodes: N + 1 positions
    n = int(np.argmax(speed_N))
    assert n == 3 and choice.best.tree == trees.make_tree(ORDER[:n + 1])
    assert choice.best.tau == pytest.approx(2.2)
    assert choice.best.speedup == pytest.approx(speed_N[n])
    assert choice.chain.tree == trees.chain(2) and choice.chain.tau == pytest.approx(1.9)
    assert choice.chain.speedup == pytest.approx(1.9 / 1.1)
    assert "chosen tree: 4 nodes, depth 2: [[0], [1], [0, 0], [1, 0]]" in choice.describe()
    free = tree_search.best_tree(P, FLAT, 0.0, 6).best  # every node gains, none costs
    assert free.tree.size == 6 and free.tau == pytest.approx(1 + sum(PROBS))


def test_costs_shape_the_tree():
    steep = tree_search.best_tree(P, {"1": 1.0, "2": 1.1, "3": 1.8, "8": 3.0}, 0.05, 6)
    assert steep.best.tree == trees.chain(1) and steep.best == steep.chain
    # A costly drafter pays per depth: one wide level beats every tree growth nests.
    wide = tree_search.best_tree(P, FLAT, 0.5, 6)
    assert wide.best.tree == trees.make_tree([(0,), (1,)])
    assert wide.best.speedup == pytest.approx(1.8 / 1.5)
    assert wide.chain.tree == trees.chain(1)
    none = tree_search.best_tree(P, {"1": 1.0, "2": 2.0, "8": 8.0}, 1.0, 6)
    assert none.best.speedup < 1 and "no tree pays" in none.describe()


@pytest.mark.parametrize("kw, msg", [
    (dict(width=0), "width must be an int >= 1, got 0"),
    (dict(depth=0), "depth must be an int >= 1, got 0"),
    (dict(width=1.5), "width must be an int >= 1"),
    (dict(width=8), "584 nodes of the full tree"),
])
def test_bad_measurement_settings_are_clear_errors(target, kw, msg):
    with pytest.raises(UserError, match=msg):
        tree_search.acceptance(target, target, PROMPTS, **{"width": W, "depth": D, **kw},
                               max_new_tokens=NEW)


@pytest.mark.parametrize("args, msg", [
    ((P, FLAT, 0.0, 0), "budget must be an int >= 1, got 0"),
    ((P, FLAT, 0.0, 8), "budget 8 needs the cost of verifying 9 positions; the profile "
                        "measured up to 8"),
    (([[1.2, 0.1]], FLAT, 0.0, 4), "acceptance must be probabilities"),
    (([0.5, 0.1], FLAT, 0.0, 4), "acceptance must be probabilities"),
    ((P, FLAT, -0.1, 4), "c must be >= 0"),
])
def test_bad_choice_settings_are_clear_errors(args, msg):
    with pytest.raises(UserError, match=msg):
        tree_search.best_tree(*args)


def test_bench_config_runs_the_tree_and_the_best_chain(measured):
    choice = tree_search.best_tree(P, SLOPE, 0.0, 6)
    text = tree_search.bench_config(choice, measured, {"target": "t", "questions": "q.jsonl"},
                                    "layerskip:1")
    cfg = yaml.safe_load(text)
    assert cfg == {"target": "t", "questions": "q.jsonl", "gammas": [2],
                   "tree": "[[0], [1], [0, 0], [1, 0]]", "methods": ["ar", "layerskip:1"]}
    assert _tree(cfg["tree"]) == choice.best.tree.paths
    assert "expected tau 2.200" in text and f"over {len(sum(measured.gains, []))} steps" in text
    named = yaml.safe_load(tree_search.bench_config(choice, measured, {}, "gemma3-270m-deen"))
    assert named["methods"] == ["ar", "drafter:gemma3-270m-deen"]
