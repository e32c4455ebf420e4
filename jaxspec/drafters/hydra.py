"""Hydra (IBM's MLP speculator; Wertheimer et al. 2024): stage k reads stage k - 1's state and
the embedding of the token before the one it proposes, sequentially."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.trees import grow
from jaxspec.drafters.base import Draft, DraftInput
from jaxspec.drafters.head import HiddenSpec, embed, feature, head_logits, norm
from jaxspec.models import layers as L


@dataclasses.dataclass(frozen=True)
class HydraSpec(HiddenSpec):
    kind = "hydra"

    def stage(self, params, k: int, s_xD, tok_x):
        """Stage k: the previous stage's state (a final-normed feature for k = 0) plus an update
        from it and the embedding of the token before the one this stage drafts."""
        p = params["head"]
        x = jnp.concatenate([norm(s_xD), embed(params["shared"], tok_x)], -1)
        y = L.linear(x.reshape(-1, 1, x.shape[-1]), p["w"][k]).reshape(s_xD.shape)
        return s_xD + jax.nn.gelu(L.rms_norm(y, p["norm"][k], 1e-6), approximate=True)

    def draft_chain(self, params, state, inp: DraftInput, key, sampling, gamma: int) -> Draft:
        self.check_depth(gamma, f"gamma {gamma} asks for more")
        f_BxD, tok_B = self.last(inp)
        s_BxD = feature(params["shared"], self.config, f_BxD)
        keys = jax.random.split(key, gamma)
        drafts, qs = [], []
        for k in range(gamma):
            s_BxD = self.stage(params, k, s_BxD, tok_B)
            tok_B, q = self.pick(params, keys[k], s_BxD, sampling)
            drafts.append(tok_B), qs.append(q)
        return self.chain(params, drafts, qs, state, sampling)

    def draft_tree(self, params, state, inp: DraftInput, key, sampling, tree) -> Draft:
        """Top-k per node (`trees.grow`): stage d runs once per node at depth d."""
        self.check_depth(tree.max_depth, f"the tree is {tree.max_depth} deep")
        shared = params["shared"]
        f_BxD, last_B = self.last(inp)
        root_BxD = self.stage(params, 0, feature(shared, self.config, f_BxD), last_B)

        def expand(d, nodes, tok_BxP, carry):
            """carry: the feed indices of the nodes expanded last and their states [B, P, D]."""
            prev, states = carry
            s_BxPxD = states[:, [list(prev).index(int(tree.parent_N[i])) for i in nodes]]
            h_BxPxD = self.stage(params, d, s_BxPxD, tok_BxP)
            return head_logits(shared, h_BxPxD), (nodes + 1, h_BxPxD)

        draft_BxN, q, _ = grow(tree, key, sampling, head_logits(shared, root_BxD), expand,
                               (np.array([0]), root_BxD[:, None]), params["vocab_ids"])
        return Draft(draft_BxN, q, state)

    def forced_logits(self, params, features_BxLxD, tokens_BxL, steps: int) -> list:
        S = features_BxLxD.shape[1] - 2  # entry j covers S - j positions
        s, out = feature(params["shared"], self.config, features_BxLxD[:, :S]), []
        for j in range(steps):
            s = self.stage(params, j, s[:, :S - j], tokens_BxL[:, 1 + j:1 + S])
            out.append(head_logits(params["shared"], s))
        return out

    @classmethod
    def init_head(cls, config: ModelConfig, depth: int, key, target_params=None) -> dict:
        """Drawn [in, out] and turned: a key gives the head it gave before."""
        D = config.hidden_size
        k1, _ = jax.random.split(key)
        w = jax.random.normal(k1, (depth, 2 * D, D), jnp.float32).swapaxes(1, 2) * (2 * D) ** -0.5
        return {"w": w, "norm": jnp.ones((depth, D), jnp.float32)}
