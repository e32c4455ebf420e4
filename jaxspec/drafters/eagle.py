"""EAGLE (Li et al. 2024): one decoder layer of the target's architecture over
fc([f_p; e(token p + 1)]) predicts f_{p+1}, autoregressively in feature space with its own KV
cache; EAGLE-2's dynamic trees; trained on its own predictions (EAGLE-3's training-time test)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.trees import RowTree, grow
from jaxspec.drafters.base import Draft, DraftInput
from jaxspec.drafters.head import HiddenSpec, embed, feature, head_logits, norm, shifted
from jaxspec.errors import UserError
from jaxspec.models import layers as L
from jaxspec.models.cache import init_cache
from jaxspec.models.params import init_params
from jaxspec.models.transformer import _layer

WINDOW = 16  # positions EAGLE refeeds each step with the target's verified features


@dataclasses.dataclass(frozen=True)
class EagleSpec(HiddenSpec):
    kind = "eagle"
    drafts_dynamic_trees = True

    max_verified_depth = WINDOW - 1  # a step gains depth + 1 positions, which catch-up refeeds

    def check_depth(self, depth: int, asked: str) -> None:
        """Refuse a tree deeper than the next catch-up can follow."""
        if depth > self.max_verified_depth:
            raise UserError(f"an EAGLE drafter drafts trees up to {self.max_verified_depth} "
                            f"deep; {asked}")

    def layer(self, params, f_BxSxD, tok_BxS, positions_BxS, cache, slots_BxS=None, tree=None):
        """Predicted final-normed features of positions p + 1 from those of p (`f_BxSxD`) and
        the tokens at p + 1 (`slots_BxS`, `tree`: as in `transformer.forward`)."""
        p = params["head"]
        x = jnp.concatenate([norm(f_BxSxD), embed(params["shared"], tok_BxS)], -1)
        x = L.linear(x, p["fc"])
        rope = L.rope_angles(positions_BxS, L.rope_inv_freq(
            self.config.head_dim, self.config.rope_theta, self.config.rope_scaling))
        view = None if tree is None else L.tree_view(cache.max_len, *tree, ordered=False)
        h, k, v = _layer(x, p["layer"], cache.keys[0], cache.values[0], positions_BxS, rope,
                         None, self.config, slots_BxS, view)
        # Like the target's own last layer, its output passes the target's final norm.
        return (feature(params["shared"], self.config, h),
                cache.replace(keys=(k,), values=(v,)))

    # -- drafting --------------------------------------------------------------------------

    def init(self, params, inp: DraftInput):
        """The cache over every position at once (slots past a row's text hold padding, which
        its drafting overwrites before any query reads them). One call: a `fori_loop` over
        chunks of slots was ~40x slower on CPU."""
        B, T = inp.tokens_BxT.shape
        cache = init_cache(self.config, B, T, num_layers=1)
        pos_BxT = jnp.broadcast_to(jnp.arange(T), (B, T))
        return self._feed(params, cache, inp, pos_BxT)[1]

    def _feed(self, params, cache, inp: DraftInput, pos_BxS):
        """Run over positions `pos_BxS` with the target's own features and next tokens."""
        T = inp.tokens_BxT.shape[1]
        f_BxSxD = feature(params["shared"], self.config,
                          jnp.take_along_axis(inp.features_BxTxD, pos_BxS[..., None], axis=1))
        tok_BxS = jnp.take_along_axis(inp.tokens_BxT, jnp.minimum(pos_BxS + 1, T - 1), axis=1)
        return self.layer(params, f_BxSxD, tok_BxS, pos_BxS, cache)

    def _catch_up(self, params, cache, inp: DraftInput):
        """Refeed the `WINDOW` positions up to length - 2 with the target's verified features,
        replacing what it drafted there, and return its output at length - 2 (the first draft's
        feature). A step gains at most gamma + 1 <= `WINDOW` positions; only after more plain
        steps in a row (gamma "auto") do older slots keep drafted values, which costs
        acceptance, never exactness. One fixed-shape call: a loop here would copy the shared
        embedding into its carry on every step."""
        pos_BxS = jnp.maximum(inp.lengths_B[:, None] - 1 - WINDOW + jnp.arange(WINDOW), 0)
        out_BxSxD, cache = self._feed(params, cache, inp, pos_BxS)
        return cache, out_BxSxD[:, -1]

    def draft_chain(self, params, state, inp: DraftInput, key, sampling, gamma: int) -> Draft:
        keys = jax.random.split(key, gamma)
        cache, h_BxD = self._catch_up(params, state, inp)
        tok_B, q = self.pick(params, keys[0], h_BxD, sampling)
        drafts, qs = [tok_B], [q]
        for k in range(1, gamma):  # position length - 2 + k, fed its predicted feature
            pos_Bx1 = (inp.lengths_B - 2 + k)[:, None]
            out_Bx1xD, cache = self.layer(params, h_BxD[:, None], tok_B[:, None], pos_Bx1, cache)
            h_BxD = out_Bx1xD[:, 0]
            tok_B, q = self.pick(params, keys[k], h_BxD, sampling)
            drafts.append(tok_B), qs.append(q)
        return self.chain(params, drafts, qs, cache, sampling)

    def draft_tree(self, params, state, inp: DraftInput, key, sampling, tree) -> Draft:
        """Top-k per node (`trees.grow`): one call per depth over the nodes with children, in
        scratch slots past its last caught-up position with tree attention (the next step's
        catch-up overwrites them)."""
        self.check_depth(tree.max_depth, f"the tree is {tree.max_depth} deep")
        shared = params["shared"]
        base_B = inp.lengths_B - 2  # the root's slot, its last caught-up position
        cache, root_BxD = self._catch_up(params, state, inp)

        def expand(d, nodes, tok_BxP, carry):
            """carry: the feed indices of the nodes expanded last, their states [B, P, D], the
            cache."""
            prev, states, cache = carry
            s_BxPxD = states[:, [list(prev).index(int(tree.parent_N[i])) for i in nodes]]
            pos_BxP = jnp.broadcast_to((base_B + d)[:, None], tok_BxP.shape)
            h_BxPxD, cache = self.layer(params, s_BxPxD, tok_BxP, pos_BxP, cache,
                                        base_B[:, None] + 1 + nodes, tree.region(base_B, nodes))
            return head_logits(shared, h_BxPxD), (nodes + 1, h_BxPxD, cache)

        draft_BxN, q, carry = grow(tree, key, sampling, head_logits(shared, root_BxD), expand,
                                   (np.array([0]), root_BxD[:, None], cache),
                                   params["vocab_ids"])
        return Draft(draft_BxN, q, carry[2])

    def draft_dynamic(self, params, state, inp: DraftInput, dtree) -> Draft:
        """EAGLE-2's dynamic tree (greedy; `trees.DynamicTree`): from the root, the `width`
        candidates of highest path probability at each depth are expanded into their `width`
        most likely children, one call per depth (scratch slots past the last caught-up
        position, tree attention); then the `budget` candidates of highest path probability
        are kept, in pool order (by depth, so parents first; a child never scores above its
        parent, so their parents are kept too)."""
        A, W, N = dtree.depth, dtree.width, dtree.budget
        self.check_depth(A, f"the tree is {A} deep")
        shared, ids_K = params["shared"], params["vocab_ids"]
        B = inp.tokens_BxT.shape[0]
        rows_Bx1 = jnp.arange(B)[:, None]
        base_B = inp.lengths_B - 2  # the root's slot, the last caught-up position
        cache, root_BxD = self._catch_up(params, state, inp)
        # Head slots base + m: m = 0 the root, then `width` expanded nodes per depth 1 .. A - 1.
        M = 1 + dtree.expanded
        depth_M = np.array([0] + [d for d in range(1, A) for _ in range(W)], np.int32)
        h_BxMxD = jnp.zeros((B, M) + root_BxD.shape[1:], root_BxD.dtype).at[:, 0].set(root_BxD)
        seen_BxMxM = jnp.zeros((B, M, M), bool).at[:, 0, 0].set(True)  # root, ancestors, self
        score_BxX, tok_BxX = jax.lax.top_k(jax.nn.log_softmax(head_logits(shared, root_BxD)), W)
        scores, toks = [score_BxX], [tok_BxX]
        slot_BxX, pool_BxX = jnp.zeros((B, W), jnp.int32), jnp.full((B, W), -1, jnp.int32)
        parents, start = [pool_BxX], 0  # pool index of each candidate's parent (-1: the root)
        for d in range(1, A):
            beam_BxW, sel_BxW = jax.lax.top_k(score_BxX, W)
            at_BxW = jnp.take_along_axis(slot_BxX, sel_BxW, axis=1)  # the parents' head slots
            slots_W = 1 + W * (d - 1) + np.arange(W)
            seen_BxWxM = seen_BxMxM[rows_Bx1, at_BxW] | (np.arange(M) == slots_W[:, None])
            seen_BxMxM = seen_BxMxM.at[:, slots_W].set(seen_BxWxM)
            h_BxWxD, cache = self.layer(
                params, h_BxMxD[rows_Bx1, at_BxW],
                ids_K[jnp.take_along_axis(tok_BxX, sel_BxW, axis=1)],
                jnp.broadcast_to((base_B + d)[:, None], (B, W)), cache,
                base_B[:, None] + slots_W, (base_B, depth_M, seen_BxWxM))
            h_BxMxD = h_BxMxD.at[:, slots_W].set(h_BxWxD)
            lp_BxWxW, kid_BxWxW = jax.lax.top_k(
                jax.nn.log_softmax(head_logits(shared, h_BxWxD)), W)
            score_BxX = (beam_BxW[:, :, None] + lp_BxWxW).reshape(B, W * W)
            tok_BxX = kid_BxWxW.reshape(B, W * W)
            slot_BxX = jnp.broadcast_to(slots_W[:, None], (B, W, W)).reshape(B, W * W)
            pool_BxX = jnp.broadcast_to((start + sel_BxW)[:, :, None], (B, W, W)).reshape(B, -1)
            start += scores[-1].shape[1]
            scores.append(score_BxX), toks.append(tok_BxX), parents.append(pool_BxX)
        depth_X = np.concatenate([np.full(s.shape[1], d + 1) for d, s in enumerate(scores)])
        sel_BxN = jnp.sort(jax.lax.top_k(jnp.concatenate(scores, axis=1), N)[1], axis=1)
        par_BxN = jnp.take_along_axis(jnp.concatenate(parents, axis=1), sel_BxN, axis=1)
        is_par_BxNxN = sel_BxN[:, None, :] == par_BxN[:, :, None]
        parent_BxN = jnp.where(par_BxN < 0, 0, jnp.where(  # -1: parent not kept (never)
            jnp.any(is_par_BxNxN, axis=2), jnp.argmax(is_par_BxNxN, axis=2) + 1, -1))
        depth_BxN1 = jnp.pad(jnp.asarray(depth_X, jnp.int32)[sel_BxN], ((0, 0), (1, 0)))
        draft_BxN = ids_K[jnp.take_along_axis(jnp.concatenate(toks, axis=1), sel_BxN, axis=1)]
        return Draft(draft_BxN, None, cache, RowTree(parent_BxN.astype(jnp.int32), depth_BxN1))

    # -- training --------------------------------------------------------------------------

    def unroll(self, params, features_BxLxD, tokens_BxL, steps: int):
        """Teacher-forced over every position, `steps` drafts deep: step 0 reads the target's
        features f_p (and token p + 1) and predicts f_{p+1}; step j reads its own step j - 1
        prediction at position p + j (and the true token p + j + 1), as draft j + 1 does when
        drafts 1..j were accepted (EAGLE-3's training-time test, HASS). Its queries see what
        drafting's cache holds: step 0's entries up to p, and its own chain's entries at
        p + 1 .. p + j (a tree over steps x S slots). Returns [steps, B, S, D], S = L - 2: the
        predicted final-normed feature of position p + j + 1, which drafts token p + j + 2."""
        B, Lq, _ = features_BxLxD.shape
        S = Lq - 2
        f_BxLxD = feature(params["shared"], self.config, features_BxLxD)
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
            h_BxSxD, cache = self.layer(params, h_BxSxD, tok_BxT[:, 1 + j:1 + j + S], pos_BxS,
                                        cache, slots_BxS, (base_B, depth_M, visible_SxM))
            out.append(h_BxSxD)
        return jnp.stack(out)

    def forced_logits(self, params, features_BxLxD, tokens_BxL, steps: int) -> list:
        """As `HiddenSpec.forced_logits`, every entry over L - 2 positions (the last ones run
        past the text)."""
        return list(head_logits(params["shared"],
                                self.unroll(params, features_BxLxD, tokens_BxL, steps)))

    def loss(self, params, features_BxLxD, tokens_BxL, mask_BxL, to_head_V, reg_weight=1.0,
             unroll: int = 1, labels_BxL=None):
        """Drafts `unroll` steps deep on its own predictions (`unroll`), plus `reg_weight` x the
        smooth-L1 distance between its output and the next position's final-normed feature,
        relative to that feature's RMS."""
        want_BxL = self.wanted(tokens_BxL, labels_BxL)
        S = features_BxLxD.shape[1] - 2
        h_UxBxSxD = self.unroll(params, features_BxLxD, tokens_BxL, unroll)
        f_BxLxD = feature(params["shared"], self.config, features_BxLxD)
        total, count = 0.0, 0
        for j in range(unroll):  # step j drafts token p + j + 2 from a guess of f_{p+j+1}
            tok_BxS, m_BxS = shifted(want_BxL, 2 + j, S), shifted(mask_BxL, 2 + j, S)
            c, n = self.cross_entropy(head_logits(params["shared"], h_UxBxSxD[j]), tok_BxS, m_BxS,
                                      to_head_V, 0.8 ** j)
            total = total + c
            count = count + n if j == 0 else count
            m = shifted(mask_BxL, 1 + j, S)
            want = shifted(f_BxLxD, 1 + j, S)
            scale = jnp.sqrt(jnp.mean(want * want, axis=-1, keepdims=True) + 1e-6)
            d = jnp.abs(h_UxBxSxD[j] - want) / scale
            reg = jnp.where(d < 1, 0.5 * d * d, d - 0.5).mean(-1)
            total = total + 0.8 ** j * reg_weight * jnp.sum(jnp.where(m, reg, 0)) / (
                jnp.maximum(jnp.sum(m), 1))
        return total, count

    @classmethod
    def init_head(cls, config: ModelConfig, depth: int, key, target_params=None) -> dict:
        """The decoder layer starts from the target's last layer when `target_params` is given,
        else random."""
        D = config.hidden_size
        k1, k2 = jax.random.split(key)
        one = dataclasses.replace(config, num_layers=1, layer_types=(), head_vocab_size=None)
        layer = (jax.tree.map(lambda x: jnp.asarray(x, jnp.float32),
                              target_params["layers"][-1]) if target_params is not None
                 else init_params(one, k2)["layers"][0])
        fc = jax.random.normal(k1, (2 * D, D), jnp.float32).T * (2 * D) ** -0.5
        return {"fc": fc, "layer": layer}
