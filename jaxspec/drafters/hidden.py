"""Drafters that read the target's hidden states: Medusa, Hydra (MLP speculator) and EAGLE.

Each drafts from `features_BxTxD` (slot p: the target's last-layer output at position p, before
its final norm) and shares the target's frozen embedding, final norm and output-head rows:
`params["shared"]` holds references to the target's arrays and the head rows `head_KxD` at
`params["vocab_ids"]` (gathered when the drafter is built, never stored in its checkpoint), and
`params["head"]` the trained weights. The heads work in the space the target's output head reads:
a feature passes the target's final norm first (which also tames the few huge dimensions of the
raw residual stream), and a head's output goes straight to the head rows, as in Medusa and
EAGLE.

  medusa: head k (1..K) reads f_p and proposes the token at p + 1 + k (Cai et al. 2024).
  hydra:  stage k reads stage k-1's state and the embedding of the token before the one it
          proposes (sequential, as IBM's MLP speculator and Hydra; Wertheimer et al. 2024).
  eagle:  one decoder layer of the target's architecture over fc([f_p; e(token p+1)]) predicts
          f_{p+1}, autoregressively in feature space with its own KV cache (Li et al. 2024).

`loss` is each kind's training objective over teacher-forced features; drafting and training
share the per-position functions, so what is trained is what drafts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.sampling import DraftProbs, pick
from jaxspec.decoding.trees import RowTree, grow
from jaxspec.drafters.base import Drafter, DraftSpec
from jaxspec.errors import UserError
from jaxspec.models import layers as L
from jaxspec.models.cache import init_cache
from jaxspec.models.params import init_params
from jaxspec.models.transformer import _layer

KINDS = ("medusa", "hydra", "eagle")
_WINDOW = 16  # positions EAGLE refeeds each step with the target's verified features


def _norm(x):
    return L.rms_norm(x, jnp.ones(x.shape[-1:], jnp.float32), 1e-6)


def _embed(shared, config: ModelConfig, tokens):
    e = L.embed(shared["embed"], tokens)
    return _norm(e)  # Gemma's sqrt(D) scale vanishes in the norm


def _feature(shared, config: ModelConfig, f_xD):
    """A target feature as its output head reads it: through the target's final norm."""
    return L.rms_norm(f_xD, shared["final_norm"], config.rms_eps)


def head_logits(shared, h_xD):
    """Logits over the head's K ids from a final-normed feature (or a head's prediction of one)."""
    lead = h_xD.shape[:-1]
    x_BxSxD = h_xD.reshape(-1, 1, h_xD.shape[-1])
    return L.linear(x_BxSxD, shared["head_KxD"]).reshape(*lead, -1)


@dataclasses.dataclass(frozen=True)
class HiddenSpec(DraftSpec):
    """A hidden-state drafter of `kind` for a target with `config`; `depth` heads or stages
    (medusa, hydra: the longest draft), `tuned_gamma` the draft length it was tuned for and
    `tuned_tree` the token tree (choices), if one was."""

    kind: str
    config: ModelConfig
    depth: int = 4
    tuned_gamma: int | None = None
    tuned_tree: tuple[tuple[int, ...], ...] | None = None
    reads_features = True
    drafts_trees = True

    @property
    def cost_key(self) -> str:
        """Heads of one kind and depth cost the same in the decode loop, whatever their
        language (their head rows differ by a few hundred), so they share one measurement."""
        return f"{self.kind}-depth{self.depth}"

    def validate(self, params, target) -> None:
        c, t = self.config, target.config
        for field in ("hidden_size", "vocab_size", "arch"):
            if getattr(c, field) != getattr(t, field):
                raise UserError(f"this {self.kind} drafter was trained for a target with "
                                f"{field} {getattr(c, field)}; the target has {getattr(t, field)}")
        ids = np.asarray(params["vocab_ids"])
        if ids.min() < 0 or ids.max() >= t.vocab_size:
            raise UserError(f"drafter vocab_ids reach {ids.max()}, target vocabulary is "
                            f"{t.vocab_size}")

    # -- per-position functions, shared by drafting and training --------------------------

    def medusa_head(self, params, k: int, f_xD):
        h = _feature(params["shared"], self.config, f_xD)
        w = params["head"]["w"][k]
        return h + jax.nn.silu(L.linear(h.reshape(-1, 1, h.shape[-1]), w).reshape(h.shape))

    def hydra_stage(self, params, k: int, s_xD, tok_x):
        """Stage k: the previous stage's state (a final-normed feature for k = 0) plus an update
        from it and the embedding of the token before the one this stage drafts."""
        p = params["head"]
        x = jnp.concatenate([_norm(s_xD), _embed(params["shared"], self.config, tok_x)], -1)
        y = L.linear(x.reshape(-1, 1, x.shape[-1]), p["w"][k]).reshape(s_xD.shape)
        return s_xD + jax.nn.gelu(L.rms_norm(y, p["norm"][k], 1e-6), approximate=True)

    def eagle_layer(self, params, f_BxSxD, tok_BxS, positions_BxS, cache, slots_BxS=None,
                    tree=None):
        """Predicted final-normed features of positions p + 1 from those of p (`f_BxSxD`) and
        the tokens at p + 1 (`slots_BxS`, `tree`: as in `transformer.forward`)."""
        p = params["head"]
        x = jnp.concatenate([_norm(f_BxSxD), _embed(params["shared"], self.config, tok_BxS)], -1)
        x = L.linear(x, p["fc"])
        rope = L.rope_angles(positions_BxS, L.rope_inv_freq(
            self.config.head_dim, self.config.rope_theta, self.config.rope_scaling))
        view = None if tree is None else L.tree_view(cache.max_len, *tree, ordered=False)
        h, k, v = _layer(x, p["layer"], cache.keys[0], cache.values[0], positions_BxS, rope,
                         None, self.config, slots_BxS, view)
        # Like the target's own last layer, its output passes the target's final norm.
        return (_feature(params["shared"], self.config, h),
                cache.replace(keys=(k,), values=(v,)))

    # -- drafting --------------------------------------------------------------------------

    def init(self, params, tokens_BxT, lengths_B, features_BxTxD):
        """EAGLE's cache over every position at once (slots past a row's text hold padding,
        which its drafting overwrites before any query reads them). One call: for Gemma 3 over
        256 slots 2 ms, where a `fori_loop` over 64-slot chunks measured 84 ms."""
        if self.kind != "eagle":
            return ()
        B, T = tokens_BxT.shape
        cache = init_cache(self.config, B, T, num_layers=1)
        pos_BxT = jnp.broadcast_to(jnp.arange(T), (B, T))
        return self._feed(params, cache, tokens_BxT, features_BxTxD, pos_BxT)[1]

    def _feed(self, params, cache, tokens_BxT, features_BxTxD, pos_BxS):
        """Run EAGLE over positions `pos_BxS` with the target's own features and next tokens."""
        T = tokens_BxT.shape[1]
        f_BxSxD = _feature(params["shared"], self.config,
                           jnp.take_along_axis(features_BxTxD, pos_BxS[..., None], axis=1))
        tok_BxS = jnp.take_along_axis(tokens_BxT, jnp.minimum(pos_BxS + 1, T - 1), axis=1)
        return self.eagle_layer(params, f_BxSxD, tok_BxS, pos_BxS, cache)

    def _catch_up(self, params, cache, tokens_BxT, lengths_B, features_BxTxD):
        """Refeed EAGLE the `_WINDOW` positions up to length - 2 with the target's verified
        features, replacing what it drafted there, and return its output at length - 2 (the
        first draft's feature). A step gains at most gamma + 1 <= `_WINDOW` positions; only after
        more plain steps in a row (gamma "auto") do older slots keep drafted values, which costs
        acceptance, never exactness. One fixed-shape call: a loop here would copy the shared
        embedding into its carry on every step."""
        pos_BxW = jnp.maximum(lengths_B[:, None] - 1 - _WINDOW + jnp.arange(_WINDOW), 0)
        out_BxWxD, cache = self._feed(params, cache, tokens_BxT, features_BxTxD, pos_BxW)
        return cache, out_BxWxD[:, -1]

    def _pick(self, params, key, h_BxD, sampling):
        idx_B, q_BxK = pick(key, head_logits(params["shared"], h_BxD), sampling)
        return params["vocab_ids"][idx_B], q_BxK

    def propose(self, params, state, tokens_BxT, lengths_B, key, sampling, gamma, vocab_size,
                features_BxTxD):
        if self.kind != "eagle" and gamma > self.depth:
            raise UserError(f"this {self.kind} drafter has {self.depth} heads; gamma {gamma} "
                            f"asks for more")
        rows_B = jnp.arange(tokens_BxT.shape[0])
        f_BxD = features_BxTxD[rows_B, jnp.maximum(lengths_B - 2, 0)]
        last_B = tokens_BxT[rows_B, jnp.maximum(lengths_B - 1, 0)]
        keys = jax.random.split(key, gamma)
        drafts, qs = [], []
        if self.kind == "medusa":
            for k in range(gamma):
                tok_B, q = self._pick(params, keys[k], self.medusa_head(params, k, f_BxD),
                                      sampling)
                drafts.append(tok_B), qs.append(q)
        elif self.kind == "hydra":
            s_BxD, tok_B = _feature(params["shared"], self.config, f_BxD), last_B
            for k in range(gamma):
                s_BxD = self.hydra_stage(params, k, s_BxD, tok_B)
                tok_B, q = self._pick(params, keys[k], s_BxD, sampling)
                drafts.append(tok_B), qs.append(q)
        else:
            cache, h_BxD = self._catch_up(params, state, tokens_BxT, lengths_B, features_BxTxD)
            tok_B, q = self._pick(params, keys[0], h_BxD, sampling)
            drafts.append(tok_B), qs.append(q)
            for k in range(1, gamma):  # position length - 2 + k, fed its predicted feature
                pos_Bx1 = (lengths_B - 2 + k)[:, None]
                out_Bx1xD, cache = self.eagle_layer(params, h_BxD[:, None], tok_B[:, None],
                                                    pos_Bx1, cache)
                h_BxD = out_Bx1xD[:, 0]
                tok_B, q = self._pick(params, keys[k], h_BxD, sampling)
                drafts.append(tok_B), qs.append(q)
            state = cache
        draft_BxG = jnp.stack(drafts, axis=1)
        if sampling.greedy:
            return draft_BxG, None, state
        q_BxGxK = jnp.stack(qs, axis=1)
        ids_BxGxK = jnp.broadcast_to(params["vocab_ids"], q_BxGxK.shape)
        return draft_BxG, DraftProbs(q_BxGxK, ids_BxGxK), state

    def propose_tree(self, params, state, tokens_BxT, lengths_B, key, sampling, tree,
                     vocab_size, features_BxTxD):
        """Top-k per node (`trees.grow`). Medusa: head d drafts depth d + 1 for every parent (a
        Cartesian tree); Hydra: stage d runs once per node at depth d; EAGLE: one call per depth
        over the nodes with children, in scratch slots past its last caught-up position with
        tree attention (the next step's catch-up overwrites them)."""
        D = tree.max_depth
        if self.kind != "eagle" and D > self.depth:
            raise UserError(f"this {self.kind} drafter has {self.depth} heads; the tree is {D} "
                            f"deep")
        if self.kind == "eagle" and D + 1 > _WINDOW:
            raise UserError(f"an EAGLE drafter drafts trees up to {_WINDOW - 1} deep; the tree "
                            f"is {D} deep")
        shared = params["shared"]
        rows_B = jnp.arange(tokens_BxT.shape[0])
        f_BxD = features_BxTxD[rows_B, jnp.maximum(lengths_B - 2, 0)]
        last_B = tokens_BxT[rows_B, jnp.maximum(lengths_B - 1, 0)]
        base_B = lengths_B - 2  # EAGLE: the root's slot, its last caught-up position
        if self.kind == "medusa":
            root_BxD, carry = self.medusa_head(params, 0, f_BxD), ()
        elif self.kind == "hydra":
            root_BxD = self.hydra_stage(params, 0, _feature(shared, self.config, f_BxD), last_B)
            carry = (np.array([0]), root_BxD[:, None])
        else:
            state, root_BxD = self._catch_up(params, state, tokens_BxT, lengths_B,
                                             features_BxTxD)
            carry = (np.array([0]), root_BxD[:, None], state)

        def expand(d, nodes, tok_BxP, carry):
            """Distributions after the depth-d `nodes`; carry: the feed indices of the nodes
            expanded last, their states [B, P, D] (and EAGLE's cache)."""
            if self.kind == "medusa":
                logits_BxK = head_logits(shared, self.medusa_head(params, d, f_BxD))
                return jnp.broadcast_to(logits_BxK[:, None],
                                        tok_BxP.shape + logits_BxK.shape[-1:]), carry
            prev, s_BxQxD = carry[0], carry[1]
            s_BxPxD = s_BxQxD[:, [list(prev).index(int(tree.parent_N[i])) for i in nodes]]
            if self.kind == "hydra":
                h_BxPxD = self.hydra_stage(params, d, s_BxPxD, tok_BxP)
                return head_logits(shared, h_BxPxD), (nodes + 1, h_BxPxD)
            pos_BxP = jnp.broadcast_to((base_B + d)[:, None], tok_BxP.shape)
            h_BxPxD, cache = self.eagle_layer(params, s_BxPxD, tok_BxP, pos_BxP, carry[2],
                                              base_B[:, None] + 1 + nodes,
                                              tree.region(base_B, nodes))
            return head_logits(shared, h_BxPxD), (nodes + 1, h_BxPxD, cache)

        draft_BxN, q, carry = grow(tree, key, sampling, head_logits(shared, root_BxD), expand,
                                   carry, params["vocab_ids"])
        return draft_BxN, q, (carry[2] if self.kind == "eagle" else state)

    @property
    def drafts_dynamic_trees(self) -> bool:
        return self.kind == "eagle"

    def propose_dynamic(self, params, state, tokens_BxT, lengths_B, dtree, features_BxTxD):
        """EAGLE-2's dynamic tree (greedy; `trees.DynamicTree`): from the root, the `width`
        candidates of highest path probability at each depth are expanded into their `width`
        most likely children, one EAGLE call per depth (scratch slots past the last caught-up
        position, tree attention); then the `budget` candidates of highest path probability
        are kept, in pool order (by depth, so parents first; a child never scores above its
        parent, so their parents are kept too). Returns draft [B, N], the `trees.RowTree`, and
        the cache."""
        D, K, N = dtree.depth, dtree.width, dtree.budget
        if D + 1 > _WINDOW:
            raise UserError(f"an EAGLE drafter drafts trees up to {_WINDOW - 1} deep; the tree "
                            f"is {D} deep")
        shared, ids_K = params["shared"], params["vocab_ids"]
        B = tokens_BxT.shape[0]
        rows_Bx1 = jnp.arange(B)[:, None]
        base_B = lengths_B - 2  # the root's slot, EAGLE's last caught-up position
        cache, root_BxD = self._catch_up(params, state, tokens_BxT, lengths_B, features_BxTxD)
        # Head slots base + m: m = 0 the root, then `width` expanded nodes per depth 1 .. D - 1.
        M = 1 + dtree.expanded
        depth_M = np.array([0] + [d for d in range(1, D) for _ in range(K)], np.int32)
        h_BxMxD = jnp.zeros((B, M) + root_BxD.shape[1:], root_BxD.dtype).at[:, 0].set(root_BxD)
        seen_BxMxM = jnp.zeros((B, M, M), bool).at[:, 0, 0].set(True)  # root, ancestors, self
        score_BxL, tok_BxL = jax.lax.top_k(jax.nn.log_softmax(head_logits(shared, root_BxD)), K)
        scores, toks = [score_BxL], [tok_BxL]
        slot_BxL, pool_BxL = jnp.zeros((B, K), jnp.int32), jnp.full((B, K), -1, jnp.int32)
        parents, start = [pool_BxL], 0  # pool index of each candidate's parent (-1: the root)
        for d in range(1, D):
            beam_BxK, sel_BxK = jax.lax.top_k(score_BxL, K)
            at_BxK = jnp.take_along_axis(slot_BxL, sel_BxK, axis=1)  # the parents' head slots
            slots_K = 1 + K * (d - 1) + np.arange(K)
            seen_BxKxM = seen_BxMxM[rows_Bx1, at_BxK] | (np.arange(M) == slots_K[:, None])
            seen_BxMxM = seen_BxMxM.at[:, slots_K].set(seen_BxKxM)
            h_BxKxD, cache = self.eagle_layer(
                params, h_BxMxD[rows_Bx1, at_BxK],
                ids_K[jnp.take_along_axis(tok_BxL, sel_BxK, axis=1)],
                jnp.broadcast_to((base_B + d)[:, None], (B, K)), cache,
                base_B[:, None] + slots_K, (base_B, depth_M, seen_BxKxM))
            h_BxMxD = h_BxMxD.at[:, slots_K].set(h_BxKxD)
            lp_BxKxK, kid_BxKxK = jax.lax.top_k(
                jax.nn.log_softmax(head_logits(shared, h_BxKxD)), K)
            score_BxL = (beam_BxK[:, :, None] + lp_BxKxK).reshape(B, K * K)
            tok_BxL = kid_BxKxK.reshape(B, K * K)
            slot_BxL = jnp.broadcast_to(slots_K[:, None], (B, K, K)).reshape(B, K * K)
            pool_BxL = jnp.broadcast_to((start + sel_BxK)[:, :, None], (B, K, K)).reshape(B, -1)
            start += scores[-1].shape[1]
            scores.append(score_BxL), toks.append(tok_BxL), parents.append(pool_BxL)
        depth_P = np.concatenate([np.full(s.shape[1], d + 1) for d, s in enumerate(scores)])
        sel_BxN = jnp.sort(jax.lax.top_k(jnp.concatenate(scores, axis=1), N)[1], axis=1)
        par_BxN = jnp.take_along_axis(jnp.concatenate(parents, axis=1), sel_BxN, axis=1)
        is_par_BxNxN = sel_BxN[:, None, :] == par_BxN[:, :, None]
        parent_BxN = jnp.where(par_BxN < 0, 0, jnp.where(  # -1: parent not kept (never)
            jnp.any(is_par_BxNxN, axis=2), jnp.argmax(is_par_BxNxN, axis=2) + 1, -1))
        depth_BxN1 = jnp.pad(jnp.asarray(depth_P, jnp.int32)[sel_BxN], ((0, 0), (1, 0)))
        draft_BxN = ids_K[jnp.take_along_axis(jnp.concatenate(toks, axis=1), sel_BxN, axis=1)]
        return draft_BxN, RowTree(parent_BxN.astype(jnp.int32), depth_BxN1), cache

    # -- training --------------------------------------------------------------------------

    def eagle_unroll(self, params, features_BxLxD, tokens_BxL, steps: int):
        """Teacher-forced EAGLE over every position, `steps` drafts deep: step 0 reads the
        target's features f_p (and token p + 1) and predicts f_{p+1}; step j reads its own step
        j - 1 prediction at position p + j (and the true token p + j + 1), as draft j + 1 does
        when drafts 1..j were accepted (EAGLE-3's training-time test, HASS). Its queries see
        what drafting's cache holds: step 0's entries up to p, and its own chain's entries at
        p + 1 .. p + j (a tree over steps x S slots). Returns [steps, B, S, D], S = L - 2: the
        predicted final-normed feature of position p + j + 1, which drafts token p + j + 2."""
        B, Lq, _ = features_BxLxD.shape
        S = Lq - 2
        f_BxLxD = _feature(params["shared"], self.config, features_BxLxD)
        tok_BxT = jnp.pad(tokens_BxL, ((0, 0), (0, steps)))
        p_S = np.arange(S)
        step_M, at_M = np.divmod(np.arange(steps * S), S)
        depth_M = at_M + step_M  # slot j * S + p holds step j's entry, at position p + j
        cache = init_cache(self.config, B, steps * S, num_layers=1)
        base_B = jnp.zeros((B,), jnp.int32)
        h_BxSxD, out = f_BxLxD[:, :S], []
        for j in range(steps):
            visible_SxM = (((step_M == 0) & (at_M <= p_S[:, None]))
                           | ((step_M >= 1) & (step_M <= j) & (at_M == p_S[:, None])))
            pos_BxS, slots_BxS = (jnp.broadcast_to(a, (B, S)) for a in (p_S + j, j * S + p_S))
            h_BxSxD, cache = self.eagle_layer(params, h_BxSxD, tok_BxT[:, 1 + j:1 + j + S],
                                              pos_BxS, cache, slots_BxS,
                                              (base_B, depth_M, visible_SxM))
            out.append(h_BxSxD)
        return jnp.stack(out)

    def forced_logits(self, params, features_BxLxD, tokens_BxL, steps: int) -> list:
        """Teacher-forced logits of drafts 1..`steps` over the head's ids at every position of a
        text (the target's features, the true tokens): entry j [B, S_j, K] at p drafts token
        p + j + 2 (medusa head j, hydra stage j, EAGLE `eagle_unroll` step j; S_j = L - 2 - j,
        or L - 2 for EAGLE, whose last entries run past the text). What greedy decoding drafts
        at p + 2 + j when drafts 1..j were accepted."""
        B, Lq, _ = features_BxLxD.shape
        S, shared = Lq - 2, params["shared"]
        if self.kind == "eagle":
            return list(head_logits(shared, self.eagle_unroll(params, features_BxLxD,
                                                               tokens_BxL, steps)))
        if self.kind == "medusa":
            return [head_logits(shared, self.medusa_head(params, j, features_BxLxD[:, :S - j]))
                    for j in range(steps)]
        s, out = _feature(shared, self.config, features_BxLxD[:, :S]), []
        for j in range(steps):
            s = self.hydra_stage(params, j, s[:, :S - j], tokens_BxL[:, 1 + j:1 + S])
            out.append(head_logits(shared, s))
        return out

    def loss(self, params, features_BxLxD, tokens_BxL, mask_BxL, to_head_V, reg_weight=1.0,
             unroll: int = 1, labels_BxL=None):
        """Mean cross-entropy over the head's ids (targets outside the head are skipped) of every
        head/stage/position that drafts a masked token, weighted 0.8^k by depth k; plus, for
        eagle, `reg_weight` x the smooth-L1 distance between its output and the next position's
        final-normed feature, relative to that feature's RMS. EAGLE drafts `unroll` steps deep
        on its own predictions (`eagle_unroll`). The token each position drafts is the text's,
        or with `labels_BxL` (the target's greedy token after each position) the target's.
        Returns (loss, num_targets)."""
        B, Lq, D = features_BxLxD.shape
        total, count = 0.0, 0
        want_BxL = (tokens_BxL if labels_BxL is None
                    else jnp.pad(labels_BxL[:, :-1], ((0, 0), (1, 0))))

        def ce(h_BxSxD, targets_BxS, mask_BxS, weight):
            logits = head_logits(params["shared"], h_BxSxD)
            t = to_head_V[targets_BxS]
            m = mask_BxS & (t >= 0)
            logp = jax.nn.log_softmax(logits, axis=-1)
            nll = -jnp.take_along_axis(logp, jnp.maximum(t, 0)[..., None], axis=-1)[..., 0]
            n = jnp.sum(m)
            return weight * jnp.sum(jnp.where(m, nll, 0.0)) / jnp.maximum(n, 1), n

        if self.kind == "medusa":
            for k in range(self.depth):  # f_p -> token p + 2 + k
                S = Lq - 2 - k
                h = self.medusa_head(params, k, features_BxLxD[:, :S])
                c, n = ce(h, want_BxL[:, 2 + k:], mask_BxL[:, 2 + k:], 0.8 ** k)
                total, count = total + c, count + n
        elif self.kind == "hydra":
            s = _feature(params["shared"], self.config, features_BxLxD[:, :Lq - 2])
            for k in range(self.depth):  # stage k reads token p + 1 + k, drafts p + 2 + k
                S = Lq - 2 - k
                s = self.hydra_stage(params, k, s[:, :S], tokens_BxL[:, 1 + k:1 + k + S])
                c, n = ce(s, want_BxL[:, 2 + k:], mask_BxL[:, 2 + k:], 0.8 ** k)
                total, count = total + c, count + n
        else:
            S = Lq - 2
            h_JxBxSxD = self.eagle_unroll(params, features_BxLxD, tokens_BxL, unroll)
            f_BxLxD = _feature(params["shared"], self.config, features_BxLxD)
            for j in range(unroll):  # step j drafts token p + j + 2 from a guess of f_{p+j+1}
                tok_BxS, m_BxS = _shifted(want_BxL, 2 + j, S), _shifted(mask_BxL, 2 + j, S)
                c, n = ce(h_JxBxSxD[j], tok_BxS, m_BxS, 0.8 ** j)
                total = total + c
                count = count + n if j == 0 else count
                m = _shifted(mask_BxL, 1 + j, S)
                want = _shifted(f_BxLxD, 1 + j, S)
                scale = jnp.sqrt(jnp.mean(want * want, axis=-1, keepdims=True) + 1e-6)
                d = jnp.abs(h_JxBxSxD[j] - want) / scale
                reg = jnp.where(d < 1, 0.5 * d * d, d - 0.5).mean(-1)
                total = total + 0.8 ** j * reg_weight * jnp.sum(jnp.where(m, reg, 0)) / (
                    jnp.maximum(jnp.sum(m), 1))
        return total, count


def _shifted(x_BxL, start: int, S: int):
    """x[:, start:start + S], zero-padded past the end."""
    x = x_BxL[:, start:start + S]
    return jnp.pad(x, ((0, 0), (0, S - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


def head_params(kind: str, config: ModelConfig, depth: int, key, target_params=None) -> dict:
    """Freshly initialised trained weights of a `kind` head. EAGLE's decoder layer starts from
    the target's last layer when `target_params` is given, else random."""
    D = config.hidden_size
    k1, k2 = jax.random.split(key)
    if kind == "medusa":  # zero: each head starts as the target's own head on f_p
        return {"w": jnp.zeros((depth, D, D), jnp.float32)}
    if kind == "hydra":  # drawn [in, out] and turned: a key gives the head it gave before
        w = jax.random.normal(k1, (depth, 2 * D, D), jnp.float32).swapaxes(1, 2) * (2 * D) ** -0.5
        return {"w": w, "norm": jnp.ones((depth, D), jnp.float32)}
    if kind == "eagle":
        one = dataclasses.replace(config, num_layers=1, layer_types=(), head_vocab_size=None)
        layer = (jax.tree.map(lambda x: jnp.asarray(x, jnp.float32),
                              target_params["layers"][-1]) if target_params is not None
                 else init_params(one, k2)["layers"][0])
        fc = jax.random.normal(k1, (2 * D, D), jnp.float32).T * (2 * D) ** -0.5
        return {"fc": fc, "layer": layer}
    raise UserError(f"unknown hidden-state drafter kind {kind!r}; use one of {KINDS}")


def shared_params(target_params, vocab_ids) -> dict:
    """The target's arrays a head reads: embedding, final norm and the head rows at vocab_ids."""
    ids = jnp.asarray(vocab_ids, jnp.int32)
    head = target_params.get("lm_head")
    head_KxD = (head if head is not None else target_params["embed"])[ids]
    return {"embed": target_params["embed"], "final_norm": target_params["final_norm"],
            "head_KxD": head_KxD}


def hidden_drafter(target, kind: str, head, vocab_ids=None, depth: int = 4,
                   tuned_gamma: int | None = None, name: str = "", tuned_tree=None,
                   tuned_accept=None) -> Drafter:
    """A hidden-state drafter of `kind` over `target` (a jaxspec Model) with trained weights
    `head` (from `head_params` or a checkpoint); `vocab_ids` [K] are the token ids its head
    proposes (default: the whole vocabulary)."""
    if kind not in KINDS:
        raise UserError(f"unknown hidden-state drafter kind {kind!r}; use one of {KINDS}")
    vocab_ids = (np.arange(target.config.vocab_size) if vocab_ids is None
                 else np.asarray(vocab_ids))
    dtype = target.params["embed"].dtype  # weights in the target's precision
    head = jax.tree.map(lambda x: jnp.asarray(x, dtype), head)
    params = {"shared": shared_params(target.params, vocab_ids), "head": head,
              "vocab_ids": jnp.asarray(vocab_ids, jnp.int32)}
    tree = None if tuned_tree is None else tuple(tuple(int(r) for r in p) for p in tuned_tree)
    spec = HiddenSpec(kind, target.config, depth, tuned_gamma, tree)
    spec.validate(params, target)
    return Drafter(params, spec, name or kind,
                   None if tuned_accept is None else tuple(map(float, tuned_accept)))
