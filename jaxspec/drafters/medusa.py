"""Medusa (Cai et al. 2024): head k (1..K) reads the target's feature f_p and proposes the token
at p + 1 + k, all heads at once."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.decoding.trees import grow
from jaxspec.drafters.base import Draft, DraftInput
from jaxspec.drafters.head import HiddenSpec, feature, head_logits
from jaxspec.models import layers as L


@dataclasses.dataclass(frozen=True)
class MedusaSpec(HiddenSpec):
    kind = "medusa"

    def head(self, params, k: int, f_xD):
        """Head k's prediction (a final-normed feature) from the target's feature."""
        h = feature(params["shared"], self.config, f_xD)
        w = params["head"]["w"][k]
        return h + jax.nn.silu(L.linear(h.reshape(-1, 1, h.shape[-1]), w).reshape(h.shape))

    def draft_chain(self, params, state, inp: DraftInput, key, sampling, gamma: int) -> Draft:
        self.check_depth(gamma, f"gamma {gamma} asks for more")
        f_BxD, _ = self.last(inp)
        keys = jax.random.split(key, gamma)
        picks = [self.pick(params, keys[k], self.head(params, k, f_BxD), sampling)
                 for k in range(gamma)]
        return self.chain(params, *zip(*picks), state, sampling)

    def draft_tree(self, params, state, inp: DraftInput, key, sampling, tree) -> Draft:
        """Top-k per node (`trees.grow`): head d drafts depth d + 1 for every parent (a
        Cartesian tree)."""
        self.check_depth(tree.max_depth, f"the tree is {tree.max_depth} deep")
        f_BxD, _ = self.last(inp)
        shared = params["shared"]

        def expand(d, nodes, tok_BxP, carry):
            logits_BxK = head_logits(shared, self.head(params, d, f_BxD))
            return jnp.broadcast_to(logits_BxK[:, None],
                                    tok_BxP.shape + logits_BxK.shape[-1:]), carry

        root_BxK = head_logits(shared, self.head(params, 0, f_BxD))
        draft_BxN, q, _ = grow(tree, key, sampling, root_BxK, expand, (), params["vocab_ids"])
        return Draft(draft_BxN, q, state)

    def forced_logits(self, params, features_BxLxD, tokens_BxL, steps: int) -> list:
        S = features_BxLxD.shape[1] - 2  # entry j covers S - j positions
        return [head_logits(params["shared"], self.head(params, j, features_BxLxD[:, :S - j]))
                for j in range(steps)]

    @classmethod
    def init_head(cls, config: ModelConfig, depth: int, key, target_params=None) -> dict:
        """Zero: each head starts as the target's own head on f_p."""
        D = config.hidden_size
        return {"w": jnp.zeros((depth, D, D), jnp.float32)}
