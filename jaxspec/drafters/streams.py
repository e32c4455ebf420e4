"""Speculative streaming (Bhendawade et al. 2024), lossless: the target drafts for itself.

Stream j of position p enters the target's top `top` layers from p's state at their input (the
`feature_layer` features the loop keeps) plus a learned stream embedding and a per-stream update
of that state; it sits at position p, attends to the main positions up to p and to streams 0..j
of p (multi-stream attention), and through the target's final norm and head rows drafts token
p + 2 + j. The target's weights are frozen and no main position ever attends to a stream, so
the target's tokens and logits are exactly what they are without streams; only the stream
parameters train (the future n-gram loss, stream j weighted 0.8^j as the heads' depths).

Each step the streams hang on the last verified position, whose features the verify pass just
wrote: they run the target's top layers over `depth` extra positions whose keys and values go to
scratch slots past the text in the drafter's view of the target cache, never into the cache the
loop keeps (the tree attention every draft node uses). Trees are Cartesian over the streams, as
Medusa's are over its heads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.trees import grow
from jaxspec.drafters.base import Draft, DraftInput
from jaxspec.drafters.head import HiddenSpec, feature, head_logits, norm, shared_params
from jaxspec.errors import UserError
from jaxspec.models import layers as L
from jaxspec.models.cache import KVCache, init_cache
from jaxspec.models.transformer import forward


@dataclasses.dataclass(frozen=True)
class StreamSpec(HiddenSpec):
    """`depth` streams through the target's top `top` layers."""

    top: int = 2
    kind = "streams"

    @property
    def feature_layer(self) -> int:
        return self.config.num_layers - self.top

    @property
    def options(self) -> dict:
        return {"top": self.top}

    @property
    def _layers(self) -> tuple[int, ...]:
        return tuple(range(self.feature_layer, self.config.num_layers))

    def shared(self, target_params, vocab_ids) -> dict:
        """The heads' shared arrays and the target's layers (the top ones run the streams)."""
        return {**shared_params(target_params, vocab_ids), "layers": target_params["layers"]}

    def validate(self, params, target) -> None:
        super().validate(params, target)
        if not 1 <= self.top <= target.config.num_layers:
            raise UserError(f"streams through the top {self.top} layers; the target has "
                            f"{target.config.num_layers}")

    def inputs(self, params, f_xD, n: int):
        """Streams 0..n-1 of each position [..., n, D] from its features f: f plus, in units of
        f's RMS, the stream embedding and a per-stream update of the normed f."""
        p = params["head"]
        u_xD = norm(f_xD)
        rms_x1 = jnp.sqrt(jnp.mean(jnp.square(f_xD.astype(jnp.float32)), -1, keepdims=True))
        lead = f_xD.shape[:-1]
        upd = [jax.nn.silu(L.linear(u_xD.reshape(-1, 1, u_xD.shape[-1]), p["w"][j])
                           ).reshape(*lead, -1) for j in range(n)]
        add_xnxD = p["embed"][:n] + jnp.stack(upd, axis=-2)
        return f_xD[..., None, :] + rms_x1[..., None, :] * add_xnxD

    def run(self, params, x_BxSxD, positions_BxS, cache: KVCache, slots_BxS, tree):
        """The top layers over stream inputs in scratch slots (`tree`: as in `forward`,
        unordered: a stream shares its position with its main one): their final-normed outputs
        [B, S, D]."""
        _, _, h = forward(params["shared"], self.config, None, positions_BxS, cache,
                          self._layers, features=True, slots_BxS=slots_BxS, tree=tree,
                          inputs_BxSxD=x_BxSxD)
        return feature(params["shared"], self.config, h)

    def streams(self, params, inp: DraftInput, n: int):
        """The first n streams of each row's last verified position p = length - 2 [B, n, D],
        over the target's cache of positions up to p (their slots p + 1 .. p + n are scratch)."""
        f_BxD, _ = self.last(inp)
        B = f_BxD.shape[0]
        p_B = jnp.maximum(inp.lengths_B - 2, 0)
        k = self.feature_layer
        top = KVCache(inp.target_cache.keys[k:], inp.target_cache.values[k:])
        tree = (p_B + 1, np.full(n, -1), np.tril(np.ones((n, n), bool)), False)
        return self.run(params, self.inputs(params, f_BxD, n), jnp.broadcast_to(p_B[:, None],
                        (B, n)), top, p_B[:, None] + 1 + jnp.arange(n), tree)

    def draft_chain(self, params, state, inp: DraftInput, key, sampling, gamma: int) -> Draft:
        self.check_depth(gamma, f"gamma {gamma} asks for more")
        h_BxGxD = self.streams(params, inp, gamma)
        keys = jax.random.split(key, gamma)
        picks = [self.pick(params, keys[j], h_BxGxD[:, j], sampling) for j in range(gamma)]
        return self.chain(params, *zip(*picks), state, sampling)

    def draft_tree(self, params, state, inp: DraftInput, key, sampling, tree) -> Draft:
        """Top-k per node (`trees.grow`): stream d drafts depth d + 1 for every parent."""
        self.check_depth(tree.max_depth, f"the tree is {tree.max_depth} deep")
        logits_BxAxK = head_logits(params["shared"], self.streams(params, inp, tree.max_depth))

        def expand(d, nodes, tok_BxP, carry):
            return jnp.broadcast_to(logits_BxAxK[:, d, None],
                                    tok_BxP.shape + logits_BxAxK.shape[-1:]), carry

        draft_BxN, q, _ = grow(tree, key, sampling, logits_BxAxK[:, 0], expand, (),
                               params["vocab_ids"])
        return Draft(draft_BxN, q, state)

    # -- training --------------------------------------------------------------------------

    def forced_logits(self, params, features_BxLxD, tokens_BxL, steps: int) -> list:
        """From the `feature_layer` features of every position: the top layers over the main
        positions fill a cache, then `steps` streams of every position attend to it (each to
        the main positions up to its own) and to their own position's earlier streams, all in
        one forward. Entry j [B, L - 2 - j, K] at p drafts token p + j + 2."""
        B, Lq, _ = features_BxLxD.shape
        S, n = Lq - 2, steps
        cache = init_cache(self.config, B, Lq + S * n, num_layers=self.top)
        pos_BxL = jnp.broadcast_to(jnp.arange(Lq), (B, Lq))
        _, cache = forward(params["shared"], self.config, None, pos_BxL, cache, self._layers,
                           inputs_BxSxD=features_BxLxD)
        cache = jax.lax.stop_gradient(cache)
        p_M, j_M = np.divmod(np.arange(S * n), n)  # stream j of p in slot Lq + p * n + j
        visible_MxM = (p_M[:, None] == p_M[None, :]) & (j_M[None, :] <= j_M[:, None])
        tree = (jnp.full((B,), Lq), p_M - Lq, visible_MxM, False)
        x_BxMxD = self.inputs(params, features_BxLxD[:, :S], n).reshape(B, S * n, -1)
        h_BxMxD = self.run(params, x_BxMxD, jnp.broadcast_to(p_M, (B, S * n)), cache,
                           jnp.broadcast_to(Lq + np.arange(S * n), (B, S * n)), tree)
        logits_BxSxnxK = head_logits(params["shared"], h_BxMxD).reshape(B, S, n, -1)
        return [logits_BxSxnxK[:, :S - j, j] for j in range(n)]

    @classmethod
    def init_head(cls, config: ModelConfig, depth: int, key, target_params=None) -> dict:
        """Small random stream embeddings; zero updates (each stream starts as its position)."""
        D = config.hidden_size
        return {"embed": jax.random.normal(key, (depth, D), jnp.float32) * 0.02,
                "w": jnp.zeros((depth, D, D), jnp.float32)}
