"""A hidden-state head and prompt lookup in one token tree.

Each step the head drafts its chain or tree, and n-gram lookup's continuation of the text enters
the same tree as one more branch under the root (`trees.with_branch`): the target verifies both
in one call. Greedy acceptance keeps the deepest accepted node, so where the two branches begin
alike the longer accepted path wins; sampling applies the sibling rule with the branch's one-hot
q (its drafts are a function of the text), so the output stays exact either way. A step where no
row's text has a match verifies the head's shape alone (`fallback`; on real sentences most steps
have none); in a step that carries the branch, a row without a match repeats its last token
there, as `NgramSpec.draft_chain` does.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.sampling import DraftProbs
from jaxspec.decoding.trees import Tree, branch, with_branch
from jaxspec.drafters.base import Draft, Drafter, DraftInput, DraftSpec
from jaxspec.drafters.head import HiddenSpec
from jaxspec.drafters.ngram import NgramSpec
from jaxspec.errors import UserError


@dataclasses.dataclass(frozen=True)
class HybridSpec(DraftSpec):
    """`head` drafts its shape; `ngram` adds a branch of `length` tokens beside it. The params
    are the head's."""

    head: HiddenSpec
    ngram: NgramSpec
    length: int
    reads_features = True
    drafts_trees = True
    fixed_shape = True

    @property
    def tuned_gamma(self):
        return self.head.tuned_gamma

    @property
    def tuned_tree(self):
        return self.head.tuned_tree

    def validate(self, params, target) -> None:
        self.head.validate(params, target)

    def loop_spec(self) -> "HybridSpec":
        return dataclasses.replace(self, head=self.head.loop_spec())

    def init(self, params, inp: DraftInput):
        return self.head.init(params, inp)

    def own_params(self, params):
        return self.head.own_params(params)

    def extend(self, tree: Tree) -> Tree:
        """The tree the target verifies: the head's (a chain too) and the n-gram branch."""
        out = with_branch(tree, self.length)
        limit = self.head.max_verified_depth
        if limit is not None and out.max_depth > limit:
            raise UserError(f"a {self.head.kind} drafter follows trees up to {limit} deep; with "
                            f"the n-gram branch the tree is {out.max_depth} deep")
        return out

    def has_draft(self, params, state, inp: DraftInput):
        """Rows where lookup has a match: only they get the branch's nodes verified."""
        return self.ngram.has_draft({}, (), inp)

    def fallback(self, tree: Tree):
        """Without a match in any row, the head's own shape."""
        return self.head, branch(tree)[0]

    def draft_tree(self, params, state, inp: DraftInput, key, sampling, tree: Tree) -> Draft:
        rest, rest_N, branch_A = branch(tree)
        head = self.head.propose(params, state, inp, key, sampling, rest)
        ngram = self.ngram.draft_chain({}, (), inp, key, sampling, len(branch_A))
        q_head, q_ngram = head.q, ngram.q
        order = np.argsort(np.concatenate([rest_N, branch_A]))  # back to feed order
        draft_BxN = jnp.concatenate([head.tokens_BxN, ngram.tokens_BxN], axis=1)[:, order]
        if q_head is None:
            return Draft(draft_BxN, None, head.state)
        K = q_head.probs_BxGxK.shape[-1]
        probs_BxNxK, ids_BxNxK = (  # the branch's one-hot q, padded to the head's K entries
            jnp.concatenate([h, jnp.pad(g, [(0, 0), (0, 0), (0, K - 1)])], axis=1)
            for h, g in ((q_head.probs_BxGxK, q_ngram.probs_BxGxK),
                         (q_head.ids_BxGxK, q_ngram.ids_BxGxK)))
        return Draft(draft_BxN, DraftProbs(probs_BxNxK[:, order], ids_BxNxK[:, order]),
                     head.state)


def hybrid_drafter(head: Drafter, max_ngram: int = 3, length: int = 4) -> Drafter:
    """`head` (a hidden-state drafter: `load_drafter` of a shipped head) with prompt lookup
    (`max_ngram`) proposing `length` tokens as a branch of every step's tree."""
    if not isinstance(head.spec, HiddenSpec):
        raise UserError(f"an n-gram branch joins a hidden-state head's tree, not "
                        f"{type(head.spec).__name__}'s (a model drafter takes n-gram lookup "
                        f"staged: DRAFTER+ngram)")
    if max_ngram < 1 or length < 1:
        raise UserError(f"an n-gram branch needs max_ngram >= 1 and length >= 1, got "
                        f"{max_ngram} and {length}")
    return Drafter(head.params, HybridSpec(head.spec, NgramSpec(max_ngram), length),
                   f"{head.name}+ngram-tree:{max_ngram}:{length}", head.tuned_accept)
