"""Drafters: propose a draft of a given shape and the distribution each token was drawn from.

A `Drafter` pairs a static, hashable `spec` (how to draft) with a `params` pytree (what it drafts
with). Every spec is a `DraftSpec`:

    validate(params, target) -> None                  # raises UserError if it cannot serve
    init(params, inp) -> state                        # prefill; a pytree
    propose(params, state, inp, key, sampling, shape) -> Draft

`inp` is a `DraftInput` (each row's text so far, the target's cache and, for a drafter that reads
them, the target's features), `shape` a `trees.Tree` (a chain is one) or a `trees.DynamicTree`, and
a `Draft` holds the drafted tokens in the shape's node order, q (what each was drawn from; None
when greedy), the drafter's next state, and for a dynamic tree the tree each row drafted. `propose`
hands a chain to `draft_chain`, which every spec implements, a static tree to `draft_tree`
(`drafts_trees`) and a dynamic one to `draft_dynamic` (`drafts_dynamic_trees`, EAGLE-2). The other
abilities are declared with their defaults, so the loop asks, never probes: which rows have a draft
worth verifying (`has_draft`; gamma "auto" gives the others a plain step), a shape of its own
(`fixed_shape`, `extend`: hybrid.py, lookahead.py) and the smaller one a step takes when no row
has a draft (`fallback`: hybrid.py), what it learns from the target's verification
(`observe`: lookahead.py), whether it reads the target's features (`reads_features`,
`feature_layer`), which drafters cost alike (`cost_key`), the params it holds beyond the target's
(`own_params`), and the shape it was tuned for (`tuned_gamma`, `tuned_tree`, `tuned_branch`: read
by the host; `loop_spec` drops them, so the loop compiled for one serves drafters tuned
differently).

A drafter's cache must hold positions [0, length - 2) on entry; on exit it may hold more, since
the caller rolls back by lowering lengths. The verifier never looks inside the drafter.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.decoding.trees import DynamicTree, Tree
from jaxspec.errors import UserError


@flax.struct.dataclass
class DraftInput:
    """What a drafter reads at a step: each row's text so far in the first `lengths_B` slots of
    `tokens_BxT`; for a spec that `reads_features`, the target's hidden states of positions
    [0, length - 1) in `features_BxTxD` (the others get [B, T, 0]); the target's vocabulary;
    the target's KV cache, which holds positions [0, length - 1) (speculative streams attend
    to it; a drafter never changes it)."""

    tokens_BxT: jax.Array
    lengths_B: jax.Array
    features_BxTxD: jax.Array
    vocab_size: int = flax.struct.field(pytree_node=False)
    target_cache: Any = None


@flax.struct.dataclass
class Draft:
    """A step's draft: tokens [B, N] in the shape's node order (a chain's: by depth), q (a
    `sampling.DraftProbs`; None when greedy), the drafter's next state, and for a dynamic tree
    the tree each row drafted (a `trees.RowTree`)."""

    tokens_BxN: jax.Array
    q: Any
    state: Any
    rows: Any = None


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
        return Drafter(self.params, self.spec.loop_spec())


class DraftSpec:
    """The drafter interface (module docstring): the required methods, and every optional
    ability with its default."""

    reads_features = False  # gets the target's hidden states
    feature_layer = None  # reads them at this layer's input (None: the last layer's output)
    drafts_trees = False  # implements draft_tree
    drafts_dynamic_trees = False  # implements draft_dynamic (EAGLE-2)
    fixed_shape = False  # `extend` gives the tree it drafts; gamma "auto" is refused
    cost_key = None  # drafters with one key share measured step costs (default: their name)
    tuned_gamma = None  # the draft length it was tuned for
    tuned_tree = None  # the token tree it was tuned for (choices)
    tuned_branch = None  # the n-gram branch its tuned shape carries (tokens; hybrid.py)

    def validate(self, params, target) -> None:
        raise NotImplementedError

    def init(self, params, inp: DraftInput):
        raise NotImplementedError

    def propose(self, params, state, inp: DraftInput, key, sampling,
                shape: Tree | DynamicTree) -> Draft:
        """Draft `shape` (greedy only for a dynamic tree)."""
        if isinstance(shape, DynamicTree):
            if not self.drafts_dynamic_trees:
                raise UserError(f"drafter {type(self).__name__} cannot draft dynamic trees")
            return self.draft_dynamic(params, state, inp, shape)
        if shape.is_chain:
            return self.draft_chain(params, state, inp, key, sampling, shape.size)
        if not self.drafts_trees:
            raise UserError(f"drafter {type(self).__name__} cannot draft trees; use a chain "
                            f"(gamma)")
        return self.draft_tree(params, state, inp, key, sampling, shape)

    def draft_chain(self, params, state, inp: DraftInput, key, sampling, gamma: int) -> Draft:
        raise NotImplementedError

    def draft_tree(self, params, state, inp: DraftInput, key, sampling, tree: Tree) -> Draft:
        raise NotImplementedError

    def draft_dynamic(self, params, state, inp: DraftInput, dtree: DynamicTree) -> Draft:
        raise NotImplementedError

    def loop_spec(self) -> "DraftSpec":
        """The spec the decode loop is compiled for: this one less what only the host reads
        (the tuned shape), so drafters that differ only there share an executable."""
        return self

    def own_params(self, params):
        """Its params that are not the target's (what memory planning counts): all of them."""
        return params

    def has_draft(self, params, state, inp: DraftInput):
        """Which rows have a draft worth verifying: all of them."""
        return jnp.ones(inp.lengths_B.shape, bool)

    def extend(self, tree):
        """The tree the target verifies when `tree` is asked for: `tree` itself."""
        return tree

    def fallback(self, tree):
        """(spec, tree) a step drafts instead of `tree` (as `extend` gave it) when no row
        `has_draft`: the same state, a smaller shape. None: every step drafts `tree`."""
        return None

    def observe(self, params, state, logits_BxN1xV):
        """The drafter state after the target scored the root and every node: unchanged."""
        return state
