"""What the hidden-state drafters (medusa.py, hydra.py, eagle.py) share.

Each drafts from the target's features (slot p: the target's last-layer output at position p,
before its final norm) and shares the target's frozen embedding, final norm and output-head rows:
`params["shared"]` holds references to the target's arrays and the head rows `head_KxD` at
`params["vocab_ids"]` (gathered when the drafter is built, never stored in its checkpoint), and
`params["head"]` the trained weights. The heads work in the space the target's output head reads:
a feature passes the target's final norm first (which also tames the few huge dimensions of the
raw residual stream), and a head's output goes straight to the head rows, as in Medusa and EAGLE.

Each kind's `loss` is its training objective over teacher-forced features; drafting and training
share the per-position functions, so what is trained is what drafts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.sampling import DraftProbs, pick
from jaxspec.drafters.base import Draft, DraftInput, DraftSpec
from jaxspec.errors import UserError
from jaxspec.models import layers as L


def norm(x):
    return L.rms_norm(x, jnp.ones(x.shape[-1:], jnp.float32), 1e-6)


def embed(shared, tokens):
    """A token's embedding, normed (Gemma's sqrt(D) scale vanishes in the norm)."""
    return norm(L.embed(shared["embed"], tokens))


def feature(shared, config: ModelConfig, f_xD):
    """A target feature as its output head reads it: through the target's final norm."""
    return L.rms_norm(f_xD, shared["final_norm"], config.rms_eps)


def head_logits(shared, h_xD):
    """Logits over the head's K ids from a final-normed feature (or a head's prediction of one)."""
    lead = h_xD.shape[:-1]
    x_BxSxD = h_xD.reshape(-1, 1, h_xD.shape[-1])
    return L.linear(x_BxSxD, shared["head_KxD"]).reshape(*lead, -1)


def shared_params(target_params, vocab_ids) -> dict:
    """The target's arrays a head reads: embedding, final norm and the head rows at vocab_ids."""
    ids = jnp.asarray(vocab_ids, jnp.int32)
    head = target_params.get("lm_head")
    head_KxD = (head if head is not None else target_params["embed"])[ids]
    return {"embed": target_params["embed"], "final_norm": target_params["final_norm"],
            "head_KxD": head_KxD}


def shifted(x_BxL, start: int, S: int):
    """x[:, start:start + S], zero-padded past the end."""
    x = x_BxL[:, start:start + S]
    return jnp.pad(x, ((0, 0), (0, S - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


@dataclasses.dataclass(frozen=True)
class HiddenSpec(DraftSpec):
    """A hidden-state drafter for a target with `config`: `depth` heads or stages (medusa,
    hydra: the longest draft), `tuned_gamma` the draft length it was tuned for, `tuned_tree`
    the token tree (choices), if one was, and `tuned_branch` the length of the n-gram lookup
    branch its tuned shape adds (`hybrid.py`), if any. Subclasses name their `kind` and
    implement drafting, `forced_logits` and `init_head` (and `loss` where theirs is not the
    cross-entropy of their teacher-forced drafts)."""

    config: ModelConfig
    depth: int = 4
    tuned_gamma: int | None = None
    tuned_tree: tuple[tuple[int, ...], ...] | None = None
    tuned_branch: int | None = None
    kind = ""
    reads_features = True
    drafts_trees = True
    max_verified_depth = None  # the deepest tree the target may verify between two drafts

    def loop_spec(self) -> "HiddenSpec":
        return dataclasses.replace(self, tuned_gamma=None, tuned_tree=None, tuned_branch=None)

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

    @property
    def options(self) -> dict:
        """The kind's own settings beyond config and depth (saved with its checkpoint)."""
        return {}

    def shared(self, target_params, vocab_ids) -> dict:
        """The target's frozen arrays it reads (`shared_params`), as `params["shared"]`."""
        return shared_params(target_params, vocab_ids)

    def own_params(self, params):
        """The trained weights, head rows and ids: `shared`'s other arrays are the target's."""
        return (params["head"], params["shared"]["head_KxD"], params["vocab_ids"])

    def check_depth(self, depth: int, asked: str) -> None:
        """Refuse to draft `depth` deep (`asked` says what asked for it): one head or stage
        drafts each depth."""
        if depth > self.depth:
            raise UserError(f"this {self.kind} drafter has {self.depth} heads; {asked}")

    def init(self, params, inp: DraftInput):
        return ()

    @staticmethod
    def last(inp: DraftInput):
        """Each row's last feature (position length - 2) [B, D] and last token [B]."""
        rows_B = jnp.arange(inp.tokens_BxT.shape[0])
        f_BxD = inp.features_BxTxD[rows_B, jnp.maximum(inp.lengths_B - 2, 0)]
        return f_BxD, inp.tokens_BxT[rows_B, jnp.maximum(inp.lengths_B - 1, 0)]

    @staticmethod
    def pick(params, key, h_BxD, sampling):
        idx_B, q_BxK = pick(key, head_logits(params["shared"], h_BxD), sampling)
        return params["vocab_ids"][idx_B], q_BxK

    @staticmethod
    def chain(params, drafts, qs, state, sampling) -> Draft:
        """The Draft of a chain from its tokens [B] and distributions [B, K], depth by depth."""
        draft_BxG = jnp.stack(drafts, axis=1)
        if sampling.greedy:
            return Draft(draft_BxG, None, state)
        q_BxGxK = jnp.stack(qs, axis=1)
        ids_BxGxK = jnp.broadcast_to(params["vocab_ids"], q_BxGxK.shape)
        return Draft(draft_BxG, DraftProbs(q_BxGxK, ids_BxGxK), state)

    @staticmethod
    def wanted(tokens_BxL, labels_BxL):
        """The token each position drafts: the text's, or with `labels_BxL` (the target's
        greedy token after each position) the target's."""
        return (tokens_BxL if labels_BxL is None
                else jnp.pad(labels_BxL[:, :-1], ((0, 0), (1, 0))))

    @staticmethod
    def cross_entropy(logits_BxSxK, targets_BxS, mask_BxS, to_head_V, weight):
        """`weight` x the mean cross-entropy over the head's ids of the masked targets (those
        outside the head skipped), and their count."""
        t = to_head_V[targets_BxS]
        m = mask_BxS & (t >= 0)
        logp = jax.nn.log_softmax(logits_BxSxK, axis=-1)
        nll = -jnp.take_along_axis(logp, jnp.maximum(t, 0)[..., None], axis=-1)[..., 0]
        n = jnp.sum(m)
        return weight * jnp.sum(jnp.where(m, nll, 0.0)) / jnp.maximum(n, 1), n

    def forced_logits(self, params, features_BxLxD, tokens_BxL, steps: int) -> list:
        """Teacher-forced logits of drafts 1..`steps` over the head's ids at every position of a
        text (the target's features, the true tokens): entry j [B, S_j, K] at p drafts token
        p + j + 2. What greedy decoding drafts at p + 2 + j when drafts 1..j were accepted."""
        raise NotImplementedError

    def loss(self, params, features_BxLxD, tokens_BxL, mask_BxL, to_head_V, reg_weight=1.0,
             unroll: int = 1, labels_BxL=None):
        """The training objective over teacher-forced features (`forced_logits`, `depth` deep):
        mean cross-entropy over the head's ids of every draft of a masked token, weighted 0.8^k
        by depth k (the token drafted is the text's, or with `labels_BxL` the target's).
        Returns (loss, number of targets)."""
        want_BxL = self.wanted(tokens_BxL, labels_BxL)
        total, count = 0.0, 0
        for k, logits in enumerate(self.forced_logits(params, features_BxLxD, tokens_BxL,
                                                      self.depth)):
            c, n = self.cross_entropy(logits, want_BxL[:, 2 + k:], mask_BxL[:, 2 + k:],
                                      to_head_V, 0.8 ** k)
            total, count = total + c, count + n
        return total, count

    @classmethod
    def init_head(cls, config: ModelConfig, depth: int, key, target_params=None) -> dict:
        """Freshly initialised trained weights."""
        raise NotImplementedError
