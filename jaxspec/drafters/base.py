"""Drafters: propose `gamma` tokens and the distribution each was drawn from.

A `Drafter` pairs a static, hashable `spec` (how to draft) with a `params` pytree (what it drafts
with). Every spec is a `DraftSpec`: it implements

    validate(params, target) -> None                    # raises UserError if it cannot serve
    init(params, tokens_BxT, lengths_B, features_BxTxD) -> state      # prefill; a pytree
    propose(params, state, tokens_BxT, lengths_B, key, sampling, gamma, vocab_size,
            features_BxTxD) -> draft_BxG, q (a DraftProbs; None when greedy), state

and `DraftSpec` declares every optional ability with its default, so the loop asks, never
probes: which rows have a draft worth verifying (`has_draft`; gamma "auto" gives the others a
plain step), token trees (`drafts_trees`, `propose_tree`: per node what it was drawn from; a
chain goes through `propose`) and EAGLE-2's dynamic ones (`drafts_dynamic_trees`), a shape of
its own (`fixed_shape`, `extend`: hybrid.py, lookahead.py), what it learns from the target's
verification (`observe`: lookahead.py), whether it reads the target's features
(`reads_features`), which drafters cost alike (`cost_key`), and the shape it was tuned for
(`tuned_gamma`, `tuned_tree`).

`tokens_BxT` holds each row's text so far in its first `lengths_B` slots. A drafter's cache must
hold positions [0, length - 2) on entry; on exit it may hold more, since the caller rolls back by
lowering lengths. A spec that reads features gets the target's hidden states for positions
[0, length - 1) in `features_BxTxD` (hidden.py); the others get [B, T, 0]. The verifier never
looks inside the drafter.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax.numpy as jnp

from jaxspec.errors import UserError


@flax.struct.dataclass
class Drafter:
    """A pytree: `params` are traced, `spec` is static; `name` and `tuned_accept` (the
    per-position acceptance a trained drafter recorded when it was tuned, gamma="auto"'s
    starting point) are for the host: the decode loop gets the drafter `bare`, so drafters of
    one spec and param shapes share a compiled loop."""

    params: Any
    spec: Any = flax.struct.field(pytree_node=False)
    name: str = flax.struct.field(pytree_node=False, default="")
    tuned_accept: tuple[float, ...] | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def bare(self) -> "Drafter":
        return Drafter(self.params, self.spec)


class DraftSpec:
    """The drafter interface (module docstring): the required methods, and every optional
    ability with its default."""

    reads_features = False  # gets the target's hidden states
    drafts_trees = False  # implements propose_tree
    drafts_dynamic_trees = False  # implements propose_dynamic (EAGLE-2)
    fixed_shape = False  # `extend` gives the tree it drafts; gamma "auto" is refused
    cost_key = None  # drafters with one key share measured step costs (default: their name)
    tuned_gamma = None  # the draft length it was tuned for
    tuned_tree = None  # the token tree it was tuned for (choices)
    shares_target_params = False  # its params are the target's (layer skip): no memory of its own

    def validate(self, params, target) -> None:
        raise NotImplementedError

    def init(self, params, tokens_BxT, lengths_B, features_BxTxD=None):
        raise NotImplementedError

    def propose(self, params, state, tokens_BxT, lengths_B, key, sampling, gamma, vocab_size,
                features_BxTxD=None):
        raise NotImplementedError

    def propose_tree(self, params, state, tokens_BxT, lengths_B, key, sampling, tree, vocab_size,
                     features_BxTxD=None):
        raise UserError(f"drafter {type(self).__name__} cannot draft trees; use a chain (gamma)")

    def has_draft(self, params, state, tokens_BxT, lengths_B):
        """Which rows have a draft worth verifying: all of them."""
        return jnp.ones(tokens_BxT.shape[:1], bool)

    def extend(self, tree):
        """The tree the target verifies when `tree` is asked for: `tree` itself."""
        return tree

    def observe(self, params, state, logits_BxN1xV):
        """The drafter state after the target scored the root and every node: unchanged."""
        return state
