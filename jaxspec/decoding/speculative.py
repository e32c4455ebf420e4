"""The decode loop: prefill, then one `lax.while_loop` of draft -> verify -> accept.

With gamma = 0 there is no draft and each step samples one token from the target: plain
autoregressive decoding, through the same code.

Continuous batching (plain decoding only) runs the same loop with a bound: `idle_state` makes a
batch of empty slots, `refill` prefills a fixed-size group of new rows into chosen slots, and
`resume` decodes until enough rows are done (or a step bound), so the host can take the
finished rows out and refill their slots. Such a state keeps one key per row, so a row's samples
depend only on its own seed, not on its slot or on the rows beside it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.decoding.plan import choose_gamma
from jaxspec.decoding.sampling import DraftProbs, Sampling, argmax, probs, sample
from jaxspec.decoding.trees import DynamicTree, RowTree, Tree, chain, compact
from jaxspec.drafters.base import Draft, DraftInput
from jaxspec.models.cache import KVCache, init_cache
from jaxspec.models.transformer import fill_cache, forward
from jaxspec.sharding import constrain


@dataclasses.dataclass(frozen=True)
class Auto:
    """gamma="auto": each row picks its draft length, 0 to `max`, every step; the step costs it
    weighs are the loop's data (`costs_G1`), so drafters of one shape share an executable."""

    max: int


@dataclasses.dataclass(frozen=True)
class Settings:
    """All a decode loop is compiled for, as one hashable value (static under jit). `shape`: a
    `Tree` (`trees.chain(g)` drafts g tokens a step; `chain(0)` is plain decoding), a
    `DynamicTree`, or `Auto`."""

    config: ModelConfig
    shape: Tree | DynamicTree | Auto
    sampling: Sampling = Sampling()
    image_token: int | None = None  # a vision-language target's image token: prompts hold images

    @property
    def top(self) -> Tree | DynamicTree:
        """The largest tree a step verifies."""
        return chain(self.shape.max) if isinstance(self.shape, Auto) else self.shape


@flax.struct.dataclass
class DecodeState:
    tokens_BxT: jnp.ndarray  # prompt then generated tokens, right-padded
    lengths_B: jnp.ndarray  # valid tokens; the last one is not yet in the target cache
    prompt_lengths_B: jnp.ndarray
    max_new_B: jnp.ndarray
    done_B: jnp.ndarray
    target_cache: KVCache
    drafter_state: Any
    key: jnp.ndarray  # one key for the batch, or one per row [B] (plain decoding only)
    steps_B: jnp.ndarray  # verification steps taken per row
    gained_BxI: jnp.ndarray  # tokens gained at step i (accepted drafts + 1); I = T bounds steps
    gamma_BxI: jnp.ndarray  # tokens drafted at step i
    accepted_BxG: jnp.ndarray  # per draft position, steps that accepted it and that reached it,
    tried_BxG: jnp.ndarray  # decayed by _MEMORY each step: gamma="auto"'s estimate (G = 0 else)
    features_BxTxD: jnp.ndarray  # slot t: the target's hidden state at position t, kept for
    # positions < length - 1 when the drafter reads features (D = 0 otherwise)
    stop_BxZ: jnp.ndarray  # each row's state in each stop string's automaton (`Stops`)

    @property
    def new_tokens_B(self):
        return self.lengths_B - self.prompt_lengths_B

    def draft_input(self, vocab_size: int) -> DraftInput:
        """What the drafter reads this step."""
        return DraftInput(self.tokens_BxT, self.lengths_B, self.features_BxTxD, vocab_size,
                          self.target_cache)


@flax.struct.dataclass
class Stops:
    """What ends a row, as data (`stops.tables` builds it from stop strings and ids)."""
    ends_V: jnp.ndarray  # bool: the token ends its row alone (an end-of-sequence or stop id, or
    # a text holding a stop string)
    next_ZxVxL: jnp.ndarray  # int8/16: stop string s's state after token v from state l: the
    # length of the longest suffix of the row's text that is a proper prefix of s; -1 once the
    # text holds s. Strings of 2+ characters only; L: the longest


def no_stops(vocab: int) -> Stops:
    return Stops(jnp.zeros((vocab,), bool), jnp.zeros((0, vocab, 0), jnp.int8))


def _split(key, n: int):
    """`n` keys from `key`: one key, or per-row keys [B] (each row's key split on its own)."""
    if key.ndim == 0:
        return tuple(jax.random.split(key, n))
    keys_BxN = jax.vmap(lambda k: jax.random.split(k, n))(key)
    return tuple(keys_BxN[:, i] for i in range(n))


def reads_features(drafter) -> bool:
    """Whether the drafter reads the target's hidden states (a hidden-state drafter)."""
    return drafter is not None and drafter.spec.reads_features


def feature_layer(drafter) -> int | None:
    """The layer whose input the drafter reads as features (None: the last layer's output)."""
    return None if drafter is None else drafter.spec.feature_layer


def cache_dtype(target_params):
    """The KV cache's precision: the weights' (stored as `cache.storage_dtype` says: float32 on
    CPU)."""
    return target_params["embed"].dtype


def prefill(target_params, config: ModelConfig, drafter, tokens_BxT, prompt_lengths_B,
            max_new_B, key, prior_2xG=None, num_stops: int = 0,
            shared: tuple[KVCache, jax.Array] | None = None, images=None) -> DecodeState:
    """Fill both caches with each row's prompt (`fill_cache`: fixed-size chunks, so the prompt
    length never changes compiled shapes); `prior_2xG`: for gamma="auto", each row's starting
    acceptance counts (accepted, tried) of the G draft positions it tracks; `num_stops`: the
    stop automata each row runs (`Stops`), all starting at 0 (no text yet). `shared`: (the
    one-row cache of a prefix every prompt starts with, its length; `shared_prefix`): each row
    starts from it and computes only the rest (no drafter). `images` = (each row's image
    embeddings [B, M, D], the image token id): the target reads them in place of the image
    tokens (`transformer.fill_cache`); the drafter sees the tokens only."""
    B, T = tokens_BxT.shape
    cache, first = init_cache(config, B, T, cache_dtype(target_params)), 0
    if shared is not None:
        cache = jax.tree.map(lambda a: jnp.broadcast_to(a, (B, *a.shape[1:])), shared[0])
        first = shared[1]
    filled = fill_cache(target_params, config, tokens_BxT, prompt_lengths_B, cache,
                        features=reads_features(drafter), first=first,
                        feature_layer=feature_layer(drafter), images=images)
    cache, feats_BxTxD = filled if reads_features(drafter) else (filled, jnp.zeros((B, T, 0)))
    dstate = (drafter.spec.init(drafter.params, DraftInput(
        tokens_BxT, prompt_lengths_B, feats_BxTxD, config.vocab_size, cache))
              if drafter is not None else ())
    prior_2xG = jnp.zeros((2, 0)) if prior_2xG is None else prior_2xG
    counts = lambda i: jnp.broadcast_to(prior_2xG[i], (B, prior_2xG.shape[1])).astype(jnp.float32)
    return constrain(DecodeState(
        tokens_BxT=tokens_BxT, lengths_B=prompt_lengths_B, prompt_lengths_B=prompt_lengths_B,
        max_new_B=max_new_B, done_B=max_new_B <= 0, target_cache=cache, drafter_state=dstate,
        key=key, steps_B=jnp.zeros((B,), jnp.int32), gained_BxI=jnp.zeros((B, T), jnp.int32),
        gamma_BxI=jnp.zeros((B, T), jnp.int32), accepted_BxG=counts(0), tried_BxG=counts(1),
        features_BxTxD=feats_BxTxD, stop_BxZ=jnp.zeros((B, num_stops), jnp.int32)), B)


def verify(target_params, config, state: DecodeState, draft_BxN,
           tree: Tree | RowTree | None = None, feature_layer: int | None = None):
    """Target logits [B, N+1, V] for the last token and the N draft nodes of `tree` (default: a
    chain; a `RowTree`: one per row), in one call with tree attention, nodes in scratch slots
    length - 1 + feed index; the updated cache; and the hidden states [B, N+1, D] (the last
    layer's output, or `feature_layer`'s input; D = 0 when the state keeps none)."""
    B, N = draft_BxN.shape
    tree = chain(N) if tree is None else tree
    base_B = state.lengths_B - 1
    last_Bx1 = jnp.take_along_axis(state.tokens_BxT, base_B[:, None], axis=1)
    feed_BxN1 = jnp.concatenate([last_Bx1, draft_BxN], axis=1)
    chain_ = isinstance(tree, Tree) and tree.is_chain  # its slots hold their positions
    logits_BxN1xV, cache, x_BxN1xD = forward(
        target_params, config, feed_BxN1, base_B[:, None] + tree.depth_N1, state.target_cache,
        features=True, slots_BxS=base_B[:, None] + jnp.arange(N + 1),
        tree=None if chain_ else tree.region(base_B), feature_layer=feature_layer)
    return logits_BxN1xV, cache, x_BxN1xD[..., :state.features_BxTxD.shape[-1]]


def accept(key, logits_BxN1xV, draft_BxN, q: DraftProbs | None, sampling: Sampling,
           gamma_B=None, tree: Tree | DynamicTree | None = None, rows: RowTree | None = None):
    """(n_accepted [B], emitted [B, A+1], path [B, A+1]) for the N draft nodes of `tree`
    (default: a chain) and depth A: row b keeps emitted[b, :n + 1], the tokens of its accepted
    nodes (feed indices path[b, 1:n + 1]; path[b, 0] = 0 is the root) and then the target's.
    Row b drafted only its first gamma_B[b] nodes (all by default); the rest are never accepted.

    Greedy: the deepest node whose path the target's argmax follows (`_accept_greedy`).
    Sampling (Leviathan et al. 2023; Chen et al. 2023; siblings as in SpecInfer, Miao et al.
    2024): r starts as the target's p at the root; try the node's children in rank order,
    accepting child i with probability min(1, r(x_i) / q_i(x_i)) (q_i: what x_i was drawn from,
    given the siblings before it), and after a rejection replace r by normalize(max(r - q_i, 0));
    after an acceptance r is p at the child. The correction (past a leaf, the bonus token) is
    drawn from the final r. `q` is None when greedy. `key` is one key, or one per row [B].
    A dynamic tree (greedy) gives each row's topology in `rows`.
    """
    B, N = draft_BxN.shape
    if rows is not None:
        return _accept_rows(argmax(logits_BxN1xV), draft_BxN, rows.parent_BxN, tree.max_depth)
    tree = chain(N) if tree is None else tree
    gamma_B = jnp.full((B,), N) if gamma_B is None else gamma_B
    if sampling.greedy:
        return _accept_greedy(argmax(logits_BxN1xV), draft_BxN, gamma_B, tree)
    k_accept, k_fix = _split(key, 2)
    per_row = key.ndim == 1
    rows_B = jnp.arange(B)
    kids_N1xW = jnp.asarray(tree.children_N1xW)
    p_BxN1xV = probs(logits_BxN1xV, sampling)
    r_BxV, fresh_B = p_BxN1xV[:, 0], jnp.ones((B,), bool)  # fresh: r is p, not a residual
    if N:
        q_BxN = q.of(draft_BxN)
        u_BxN = (jax.vmap(lambda k: jax.random.uniform(k, (N,)))(k_accept) if per_row
                 else jax.random.uniform(k_accept, (B, N)))
    node_B, live_B, n_B = jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool), 0
    path = [node_B]
    for _ in range(tree.max_depth):
        hit_B, next_B = jnp.zeros((B,), bool), node_B
        for w in range(kids_N1xW.shape[1]):
            kid_B = kids_N1xW[node_B, w]
            try_B = live_B & ~hit_B & (kid_B >= 0) & (kid_B < gamma_B)
            kid_B = jnp.maximum(kid_B, 0)
            x_B = draft_BxN[rows_B, kid_B]
            q_x_B = q_BxN[rows_B, kid_B]
            ok_B = try_B & (u_BxN[rows_B, kid_B] * q_x_B < r_BxV[rows_B, x_B]) & (q_x_B > 0)
            no_B = try_B & ~ok_B
            r_BxV = jnp.where(no_B[:, None], _normalize(q.residual(r_BxV, kid_B), r_BxV), r_BxV)
            fresh_B &= ~no_B
            hit_B |= ok_B
            next_B = jnp.where(ok_B, kid_B + 1, next_B)
        live_B &= hit_B
        node_B, n_B = next_B, n_B + hit_B
        path.append(node_B)
        r_BxV = jnp.where(hit_B[:, None], p_BxN1xV[rows_B, node_B], r_BxV)
        fresh_B |= hit_B
    n_B = jnp.zeros((B,), jnp.int32) + n_B
    path_BxA1 = jnp.stack(path, axis=1)
    r_BxV = jnp.where(fresh_B[:, None], _normalize(r_BxV, r_BxV), r_BxV)
    fix_B = jax.vmap(sample)(k_fix, r_BxV) if per_row else sample(k_fix, r_BxV)
    padded_BxN1 = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), draft_BxN], axis=1)
    nodes_BxA1 = jnp.take_along_axis(padded_BxN1, jnp.roll(path_BxA1, -1, axis=1), axis=1)
    emitted_BxA1 = jnp.where(jnp.arange(tree.max_depth + 1) == n_B[:, None], fix_B[:, None],
                             nodes_BxA1)
    return n_B, emitted_BxA1, path_BxA1


def _accept_greedy(target_BxN1, draft_BxN, gamma_B, tree: Tree):
    """Greedy acceptance over a static tree: a node is accepted when its token is the target's
    argmax at its parent and its parent is accepted; the row keeps its deepest accepted node
    (the first in feed order among equals), so where two branches begin with the same tokens
    the longer accepted path wins."""
    B, N = draft_BxN.shape
    ok_BxN = ((draft_BxN == target_BxN1[:, tree.parent_N])
              & (jnp.arange(N) < gamma_B[:, None]))
    ok_BxN1 = jnp.concatenate([jnp.ones((B, 1), bool), ok_BxN], axis=1)
    acc_BxN1 = jnp.all(ok_BxN1[:, None, :] | ~tree.ancestors_N1xN1, axis=-1)
    depth_BxN1 = jnp.where(acc_BxN1, tree.depth_N1, -1)
    best_B = jnp.argmax(depth_BxN1, axis=1)
    path_BxA1 = jnp.asarray(tree.path_N1xA1)[best_B]
    n_B = jnp.max(depth_BxN1, axis=1).astype(jnp.int32)
    return n_B, jnp.take_along_axis(target_BxN1, path_BxA1, axis=1), path_BxA1


def _accept_rows(target_BxN1, draft_BxN, parent_BxN, depth: int):
    """Greedy acceptance over a topology per row: from the root, descend to the child whose
    token is the target's argmax at its parent, `depth` levels at most."""
    B = draft_BxN.shape[0]
    rows_B = jnp.arange(B)
    node_B, live_B, n_B = jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool), jnp.zeros((B,),
                                                                                   jnp.int32)
    path = [node_B]
    for _ in range(depth):
        match_BxN = ((parent_BxN == node_B[:, None]) & live_B[:, None]
                     & (draft_BxN == target_BxN1[rows_B, node_B][:, None]))
        live_B = jnp.any(match_BxN, axis=1)
        node_B = jnp.where(live_B, jnp.argmax(match_BxN, axis=1).astype(jnp.int32) + 1, node_B)
        n_B += live_B
        path.append(node_B)
    path_BxA1 = jnp.stack(path, axis=1)
    return n_B, jnp.take_along_axis(target_BxN1, path_BxA1, axis=1), path_BxA1


def _normalize(r_BxV, fallback_BxV):
    """r / sum(r); `fallback` where r has no mass."""
    mass_Bx1 = jnp.sum(r_BxV, axis=-1, keepdims=True)
    return jnp.where(mass_Bx1 > 0, r_BxV / jnp.maximum(mass_Bx1, 1e-30), fallback_BxV)


def _first_stop(stops: Stops, stop_BxZ, emitted_BxG1, gained_B):
    """Run each row's stop automata over its gained tokens in order: (the index of the first
    token that ends the row, G1 if none; the automata's states after the tokens up to it)."""
    B, G1 = emitted_BxG1.shape
    s_Z = jnp.arange(stops.next_ZxVxL.shape[0])
    first_B = jnp.full((B,), G1)
    for i in range(G1):
        x_B = emitted_BxG1[:, i]
        live_B = (i < gained_B) & (first_B == G1)
        next_BxZ = stops.next_ZxVxL[s_Z, x_B[:, None], stop_BxZ].astype(jnp.int32)
        ends_B = stops.ends_V[x_B] | jnp.any(next_BxZ < 0, axis=1)
        first_B = jnp.where(live_B & ends_B, i, first_B)
        stop_BxZ = jnp.where(live_B[:, None], next_BxZ, stop_BxZ)
    return first_B, stop_BxZ


def advance(state: DecodeState, n_B, emitted_BxG1, stops: Stops, target_cache, drafter_state,
            key, feats_BxG1xD, span: int | None = None) -> DecodeState:
    """Append each row's gain (cut at the first token that ends it, `Stops`, and at its budget)
    and the hidden states of the positions it verified (the last token and the accepted drafts);
    retire finished rows."""
    B, G1 = emitted_BxG1.shape
    T = state.tokens_BxT.shape[1]
    i_G1 = jnp.arange(G1)
    gained_B = jnp.where(state.done_B, 0, n_B + 1)
    first_B, stop_BxZ = _first_stop(stops, state.stop_BxZ, emitted_BxG1, gained_B)
    hit_B = first_B < G1
    gained_B = jnp.where(hit_B, first_B + 1, gained_B)
    budget_B = state.max_new_B - state.new_tokens_B
    hit_B &= gained_B <= budget_B
    gained_B = jnp.minimum(gained_B, budget_B)
    rows_Bx1 = jnp.arange(B)[:, None]
    slots_BxG1 = jnp.where(i_G1 < gained_B[:, None], state.lengths_B[:, None] + i_G1, T)
    tokens_BxT = state.tokens_BxT.at[rows_Bx1, slots_BxG1].set(emitted_BxG1, mode="drop")
    # Verified position length - 1 + i was fed the last token or an accepted draft for i < gain.
    fslots_BxG1 = jnp.where(i_G1 < gained_B[:, None], slots_BxG1 - 1, T)
    feats_BxTxD = state.features_BxTxD.at[rows_Bx1, fslots_BxG1].set(feats_BxG1xD, mode="drop")
    lengths_B = state.lengths_B + gained_B
    step_B = jnp.where(state.done_B, T, state.steps_B)  # finished rows log nothing
    gained_BxI = state.gained_BxI.at[jnp.arange(B), step_B].set(gained_B, mode="drop")
    # Another step writes `span` slots (default G1) from length - 1 on: stop when the cache
    # cannot take it.
    full_B = lengths_B + (span or G1) > T
    done_B = (state.done_B | hit_B | (lengths_B - state.prompt_lengths_B >= state.max_new_B)
              | full_B)
    return state.replace(tokens_BxT=tokens_BxT, lengths_B=lengths_B, done_B=done_B,
                         target_cache=target_cache, drafter_state=drafter_state, key=key,
                         steps_B=state.steps_B + (~state.done_B), gained_BxI=gained_BxI,
                         features_BxTxD=feats_BxTxD, stop_BxZ=stop_BxZ)


_MEMORY = 0.95  # weight of a row's past tries per step, for gamma="auto": the last ~20 tries


def track(state: DecodeState, gamma_B, n_B) -> DecodeState:
    """Log each row's draft length and update its acceptance counts: a step that drafted gamma
    tokens and accepted n reached drafts 1..min(n + 1, gamma) and accepted drafts 1..n."""
    B, T = state.gained_BxI.shape
    step_B = jnp.where(state.done_B, T, state.steps_B)
    j_G = jnp.arange(1, state.accepted_BxG.shape[1] + 1)
    reached_BxG = j_G <= jnp.minimum(n_B + 1, gamma_B)[:, None]
    return state.replace(
        gamma_BxI=state.gamma_BxI.at[jnp.arange(B), step_B].set(gamma_B, mode="drop"),
        accepted_BxG=_MEMORY * state.accepted_BxG + (j_G <= n_B[:, None]),
        tried_BxG=_MEMORY * state.tried_BxG + reached_BxG)


def decode_loop(target_params, drafter, state: DecodeState, settings: Settings, *,
                stops: Stops | None = None, costs_G1=None, max_steps=None,
                min_done=None) -> DecodeState:
    """Run until every row is done. Every row drafts the nodes of `settings.shape` a step; with
    `Auto(G)` and `costs_G1` (an array: the step cost of each draft length 0..G relative to a
    plain step) each row picks its own length every step (`plan.choose_gamma`; 0 where the
    drafter has no draft, `has_draft`); the step runs the longest pick, and every row that
    picked a draft drafts that length. A drafter with a `fallback` drafts it on steps where no
    row `has_draft` (the hybrid: the head alone when lookup has no match).

    `max_steps` and `min_done` (ints or traced scalars; None: no bound) also end the loop after
    that many steps, or once at least that many rows are done: a continuous-batching caller then
    takes the finished rows out and refills their slots (see `resume`). `stops` (None: none)
    end rows at stop tokens and strings; the state holds a state per row of each automaton."""
    config, sampling = settings.config, settings.sampling
    vocab = config.vocab_size
    B = state.tokens_BxT.shape[0]
    stops = no_stops(vocab) if stops is None else stops
    if state.stop_BxZ.shape[1] != stops.next_ZxVxL.shape[0]:
        raise ValueError(f"{stops.next_ZxVxL.shape[0]} stop automata, but the state has "
                         f"{state.stop_BxZ.shape[1]} (prefill's `num_stops`)")
    if state.key.ndim and drafter is not None:
        raise ValueError("per-row keys are for plain decoding (no drafter)")
    if isinstance(settings.shape, Auto) != (costs_G1 is not None):
        raise ValueError("per-row draft lengths (Auto) go with step costs (costs_G1), and only "
                         "they")
    if costs_G1 is not None and state.accepted_BxG.shape[1] != len(costs_G1) - 1:
        raise ValueError(f"{len(costs_G1)} step costs need acceptance counts for "
                         f"{len(costs_G1) - 1} draft positions; the state has "
                         f"{state.accepted_BxG.shape[1]} (prefill's `prior_2xG`)")
    top = settings.top

    def step(t: Tree, state, gamma_B, k_draft, k_accept, spec=None):
        """Draft the nodes of `t` (with `spec`, by default the drafter's), score them and the
        last token, accept: (accepted drafts [B], emitted tokens, accepted path, its hidden
        states, target cache, drafter state), the per-depth outputs padded to the depth of
        `top` (a chain or a `fallback` shape is shallower)."""
        g = t.size
        if g:
            spec = spec or drafter.spec
            draft = spec.propose(drafter.params, state.drafter_state,
                                 state.draft_input(vocab), k_draft, sampling, t)
        else:
            draft = Draft(jnp.zeros((B, 0), jnp.int32), None, state.drafter_state)
        draft_BxG, q, dstate, rows = draft.tokens_BxN, draft.q, draft.state, draft.rows
        logits_BxG1xV, cache, feats_BxG1xD = verify(target_params, config, state, draft_BxG,
                                                    t if rows is None else rows,
                                                    feature_layer(drafter))
        if g:
            dstate = spec.observe(drafter.params, dstate, logits_BxG1xV)
        n_B, emitted_BxA1, path_BxA1 = accept(k_accept, logits_BxG1xV, draft_BxG, q, sampling,
                                              gamma_B, t, rows)
        feats_BxA1xD = jnp.take_along_axis(feats_BxG1xD, path_BxA1[..., None], axis=1)
        pad = lambda x: jnp.pad(x, [(0, 0), (0, top.max_depth - t.max_depth)]
                                + [(0, 0)] * (x.ndim - 2))
        return (n_B, pad(emitted_BxA1), pad(path_BxA1), pad(feats_BxA1xD), cache, dstate)

    def body(state: DecodeState) -> DecodeState:
        key, k_draft, k_accept = _split(state.key, 3)
        fallback = None if drafter is None else drafter.spec.fallback(top)
        if isinstance(settings.shape, Auto):
            want_B = jnp.where(state.done_B, 0,
                               choose_gamma(state.accepted_BxG, state.tried_BxG, costs_G1))
            want_B = jnp.where(drafter.spec.has_draft(drafter.params, state.drafter_state,
                                                      state.draft_input(vocab)), want_B, 0)
            branch = jnp.max(want_B)
            # Every row that drafts takes the step's length: its verification is paid for
            # already, and a longer draft never gains fewer tokens. A row that picked 0 stays
            # plain: forced misses would only hold it off longer.
            gamma_B = jnp.where(want_B > 0, branch, 0)
            branches = [functools.partial(step, chain(g)) for g in range(top.size + 1)]
            out = jax.lax.switch(branch, branches, state, gamma_B, k_draft, k_accept)
        elif fallback is None:
            gamma_B = jnp.full((B,), top.size, jnp.int32)
            out = step(top, state, gamma_B, k_draft, k_accept)
        else:  # the whole shape only when a row has the draft it adds
            spec, small = fallback
            full = jnp.any(drafter.spec.has_draft(drafter.params, state.drafter_state,
                                                  state.draft_input(vocab)) & ~state.done_B)
            gamma_B = jnp.full((B,), jnp.where(full, top.size, small.size), jnp.int32)
            out = jax.lax.cond(full, functools.partial(step, top),
                               functools.partial(step, small, spec=spec),
                               state, gamma_B, k_draft, k_accept)
        n_B, emitted_BxA1, path_BxA1, feats_BxA1xD, cache, dstate = out
        cache = compact(cache, state.lengths_B - 1, path_BxA1, n_B)
        state = track(state, gamma_B, n_B)
        return constrain(advance(state, n_B, emitted_BxA1, stops, cache, dstate, key,
                                 feats_BxA1xD, top.size + 1), B)

    def cond(carry):
        state, step = carry
        go = ~jnp.all(state.done_B)
        if max_steps is not None:
            go &= step < max_steps
        if min_done is not None:
            go &= jnp.sum(state.done_B) < min_done
        return go

    state, _ = jax.lax.while_loop(cond, lambda c: (body(c[0]), c[1] + 1),
                                  (state, jnp.zeros((), jnp.int32)))
    return state


def run(target_params, drafter, tokens_BxT, prompt_lengths_B, max_new_B, key, prior_2xG=None,
        stops: Stops | None = None, costs_G1=None, images_BxMxD=None, *,
        settings: Settings) -> DecodeState:
    """Prefill and decode; jit this with `settings` static. With `costs_G1` (`Auto`),
    `prior_2xG` gives each row's starting acceptance counts (default none); `stops` ends rows
    (default: nothing but the budget); `images_BxMxD`: each row's image embeddings, for a
    vision-language target (`settings.image_token`)."""
    if costs_G1 is not None and prior_2xG is None:
        prior_2xG = jnp.zeros((2, len(costs_G1) - 1))
    num_stops = 0 if stops is None else stops.next_ZxVxL.shape[0]
    images = None if images_BxMxD is None else (images_BxMxD, settings.image_token)
    state = prefill(target_params, settings.config, drafter, tokens_BxT, prompt_lengths_B,
                    max_new_B, key, prior_2xG, num_stops, images=images)
    return decode_loop(target_params, drafter, state, settings, stops=stops, costs_G1=costs_G1)


# Continuous batching: a fixed batch of slots, refilled with new rows as rows finish.


def idle_state(config: ModelConfig, batch: int, max_len: int, cache_dtype,
               num_stops: int = 0) -> DecodeState:
    """`batch` empty slots of `max_len` tokens for `refill` to fill: every row done (length 1,
    budget 0), one key per row, no drafter; `cache_dtype` from `cache_dtype(params)`;
    `num_stops`: the stop automata (`Stops`) rows run."""
    ones_B = lambda: jnp.ones((batch,), jnp.int32)  # a buffer per field: the state is donated
    return DecodeState(
        tokens_BxT=jnp.full((batch, max_len), config.pad_token_id, jnp.int32), lengths_B=ones_B(),
        prompt_lengths_B=ones_B(), max_new_B=jnp.zeros((batch,), jnp.int32),
        done_B=jnp.ones((batch,), bool),
        target_cache=init_cache(config, batch, max_len, cache_dtype),
        drafter_state=(), key=jax.random.split(jax.random.key(0), batch),
        steps_B=jnp.zeros((batch,), jnp.int32), gained_BxI=jnp.zeros((batch, max_len), jnp.int32),
        gamma_BxI=jnp.zeros((batch, max_len), jnp.int32),
        accepted_BxG=jnp.zeros((batch, 0), jnp.float32),
        tried_BxG=jnp.zeros((batch, 0), jnp.float32),
        features_BxTxD=jnp.zeros((batch, max_len, 0)),
        stop_BxZ=jnp.zeros((batch, num_stops), jnp.int32))


def shared_prefix(target_params, tokens_1xT, length, *, config: ModelConfig):
    """The one-row cache of the first `length` tokens of `tokens_1xT` (a prefix all of a
    stream's prompts share: `refill` starts each row from it). Jit with `config` static."""
    T = tokens_1xT.shape[1]
    return fill_cache(target_params, config, tokens_1xT, length[None],
                      init_cache(config, 1, T, cache_dtype(target_params)))


def refill(target_params, state: DecodeState, tokens_RxT, prompt_lengths_R, max_new_R, seeds_R,
           slots_R, shared_cache: KVCache, shared_len, *, config: ModelConfig) -> DecodeState:
    """Prefill R new rows (row r keyed by `jax.random.key(seeds_R[r])`) and put them into
    `state`'s rows `slots_R`, replacing what those held; a slot >= the batch size drops its row
    (padding, for a group of fewer than R). Only the R rows are prefilled, so R stays small and
    fixed: one compiled function whatever the number of free slots. Every prompt starts with
    the `shared_len` tokens whose keys and values `shared_cache` holds (`shared_prefix`; 0 and
    any one-row cache for none): only the rest is computed, in the chunks `generate`'s prefill
    uses (so a row's keys and values round as they do there). Jit with `config` static."""
    keys_R = jax.vmap(jax.random.key)(seeds_R)
    new = prefill(target_params, config, None, tokens_RxT, prompt_lengths_R, max_new_R, keys_R,
                  num_stops=state.stop_BxZ.shape[1], shared=(shared_cache, shared_len))
    return constrain(jax.tree.map(lambda big, small: big.at[slots_R].set(small, mode="drop"),
                                  state, new), state.tokens_BxT.shape[0])


def resume(target_params, drafter, state: DecodeState, max_steps, min_done,
           stops: Stops | None = None, *, settings: Settings) -> DecodeState:
    """`decode_loop` from `state` for at most `max_steps` steps, ending early once `min_done`
    rows are done; jit with `settings` static."""
    return decode_loop(target_params, drafter, state, settings, stops=stops,
                       max_steps=max_steps, min_done=min_done)
