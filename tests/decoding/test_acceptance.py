"""The acceptance rule, the n-gram drafter's proposals and `sampling.probs`, against numbers
worked out by hand or by the theory (acceptance probability sum_x min(p(x), q(x)))."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.decoding import sampling, speculative, trees
from jaxspec.decoding.sampling import DraftProbs, Sampling, pick, probs
from jaxspec.drafters.base import DraftInput
from jaxspec.drafters.ngram import NgramSpec

accept = jax.jit(speculative.accept, static_argnames="sampling")


def tv(a, b):
    return 0.5 * float(np.abs(np.asarray(a) - np.asarray(b)).sum())


# --- accept, sampling: measured against the theory --------------------------------------------

P_LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -0.5, 0.3], np.float32)
Q_LOGITS = np.array([0.0, 2.0, 0.5, 1.0, 0.2, -1.0, 1.2, -0.3], np.float32)
BONUS_LOGITS = np.array([-1.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.5, -2.0], np.float32)


@pytest.mark.parametrize("s", [Sampling(1.0), Sampling(0.8, top_k=5), Sampling(1.0, top_p=0.7)],
                         ids=["t1", "t0.8-topk5", "topp0.7"])
def test_accept_gamma1_rate_and_output_distribution(s):
    """Drafts drawn from q are accepted with probability sum_x min(p, q); the first emitted token
    (accepted draft or residual correction) is distributed as p; after an acceptance the bonus
    token is distributed as the next position's p."""
    B, V = 200_000, len(P_LOGITS)
    p = np.asarray(probs(jnp.asarray(P_LOGITS), s), np.float64)
    q_V = probs(jnp.asarray(Q_LOGITS), s)
    p_bonus = np.asarray(probs(jnp.asarray(BONUS_LOGITS), s), np.float64)
    k_draft, k_acc = jax.random.split(jax.random.key(7))
    draft_Bx1 = jax.random.categorical(k_draft, jnp.log(q_V), shape=(B, 1)).astype(jnp.int32)
    logits = jnp.broadcast_to(jnp.stack([P_LOGITS, BONUS_LOGITS]), (B, 2, V))
    q = DraftProbs(jnp.broadcast_to(q_V, (B, 1, V)))
    n_B, emitted, _ = jax.device_get(accept(k_acc, logits, draft_Bx1, q, s))

    beta = float(np.minimum(p, np.asarray(q_V, np.float64)).sum())
    assert 0.1 < beta < 0.9  # both outcomes are common
    se = math.sqrt(beta * (1 - beta) / B)
    assert abs(n_B.mean() - beta) < 5 * se
    # Accepted rows emit their draft at slot 0.
    ok = n_B == 1
    assert np.array_equal(emitted[ok, 0], np.asarray(draft_Bx1)[ok, 0])
    assert tv(np.bincount(emitted[:, 0], minlength=V) / B, p) < 0.01
    assert tv(np.bincount(emitted[ok, 1], minlength=V) / ok.sum(), p_bonus) < 0.015
    assert np.all(p[emitted[:, 0]] > 0)  # never a token the processing removed


def test_accept_gamma3_run_lengths():
    """With the same p, q at every position, P(n >= k) = beta ** k."""
    B, G, V = 100_000, 3, len(P_LOGITS)
    s = Sampling(1.0)
    p = np.asarray(probs(jnp.asarray(P_LOGITS), s), np.float64)
    q_V = probs(jnp.asarray(Q_LOGITS), s)
    beta = float(np.minimum(p, np.asarray(q_V, np.float64)).sum())
    k_draft, k_acc = jax.random.split(jax.random.key(8))
    draft = jax.random.categorical(k_draft, jnp.log(q_V), shape=(B, G)).astype(jnp.int32)
    logits = jnp.broadcast_to(jnp.asarray(P_LOGITS), (B, G + 1, V))
    q = DraftProbs(jnp.broadcast_to(q_V, (B, G, V)))
    n_B, _, _ = jax.device_get(accept(k_acc, logits, draft, q, s))
    for k in range(1, G + 1):
        want = beta ** k
        assert abs((n_B >= k).mean() - want) < 5 * math.sqrt(want * (1 - want) / B)


@pytest.mark.parametrize("kind", ["subset", "one-hot"])
def test_sparse_q_decides_as_its_dense_form(kind):
    """q kept as K ids and their mass (a subset head, a one-hot draft) gives the acceptances and
    corrections of the same q written out over the whole vocabulary, bit for bit."""
    B, G, V = 4096, 2, len(P_LOGITS)
    s = Sampling(1.0)
    ids_K = jnp.asarray([0, 2, 3, 6, 7], jnp.int32)
    q_K = probs(jnp.asarray(Q_LOGITS)[ids_K], s)
    k_draft, k_acc = jax.random.split(jax.random.key(9))
    draft = ids_K[jax.random.categorical(k_draft, jnp.log(q_K), shape=(B, G))]
    if kind == "subset":
        sparse = DraftProbs(jnp.broadcast_to(q_K, (B, G, 5)), jnp.broadcast_to(ids_K, (B, G, 5)))
        dense = DraftProbs(jnp.broadcast_to(jnp.zeros(V).at[ids_K].set(q_K), (B, G, V)))
    else:
        sparse = DraftProbs(jnp.ones((B, G, 1)), draft[..., None])
        dense = DraftProbs(jax.nn.one_hot(draft, V))
    logits = jnp.broadcast_to(jnp.stack([P_LOGITS, BONUS_LOGITS, P_LOGITS]), (B, G + 1, V))
    n_dense, out_dense, _ = jax.device_get(accept(k_acc, logits, draft, dense, s))
    n_sparse, out_sparse, _ = jax.device_get(accept(k_acc, logits, draft, sparse, s))
    assert 0 < n_dense.mean() < G  # rejections and acceptances both happen
    np.testing.assert_array_equal(n_sparse, n_dense)
    np.testing.assert_array_equal(out_sparse, out_dense)


@pytest.fixture(scope="module")
def small(small_target, small_drafter):
    return small_target, small_drafter


PROMPT = [1, 5, 2, 7, 1, 5, 2]


def _last_probs(model, s, vocab_ids=None, vocab=8):
    p = np.asarray(probs(jnp.asarray(jaxspec.score(model, [PROMPT])[0, -1]), s), np.float64)
    if vocab_ids is None:
        return p
    full = np.zeros(vocab)
    full[vocab_ids] = p
    return full


@pytest.mark.parametrize("kind", ["model", "subset"])
def test_loop_first_step_acceptance_matches_theory(tiny, small, kind):
    """Full loop, 8192 copies of one prompt: the first step's first draft is accepted (the step
    gains 2 or more tokens) with probability sum_x min(p, q); for a reduced-vocabulary head q is
    its distribution placed at its vocab_ids, zero elsewhere. (gamma 2 and these models, as in
    test_sampling_exact, share its compiled function.)"""
    target, draft_model = small
    s = Sampling(1.0)
    if kind == "model":
        drafter, q = draft_model, _last_probs(draft_model, s)
    else:
        ids = [0, 2, 3, 6, 7]
        drafter = tiny.subset_head_drafter(target, ids, seed=5, scale=0.5)
        head = jaxspec.Model(drafter.spec.config, drafter.params["model"])
        q = _last_probs(head, s, ids)
    beta = float(np.minimum(_last_probs(target, s), q).sum())
    assert 0.1 < beta < 0.9
    B = 8192
    res = jaxspec.speculative_generate(target, drafter, [PROMPT] * B, gamma=2, max_new_tokens=2,
                                       temperature=1.0, seed=3)
    first = np.array([row[0] for row in res.accept_lengths])
    assert set(np.unique(first)) <= {1, 2}  # a third token would pass the budget of 2
    assert abs((first == 2).mean() - beta) < 5 * math.sqrt(beta * (1 - beta) / B)


# --- accept, greedy: hand-made cases ----------------------------------------------------------

def test_accept_greedy_is_prefix_match():
    V, G = 5, 3
    argmax = np.array([[1, 2, 3, 4],   # drafts all match: 3 accepted, 4 is the bonus
                       [0, 0, 0, 0],   # mismatch at the second draft
                       [4, 3, 2, 1],   # mismatch at the first draft
                       [2, 2, 2, 2]])  # drafts 0 and 2 match, 1 does not: a prefix of 1
    drafts = np.array([[1, 2, 3], [0, 1, 0], [0, 3, 2], [2, 0, 2]], np.int32)
    logits = np.full((4, G + 1, V), -1.0, np.float32)
    np.put_along_axis(logits, argmax[..., None], 3.0, axis=-1)
    n_B, emitted, _ = jax.device_get(accept(jax.random.key(0), jnp.asarray(logits),
                                         jnp.asarray(drafts), None, Sampling(0.0)))
    assert n_B.tolist() == [3, 1, 0, 1]
    for b, n in enumerate(n_B):
        # What the row keeps: the accepted drafts, then the target's own token.
        assert emitted[b, :n + 1].tolist() == drafts[b, :n].tolist() + [argmax[b, n]]


def test_accept_gamma0_is_one_target_step():
    logits = jnp.asarray([[[0.0, 5.0, 1.0]], [[3.0, 0.0, 1.0]]])
    n_B, emitted, _ = accept(jax.random.key(0), logits, jnp.zeros((2, 0), jnp.int32), None,
                          Sampling(0.0))
    assert n_B.tolist() == [0, 0] and emitted[:, 0].tolist() == [1, 0]


# --- the n-gram drafter -----------------------------------------------------------------------

NGRAM_CASES = [
    # (text, proposals for gamma 3)
    ([1, 2, 3, 4, 1, 2, 3], [4, 1, 2]),  # trigram "1 2 3" seen at 0: propose what followed
    ([5, 6, 7, 5, 6, 8, 5, 6], [8, 5, 6]),  # "5 6" seen at 0 and 3: the latest wins
    ([4, 7, 1, 4, 9, 7, 4, 7], [1, 4, 9]),  # "4 7" (n=2) beats the later unigram "7"
    ([2, 3, 2, 3], [2, 3, 3]),  # continuation runs into the text's end: clipped to the last
    ([3, 1, 4], [4, 4, 4]),  # no earlier occurrence: repeat the last token
    ([6], [6, 6, 6]),  # a 1-token text
]


def test_ngram_proposals_on_hand_made_buffer():
    T, junk = 12, 9
    tokens = np.full((len(NGRAM_CASES), T), junk, np.int32)
    # The slots past each text hold a copy of its end, which a match must never use.
    for b, (text, _) in enumerate(NGRAM_CASES):
        tokens[b, :len(text)] = text
        tail = text[-3:]
        tokens[b, len(text):len(text) + len(tail)] = tail
    lengths = np.array([len(t) for t, _ in NGRAM_CASES], np.int32)
    spec = NgramSpec(max_ngram=3)
    inp = DraftInput(jnp.asarray(tokens), jnp.asarray(lengths), jnp.zeros((len(tokens), T, 0)),
                     10)
    out = spec.propose({}, (), inp, jax.random.key(0), Sampling(0.0), trees.chain(3))
    draft, q = out.tokens_BxN, out.q
    assert q is None
    assert np.asarray(draft).tolist() == [want for _, want in NGRAM_CASES]
    # Sampling: the proposal is deterministic, so q is one-hot on it.
    out = spec.propose({}, (), inp, jax.random.key(0), Sampling(1.0), trees.chain(3))
    draft_s, q_s = out.tokens_BxN, out.q
    assert np.array_equal(draft_s, draft)
    assert np.array_equal(q_s.ids_BxGxK[..., 0], draft) and np.all(q_s.probs_BxGxK == 1)


def test_ngram_max_ngram_1_uses_unigrams():
    tokens = jnp.asarray([[4, 7, 1, 4, 9, 7, 4, 7, 0, 0]], jnp.int32)
    inp = DraftInput(tokens, jnp.asarray([8]), jnp.zeros((1, 10, 0)), 10)
    draft = NgramSpec(max_ngram=1).propose({}, (), inp, jax.random.key(0), Sampling(0.0),
                                           trees.chain(2)).tokens_BxN
    assert draft.tolist() == [[4, 7]]  # latest earlier "7" is at 5, followed by "4 7"


# --- sampling.probs: kept sets and values by hand ---------------------------------------------

LOGITS = np.array([1.0, 2.0, 3.0, 0.0])


def _softmax_on(keep, logits=LOGITS, t=1.0):
    out = np.zeros(len(logits))
    e = np.exp(logits[keep] / t)
    out[keep] = e / e.sum()
    return out


@pytest.mark.parametrize("s,keep", [
    (Sampling(1.0), [0, 1, 2, 3]),
    (Sampling(1.0, top_k=2), [1, 2]),
    (Sampling(1.0, top_k=4), [0, 1, 2, 3]),
    (Sampling(1.0, top_k=10), [0, 1, 2, 3]),
    # softmax = [.087, .237, .644, .032]: 0.644 alone reaches 0.6 ...
    (Sampling(1.0, top_p=0.6), [2]),
    # ... not 0.7, which needs the second token; 0.644 + 0.237 = 0.881 < 0.9 needs a third.
    (Sampling(1.0, top_p=0.7), [1, 2]),
    (Sampling(1.0, top_p=0.9), [0, 1, 2]),
    (Sampling(1.0, top_p=1.0), [0, 1, 2, 3]),
    # top-k first, then top-p over the renormalised rest: softmax([1, 2, 3]) = [.090, .245, .665]
    (Sampling(1.0, top_k=3, top_p=0.9), [1, 2]),
], ids=lambda x: str(x))
def test_probs_keeps_the_right_set(s, keep):
    got = np.asarray(probs(jnp.asarray(LOGITS, jnp.float32), s), np.float64)
    np.testing.assert_allclose(got, _softmax_on(keep), atol=1e-6)


def test_probs_temperature_and_batching():
    logits = np.stack([LOGITS, LOGITS[::-1]]).astype(np.float32)
    got = np.asarray(probs(jnp.asarray(logits)[:, None], Sampling(0.5, top_k=3)))
    assert got.shape == (2, 1, 4)
    np.testing.assert_allclose(got[0, 0], _softmax_on([0, 1, 2], t=0.5), atol=1e-6)
    np.testing.assert_allclose(got[1, 0], _softmax_on([1, 2, 3], LOGITS[::-1], t=0.5), atol=1e-6)


def test_pick_greedy_is_argmax():
    tok, dist = pick(jax.random.key(0), jnp.asarray([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]]),
                     Sampling(0.0))
    assert tok.tolist() == [1, 0] and dist is None


def test_two_level_argmax_is_argmax_with_its_ties():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 2048)).astype(np.float32)
    logits[0, 0, [700, 1500]] = 9.0  # a tie across blocks: the first wins
    logits[1, 2, [10, 11]] = 9.0  # a tie inside a block
    for v in (2048, 300, 1500):  # whole blocks, one block, a vocabulary not a multiple of them
        np.testing.assert_array_equal(sampling.argmax(jnp.asarray(logits[..., :v]), block=512),
                                      np.argmax(logits[..., :v], -1))
