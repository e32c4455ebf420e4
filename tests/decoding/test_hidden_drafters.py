"""Hidden-state drafters (Medusa, Hydra, EAGLE; drafters/hidden.py) in the decode loop.

Greedy output equals `generate`'s for every kind and gamma in {1, 3, 5} on the ragged batch of
test_greedy_identity.py (with its stop token), on a single prompt, with gamma="auto", with a head
over 16 of the 64 ids, and on a tiny Gemma 3 with sliding layers. Random heads are rarely
accepted, so two heads with a known behaviour make the accept paths run: a zero Medusa head is
the target's own head on the feature it reads, so every draft is the target's argmax at position
length - 2 and each step's gain follows from the reference continuation alone (a drafter fed
another slot gains differently); and an EAGLE head that is nearly a copy of a one-layer target
(fc passes the token's embedding through) has most drafts accepted.

With that EAGLE head, the features the loop hands the drafter (slots < length - 1, at every step)
and keeps at the end equal one full forward over the final text, and its incrementally caught-up
cache drafts what a fresh one does. Sampled output has the target's exact joint distribution of
two tokens (as in test_sampling_exact.py). Checkpoints round trip in bfloat16 and are refused by
another target or when corrupt.

Compiles dominate the runtime (~3 s of CPU each), so the single prompt takes one gamma per kind,
the subset head and top-k sampling one kind each; drafters that share a spec and a name share
compiled functions.
"""

import dataclasses
import functools
import shutil
from collections import Counter

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxspec
from jaxspec.checkpoints import heads
from jaxspec.decoding import runner, speculative, trees
from jaxspec.decoding.sampling import Sampling, probs
from jaxspec.drafters.base import Drafter, DraftInput
from jaxspec.drafters.eagle import EagleSpec
from jaxspec.drafters.hidden import head_params, hidden_drafter
from jaxspec.errors import UserError
from jaxspec.models.cache import init_cache
from jaxspec.models.transformer import forward

KINDS = ["medusa", "hydra", "eagle"]
DEPTH = 5
PROMPTS = [[5, 17, 3, 22, 9, 41, 5, 17, 3], [7], [12, 30] * 9 + [1], [60, 2, 33]]
MAX_NEW = [23, 31, 9, 17]


def _check_stats(res, gamma):
    """accept_lengths account for every token, and each step gains 1..gamma+1 tokens."""
    for toks, gains in zip(res.token_ids, res.accept_lengths):
        assert sum(gains) == len(toks)
        assert all(1 <= g <= gamma + 1 for g in gains)


def _gains(res):
    return [g for row in res.accept_lengths for g in row]


def _head(kind, config, target_params):
    """A random Medusa head (nonzero w), Hydra's initialisation, or EAGLE's (its decoder layer
    from the target's last layer)."""
    D = config.hidden_size
    if kind == "medusa":
        return {"w": jax.random.normal(jax.random.key(7), (DEPTH, D, D)) * D ** -0.5}
    return head_params(kind, config, DEPTH, jax.random.key(8), target_params)


def _zero_medusa(model):
    return hidden_drafter(model, "medusa", head_params("medusa", model.config, DEPTH,
                                                       jax.random.key(0)), depth=DEPTH)


def _clone_eagle_head(model, embed_std=0.5):
    """An EAGLE head that is nearly `model` when `model` has one layer: its decoder layer is the
    target's, and fc feeds it the drafted token's embedding (normalised, times the embeddings'
    std: about what the target's layer sees) and ignores the feature."""
    D = model.config.hidden_size
    head = head_params("eagle", model.config, DEPTH, jax.random.key(0), model.params)
    return {**head, "fc": jnp.concatenate([jnp.zeros((D, D)), embed_std * jnp.eye(D)], axis=1)}


def _bf16(tree):
    return jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), tree)


@pytest.fixture(scope="module")
def free(target):
    res = jaxspec.generate(target, PROMPTS, MAX_NEW)
    assert [len(t) for t in res.token_ids] == MAX_NEW
    return res.token_ids


@pytest.fixture(scope="module")
def reference(target, free, stop):
    res = jaxspec.generate(target, PROMPTS, MAX_NEW, stop=stop)
    assert res.token_ids == [row[:row.index(stop) + 1] if stop in row else row for row in free]
    assert len(res.token_ids[0]) < MAX_NEW[0]
    return res.token_ids


@pytest.fixture(scope="module")
def drafters(target):
    return {kind: hidden_drafter(target, kind, _head(kind, target.config, target.params),
                                 depth=DEPTH) for kind in KINDS}


@pytest.fixture(scope="module")
def one_layer(tiny):
    """A one-layer target, which `_clone_eagle_head` drafts well for."""
    return tiny.model(tiny.config(num_layers=1), 0, "one-layer")


# -- 1. greedy identity ---------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("kind", KINDS)
def test_ragged_batch_matches_generate(target, drafters, reference, stop, kind, gamma):
    res = jaxspec.speculative_generate(target, drafters[kind], PROMPTS, gamma=gamma,
                                       max_new_tokens=MAX_NEW, stop=stop)
    assert res.token_ids == reference
    _check_stats(res, gamma)
    assert 1 in _gains(res)  # random heads: rejections happen


@pytest.mark.parametrize("kind,gamma", [("medusa", 3), ("hydra", 1), ("eagle", 5)])
def test_single_prompt_matches_generate(target, drafters, kind, gamma):
    prompt = [3, 14, 15, 9, 26, 5, 3, 14, 15]
    ref = jaxspec.generate(target, prompt, max_new_tokens=40)
    assert len(ref.token_ids) == 1 and len(ref.token_ids[0]) == 40
    res = jaxspec.speculative_generate(target, drafters[kind], prompt, gamma=gamma,
                                       max_new_tokens=40)
    assert res.token_ids == ref.token_ids
    _check_stats(res, gamma)


def test_auto_gamma_matches_generate(target, drafters, reference, stop):
    """Each row picks 0..4 drafts a step (one compiled branch per length, features padded)."""
    res = jaxspec.speculative_generate(target, drafters["medusa"], PROMPTS, gamma="auto",
                                       gamma_max=4, costs=(1.0, 1.1, 1.2, 1.3, 1.4),
                                       max_new_tokens=MAX_NEW, stop=stop)
    assert res.token_ids == reference
    for toks, gains, drafted in zip(res.token_ids, res.accept_lengths, res.draft_lengths):
        assert sum(gains) == len(toks) and len(gains) == len(drafted)
        assert all(0 <= d <= 4 and 1 <= a <= d + 1 for a, d in zip(gains, drafted))
    assert len({d for row in res.draft_lengths for d in row}) > 1  # rows switch lengths


def test_subset_vocabulary_head_matches_generate(target, free, reference, stop):
    """A Hydra head (it feeds each draft to the next stage) over 16 ids: the target's 12 most
    frequent greedy tokens and 4 others."""
    common = [t for t, _ in Counter(t for row in free for t in row).most_common(12)]
    ids = sorted(common + [t for t in range(64) if t not in common][:4])
    drafter = hidden_drafter(target, "hydra", _head("hydra", target.config, target.params),
                             vocab_ids=ids, depth=DEPTH)
    res = jaxspec.speculative_generate(target, drafter, PROMPTS, gamma=3,
                                       max_new_tokens=MAX_NEW, stop=stop)
    assert res.token_ids == reference
    _check_stats(res, 3)


def test_heads_of_one_kind_share_their_measured_step_costs(target, drafters, tmp_path,
                                                          monkeypatch):
    """gamma="auto" times the decode loop once per kind and depth of head: a second head of
    another language (other head rows, another name) reuses the first one's costs."""
    from jaxspec.decoding import profile

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(profile, "bandwidth_gbs", lambda: 10.0)
    head = _head("eagle", target.config, target.params)
    de = hidden_drafter(target, "eagle", head, depth=DEPTH, name="de-head")
    fr = hidden_drafter(target, "eagle", head, vocab_ids=list(range(0, 64, 2)), depth=DEPTH,
                        name="fr-head")
    measured = []
    real = profile.loop_ms
    monkeypatch.setattr(profile, "loop_ms", lambda m, d, G: measured.append(G) or real(m, d, G))
    for drafter in (de, fr):
        res = jaxspec.speculative_generate(target, drafter, PROMPTS[:1], gamma="auto",
                                           gamma_max=2, max_new_tokens=8)
        assert res.token_ids == jaxspec.generate(target, PROMPTS[:1], max_new_tokens=8).token_ids
    assert measured == [2]


def test_zero_medusa_drafts_the_targets_argmax_at_length_minus_2(target, free, stop):
    """A zero Medusa head is the target's own head on the feature it reads, f[length - 2], so
    each step drafts argmax(target logits at length - 2) three times: the last token once the
    text is past the prompt. Each step's gain is then fixed by the reference continuation (cut
    at the budget and the stop token); a drafter fed another slot, or a stale feature, drafts
    other tokens and gains differently."""
    gamma = 3
    # Continue each row gamma tokens past its budget: what a step may draft and compare with.
    longer = jaxspec.generate(target, PROMPTS, [m + gamma for m in MAX_NEW]).token_ids
    assert [t[:m] for t, m in zip(longer, MAX_NEW)] == free
    seqs = [p + t for p, t in zip(PROMPTS, longer)]
    width = max(map(len, seqs))
    argmax = np.argmax(jaxspec.score(target, [s + [0] * (width - len(s)) for s in seqs]), -1)
    expected = []
    for b, (prompt, budget) in enumerate(zip(PROMPTS, MAX_NEW)):
        n, gains = len(prompt), []
        while n - len(prompt) < budget:
            draft = argmax[b, max(n - 2, 0)]
            accepted = 0
            while accepted < gamma and seqs[b][n + accepted] == draft:
                accepted += 1
            gain = min(accepted + 1, budget - (n - len(prompt)))
            emitted = seqs[b][n:n + gain]
            gains.append(emitted.index(stop) + 1 if stop in emitted else gain)
            n += gains[-1]
            if stop in emitted:
                break
        expected.append(gains)
    flat = [g for row in expected for g in row]
    assert 1 in flat and max(flat) > 1  # the prediction has rejections and acceptances
    # Same spec and name as drafters["medusa"]: test_ragged_batch_matches_generate's function.
    res = jaxspec.speculative_generate(target, _zero_medusa(target), PROMPTS, gamma=gamma,
                                       max_new_tokens=MAX_NEW, stop=stop)
    assert res.accept_lengths == expected


# -- 2. Gemma 3 with sliding layers -----------------------------------------------------------


def test_gemma3_sliding_window_eagle_matches_generate(tiny):
    cfg = tiny.sliding_gemma_config()
    gemma = tiny.model(cfg, 10, "gemma")
    prompts = [[4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23], [9, 1]]
    ref = jaxspec.generate(gemma, prompts, max_new_tokens=[20, 27])
    assert [len(t) for t in ref.token_ids] == [20, 27]
    drafter = hidden_drafter(gemma, "eagle", head_params("eagle", cfg, DEPTH, jax.random.key(3),
                                                         gemma.params))
    res = jaxspec.speculative_generate(gemma, drafter, prompts, gamma=3,
                                       max_new_tokens=[20, 27])
    assert res.token_ids == ref.token_ids
    _check_stats(res, 3)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_gemma3_270m_untrained_head_matches_generate(gemma3, kind):
    """The real target (the session fixture) with an untrained head, ragged batch (EAGLE on it:
    the shipped heads, tests/checkpoints/test_shipped_drafters.py)."""
    prompts = ["Translate German to English:Guten Morgen, wie geht es dir?\nEnglish:",
               "Translate German to English:Das Wetter ist heute sehr schön, und wir gehen "
               "spazieren.\nEnglish:"]
    ref = jaxspec.generate(gemma3, prompts, max_new_tokens=[10, 14])
    head = head_params(kind, gemma3.config, DEPTH, jax.random.key(5), gemma3.params)
    ids = np.unique(np.concatenate([np.arange(4096), *map(np.asarray, ref.token_ids)]))
    drafter = hidden_drafter(gemma3, kind, head, ids, depth=DEPTH)
    res = jaxspec.speculative_generate(gemma3, drafter, prompts, gamma=3,
                                       max_new_tokens=[10, 14])
    assert res.token_ids == ref.token_ids
    _check_stats(res, 3)


# -- 3. feature plumbing ----------------------------------------------------------------------

STEPS = 40  # recorded steps (each gains >= 1 token, and no budget is above 31)
T = 64
FEATURE_TOL = 1e-5  # relative to the largest feature: float32 rounding, chunked against whole


@dataclasses.dataclass(frozen=True)
class Recording(EagleSpec):
    """An EAGLE spec that records, at every propose, the lengths, the whole features array it
    is given, and its drafts (in its state, so they come back in the final DecodeState)."""

    def init(self, params, inp):
        B, T_, D = inp.features_BxTxD.shape
        return {"inner": super().init(params, inp),
                "step": jnp.int32(0), "lengths": jnp.zeros((STEPS, B), jnp.int32),
                "features": jnp.zeros((STEPS, B, T_, D)),
                "drafts": jnp.zeros((STEPS, B, 8), jnp.int32)}

    def propose(self, params, state, inp, key, sampling, shape):
        draft = super().propose(params, state["inner"], inp, key, sampling, shape)
        i = state["step"]
        return draft.replace(state={
            "inner": draft.state, "step": i + 1,
            "lengths": state["lengths"].at[i].set(inp.lengths_B, mode="drop"),
            "features": state["features"].at[i].set(inp.features_BxTxD, mode="drop"),
            "drafts": state["drafts"].at[i, :, :shape.size].set(draft.tokens_BxN, mode="drop")})


_run = jax.jit(speculative.run, static_argnames="settings")


@functools.partial(jax.jit, static_argnames="config")
def _forward(params, config, tokens_BxS):
    """Logits and features over whole rows, in one forward from an empty cache."""
    B, S = tokens_BxS.shape
    positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    logits, _, feats = forward(params, config, tokens_BxS, positions, init_cache(config, B, S),
                               features=True)
    return logits, feats


def _full_features(model, tokens_BxT):
    return np.asarray(_forward(model.params, model.config, jnp.asarray(tokens_BxT))[1])


def _fresh_drafts(spec, params, tokens_NxT, lengths_N, features_NxTxD, gamma):
    """Greedy drafts of the drafter started fresh (init, then propose: EAGLE catches up on the
    whole text in one go) at each given length, from the given features."""
    def go(tokens, lengths, features):
        inp = DraftInput(tokens, lengths, features, spec.config.vocab_size)
        state = spec.init(params, inp)
        return spec.propose(params, state, inp, jax.random.key(0), Sampling(),
                            trees.chain(gamma)).tokens_BxN
    return np.asarray(jax.jit(go)(tokens_NxT, lengths_N, features_NxTxD))


def test_features_match_a_full_forward(one_layer):
    """At every step the drafter gets, in slots < length - 1, the target's hidden states over
    the text so far (a full forward over the final text: verified tokens never change), and the
    final state keeps them for all of the text but its last token; its drafts equal those of the
    same drafter started fresh at that length, on the text as it stood then.

    The good EAGLE head on the one-layer target, gamma 8: runs of accepted drafts (up to all 8
    and the bonus token, 9 features written in one step, which EAGLE then catches up on in two
    chunks of 8) and rejections (one feature). The output is the target's greedy text (each
    new token the argmax of the full forward's logits one position back)."""
    model, kind, head = one_layer, "eagle", _clone_eagle_head(one_layer)
    gamma = 8
    base = hidden_drafter(model, kind, head, depth=DEPTH)
    drafter = Drafter(base.params, Recording(model.config, DEPTH), "recording")
    B = len(PROMPTS)
    tokens = np.zeros((B, T), np.int32)
    for b, p in enumerate(PROMPTS):
        tokens[b, :len(p)] = p
    lengths = np.array([len(p) for p in PROMPTS], np.int32)
    state = _run(model.params, drafter, jnp.asarray(tokens), jnp.asarray(lengths),
                 jnp.asarray(MAX_NEW, jnp.int32), jax.random.key(0),
                 settings=speculative.Settings(model.config, trees.chain(gamma)))
    final, final_len, steps, kept, rec = jax.device_get(
        (state.tokens_BxT, state.lengths_B, state.steps_B, state.features_BxTxD,
         state.drafter_state))
    assert (final_len - lengths).tolist() == MAX_NEW
    assert int(rec["step"]) == steps.max() <= STEPS
    logits, full = map(np.asarray, _forward(model.params, model.config, jnp.asarray(final)))
    for b in range(B):
        assert (final[b, lengths[b]:final_len[b]].tolist()
                == np.argmax(logits[b, lengths[b] - 1:final_len[b] - 1], -1).tolist())

    atol = FEATURE_TOL * np.abs(full).max()
    for b in range(B):
        np.testing.assert_allclose(kept[b, :final_len[b] - 1], full[b, :final_len[b] - 1],
                                   atol=atol, rtol=0, err_msg=f"final state, row {b}")
    # Every step of every row (row b's steps are the loop's first steps[b] iterations).
    assert rec["lengths"][0].tolist() == lengths.tolist()
    idx = [(i, b) for b in range(B) for i in range(steps[b])]
    n_N = np.array([rec["lengths"][i, b] for i, b in idx])
    for (i, b), n in zip(idx, n_N):
        np.testing.assert_allclose(rec["features"][i, b, :n - 1], full[b, :n - 1], atol=atol,
                                   rtol=0, err_msg=f"row {b} step {i}")
    # The text as the loop saw it: padding from each step's length on (a one-token prompt's
    # first EAGLE step reads the token after it, padding then, the first new token at the end).
    rows = [b for _, b in idx]
    text_NxT = np.where(np.arange(T) < n_N[:, None], final[rows], 0)
    fresh = _fresh_drafts(base.spec, base.params, jnp.asarray(text_NxT), jnp.asarray(n_N),
                          jnp.asarray(full[rows]), gamma)
    np.testing.assert_array_equal(np.stack([rec["drafts"][i, b, :gamma] for i, b in idx]), fresh)

    gained = np.concatenate([np.diff([*rec["lengths"][:steps[b], b], final_len[b]])
                             for b in range(B)]).tolist()
    assert 1 in gained  # a rejection: one feature written
    assert gamma + 1 in gained  # all drafts accepted: gamma + 1 features written at once


# -- 4. sampling exactness --------------------------------------------------------------------

V = 8
PROMPT = [1, 5, 2, 7, 1, 5, 2]
ROWS = 8192
TV_BOUND = 0.02


def _processed(logits_NxV, s: Sampling):
    """Temperature then top-k, in float64 numpy (test_sampling_exact.processed without top-p)."""
    out = []
    for z in np.asarray(logits_NxV, np.float64) / s.temperature:
        order = np.argsort(-z)[:s.top_k]
        p = np.zeros(V)
        p[order] = np.exp(z[order] - z[order[0]])
        out.append(p / p.sum())
    return np.array(out)


def _exact_joint(model, s: Sampling):
    """P[t1, t2] from `jaxspec.score` logits, and p(t1)."""
    p1 = _processed(jaxspec.score(model, [PROMPT])[:, -1], s)[0]
    p2 = _processed(jaxspec.score(model, [PROMPT + [t] for t in range(V)])[:, -1], s)
    return p1[:, None] * p2, p1


@functools.partial(jax.jit, static_argnames="s")
def _first_q(drafter, tokens_1xT, lengths_1, feats_1xTxD, s):
    inp = DraftInput(tokens_1xT, lengths_1, feats_1xTxD, V)
    st = drafter.spec.init(drafter.params, inp)
    q = drafter.spec.propose(drafter.params, st, inp, jax.random.key(0), s, trees.chain(2)).q
    return q.ids_BxGxK[0, 0], q.probs_BxGxK[0, 0]


def _first_draft_q(model, drafter, s: Sampling):
    """The distribution the drafter draws its first token from on PROMPT, over all V ids."""
    tokens = jnp.zeros((1, 16), jnp.int32).at[0, :len(PROMPT)].set(jnp.asarray(PROMPT))
    feats = jnp.asarray(_full_features(model, tokens))
    ids, q = _first_q(drafter, tokens, jnp.asarray([len(PROMPT)]), feats, s)
    out = np.zeros(V)
    np.add.at(out, np.asarray(ids), np.asarray(q))
    return out


@pytest.fixture(scope="module")
def small_drafters(small_target):
    cfg = small_target.config
    return {
        "medusa": hidden_drafter(small_target, "medusa", _head("medusa", cfg, None), depth=DEPTH),
        # A head over 5 of the 8 ids: the target's mass on the other 3 comes from the residual.
        "hydra": hidden_drafter(small_target, "hydra", _head("hydra", cfg, None),
                                vocab_ids=[0, 2, 3, 5, 7], depth=DEPTH),
        "eagle": hidden_drafter(small_target, "eagle", _head("eagle", cfg, small_target.params),
                                depth=DEPTH),
    }


@pytest.mark.parametrize("kind,s,seeds", [
    ("medusa", Sampling(1.0), 3), ("hydra", Sampling(1.0), 3), ("eagle", Sampling(1.0), 3),
    # Top-k applies to every kind's logits alike (sampling.probs): one kind, the subset head.
    ("hydra", Sampling(0.7, top_k=4), 2),
], ids=["medusa-t1", "hydra-t1", "eagle-t1", "hydra-t0.7-topk4"])
def test_sampling_matches_target_distribution(small_target, small_drafters, kind, s, seeds):
    """TV of 24576 draws from the exact joint (16384 under top-k, where at most 16 cells carry
    mass): an exact sampler expects ~0.010 (~0.009 at 32768 in test_sampling_exact.py); one
    without the residual distribution ~0.12-0.19."""
    drafter = small_drafters[kind]
    exact, p1 = _exact_joint(small_target, s)
    # Drafts are accepted often but not always, so both acceptance and the residual matter.
    q1 = _first_draft_q(small_target, drafter, s)
    assert q1.sum() == pytest.approx(1.0, abs=1e-5)
    assert 0.15 < np.minimum(p1, q1).sum() < 0.8
    counts = np.zeros((V, V))
    for seed in range(seeds):
        res = jaxspec.speculative_generate(
            small_target, drafter, [PROMPT] * ROWS, gamma=2, max_new_tokens=2,
            temperature=s.temperature, top_k=s.top_k, seed=200 + seed)
        toks = np.asarray(res.token_ids)
        assert toks.shape == (ROWS, 2)
        np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
    got = counts / counts.sum()
    assert 0.5 * np.abs(got - exact).sum() < TV_BOUND
    assert got[exact == 0].sum() == 0


def test_first_draft_q(small_target, small_drafters):
    """The q the overlap guard above reads: a zero Medusa head's is the target's own
    distribution one position back; a subset head's is zero off its ids."""
    s = Sampling(1.0)
    back = probs(jnp.asarray(jaxspec.score(small_target, [PROMPT])[0, -2]), s)
    np.testing.assert_allclose(_first_draft_q(small_target, _zero_medusa(small_target), s),
                               back, atol=1e-5)
    q = _first_draft_q(small_target, small_drafters["hydra"], s)
    assert q[[1, 4, 6]].sum() == 0 and q.sum() == pytest.approx(1.0, abs=1e-5)


# -- 5. checkpoints ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_eagle(target, tmp_path_factory):
    """An EAGLE head over 16 ids, rounded to bfloat16 (what a checkpoint keeps), and its save."""
    head = _bf16(_head("eagle", target.config, target.params))
    ids = list(range(0, 64, 4))
    path = heads.save(tmp_path_factory.mktemp("heads") / "eagle", "eagle", head, ids, target,
                      DEPTH, tuned_gamma=3)
    return path, head, ids


def test_saved_head_drafts_like_the_in_memory_one(target, saved_eagle, reference, stop):
    path, head, ids = saved_eagle
    loaded = jaxspec.load_drafter(path, target=target)
    assert loaded.spec == EagleSpec(target.config, DEPTH, 3)
    assert np.asarray(loaded.params["vocab_ids"]).tolist() == ids
    for want, got in zip(jax.tree.leaves(head), jax.tree.leaves(loaded.params["head"])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    memory = hidden_drafter(target, "eagle", head, ids, DEPTH, 3, name=loaded.name)
    a = jaxspec.speculative_generate(target, memory, PROMPTS, gamma=3, max_new_tokens=MAX_NEW,
                                     stop=stop)
    b = jaxspec.speculative_generate(target, loaded, PROMPTS, max_new_tokens=MAX_NEW, stop=stop)
    assert b.gamma == 3  # the tuned gamma, by default
    assert a.token_ids == b.token_ids == reference
    assert a.accept_lengths == b.accept_lengths  # the same drafts, step by step


def test_recorded_acceptance_and_gamma_become_the_defaults(target, saved_eagle, tmp_path):
    """`jaxspec plan --into` records the acceptance and, when some gamma pays, the best one."""
    path, _, _ = saved_eagle
    tuned = shutil.copytree(path, tmp_path / "eagle")
    heads.set_accept(tuned, [0.5, 0.25], "measured by hand", 0)  # no gamma pays: kept
    assert heads.read_meta(tuned)["tuned_gamma"] == 3
    heads.set_accept(tuned, [0.6, 0.4], "measured by hand", 2)
    meta = heads.read_meta(tuned)
    assert (meta["tuned_gamma"], meta["tuned_on"]) == (2, "best gamma of measured by hand")
    loaded = jaxspec.load_drafter(tuned, target=target)
    assert loaded.spec.tuned_gamma == 2 and loaded.tuned_accept == (0.6, 0.4)
    assert jaxspec.speculative_generate(target, loaded, PROMPTS, max_new_tokens=4).gamma == 2
    # The tuned shape is the host's: heads tuned differently share one compiled loop.
    before = runner.DECODER.compiles
    assert jaxspec.speculative_generate(target, jaxspec.load_drafter(path, target=target),
                                        PROMPTS, gamma=2, max_new_tokens=4).gamma == 2
    assert runner.DECODER.compiles == before
    assert loaded.bare.spec == jaxspec.load_drafter(path, target=target).bare.spec


def test_a_tuned_tree_in_the_checkpoint_is_the_default(target, saved_eagle, reference, stop,
                                                        tmp_path):
    path, _, _ = saved_eagle
    tuned = shutil.copytree(path, tmp_path / "eagle")
    paths = [(0,), (1,), (0, 0), (0, 0, 0)]
    heads.set_tuned(tuned, paths, "tuned by hand for this test")
    assert heads.read_meta(tuned)["tuned_on"] == "tuned by hand for this test"
    loaded = jaxspec.load_drafter(tuned, target=target)
    assert loaded.spec.tuned_tree == tuple(paths) and loaded.spec.tuned_gamma == 3
    default = jaxspec.speculative_generate(target, loaded, PROMPTS, max_new_tokens=MAX_NEW,
                                           stop=stop)
    explicit = jaxspec.speculative_generate(target, loaded, PROMPTS, tree=paths,
                                            max_new_tokens=MAX_NEW, stop=stop)
    chain = jaxspec.speculative_generate(target, loaded, PROMPTS, gamma=3,
                                         max_new_tokens=MAX_NEW, stop=stop)
    assert default.token_ids == explicit.token_ids == chain.token_ids == reference
    assert default.accept_lengths == explicit.accept_lengths  # the tree, step by step
    assert default.gamma == explicit.gamma == len(paths) != chain.gamma  # nodes, not gamma 3


def test_a_tuned_branch_in_the_checkpoint_is_the_default(target, saved_eagle, reference, stop,
                                                          tmp_path):
    """A head tuned with an n-gram branch drafts with it when no shape is given, and alone at
    a given gamma."""
    path, _, _ = saved_eagle
    tuned = shutil.copytree(path, tmp_path / "eagle")
    heads.set_branch(tuned, 2, "tuned by hand for this test")
    loaded = jaxspec.load_drafter(tuned, target=target)
    assert loaded.spec.tuned_branch == 2 and loaded.spec.tuned_gamma == 3
    default = jaxspec.speculative_generate(target, loaded, PROMPTS, max_new_tokens=MAX_NEW,
                                           stop=stop)
    explicit = jaxspec.speculative_generate(target, jaxspec.hybrid_drafter(loaded, 3, 2),
                                            PROMPTS, gamma=3, max_new_tokens=MAX_NEW, stop=stop)
    alone = jaxspec.speculative_generate(target, loaded, PROMPTS, gamma=3,
                                         max_new_tokens=MAX_NEW, stop=stop)
    assert default.token_ids == explicit.token_ids == alone.token_ids == reference
    assert default.accept_lengths == explicit.accept_lengths  # the same drafts, step by step
    assert default.gamma == explicit.gamma == 3 + 2 != alone.gamma  # the chain and the branch
    heads.set_branch(tuned, 0, "")
    assert jaxspec.load_drafter(tuned, target=target).spec.tuned_branch is None
    with pytest.raises(UserError, match="length >= 0"):
        heads.set_branch(tuned, -1, "")


def test_weights_are_stored_in_bfloat16(target, tmp_path):
    for kind in KINDS:
        head = _head(kind, target.config, target.params)
        path = heads.save(tmp_path / kind, kind, head, np.arange(64), target, DEPTH)
        leaves = jax.tree.leaves(head)
        n = sum(x.size for x in leaves)
        size = (path / "weights.npz").stat().st_size
        assert 2 * n <= size < 2 * n + 512 * len(leaves), (kind, n, size)
        with np.load(path / "weights.npz") as z:
            stored = sorted((z[k].tobytes() for k in z.files))
        want = sorted(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).tobytes()
                      for x in leaves)
        assert stored == want  # each weight's bfloat16 bits


@pytest.mark.parametrize("field,value", [("hidden_size", 48), ("vocab_size", 128)])
def test_a_head_is_refused_by_another_target(target, saved_eagle, field, value):
    path, head, ids = saved_eagle
    # Only the config is read before the refusal.
    other = jaxspec.Model(target.config.replace(**{field: value}), target.params, None, "other")
    with pytest.raises(UserError, match=f"{field} {getattr(target.config, field)}.*has {value}"):
        jaxspec.load_drafter(path, target=other)
    # The in-memory drafter is refused too, before anything compiles.
    memory = hidden_drafter(target, "eagle", head, ids, DEPTH)
    with pytest.raises(UserError, match=field):
        jaxspec.speculative_generate(other, memory, [[1, 2, 3]], gamma=2, max_new_tokens=4)


def test_a_head_needs_its_target(saved_eagle):
    with pytest.raises(UserError, match="needs its target"):
        jaxspec.load_drafter(saved_eagle[0])


@pytest.mark.parametrize("keep", [0, 10, 0.5, -10])
def test_a_truncated_weights_file_is_refused(target, saved_eagle, tmp_path, keep):
    path, head, ids = saved_eagle
    copy = heads.save(tmp_path / "h", "eagle", head, ids, target, DEPTH)
    data = (copy / "weights.npz").read_bytes()
    (copy / "weights.npz").write_bytes(data[:int(keep * len(data)) if abs(keep) < 1 else keep])
    with pytest.raises(UserError, match="weights.npz is unreadable"):
        jaxspec.load_drafter(copy, target=target)


def test_a_corrupt_head_json_is_refused(target, saved_eagle, tmp_path):
    path, head, ids = saved_eagle
    copy = heads.save(tmp_path / "h", "eagle", head, ids, target, DEPTH)
    (copy / "head.json").write_text('{"format": 1, "kind": ')
    with pytest.raises(UserError, match="head.json is unreadable"):
        jaxspec.load_drafter(copy, target=target)


# -- 6. bad arguments -------------------------------------------------------------------------


def test_unknown_kind(target):
    with pytest.raises(UserError, match="unknown hidden-state drafter kind 'lookahead'"):
        hidden_drafter(target, "lookahead", {})
    with pytest.raises(UserError, match="unknown hidden-state drafter kind 'lookahead'"):
        head_params("lookahead", target.config, 4, jax.random.key(0))


@pytest.mark.parametrize("kind,gamma", [("medusa", 4), ("hydra", 5), ("medusa", "auto")])
def test_gamma_beyond_depth(target, kind, gamma):
    """Medusa and Hydra draft at most `depth` tokens (a missing head's index would clamp)."""
    drafter = hidden_drafter(target, kind, head_params(kind, target.config, 3,
                                                       jax.random.key(0)), depth=3)
    with pytest.raises(UserError, match=f"has 3 heads; gamma {4 if gamma == 'auto' else gamma}"):
        jaxspec.speculative_generate(target, drafter, [[1, 2, 3]], gamma=gamma, gamma_max=4,
                                     costs=(1.0, 1.1, 1.2, 1.3, 1.4), max_new_tokens=4)
