"""Hidden-state drafters by kind (medusa.py, hydra.py, eagle.py, streams.py; what they share:
head.py), and building one over a target."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.drafters.base import Drafter
from jaxspec.drafters.eagle import EagleSpec
from jaxspec.drafters.head import HiddenSpec
from jaxspec.drafters.hydra import HydraSpec
from jaxspec.drafters.medusa import MedusaSpec
from jaxspec.drafters.streams import StreamSpec
from jaxspec.errors import UserError

SPECS = {s.kind: s for s in (MedusaSpec, HydraSpec, EagleSpec, StreamSpec)}
KINDS = tuple(SPECS)


def _spec_class(kind: str) -> type[HiddenSpec]:
    if kind not in SPECS:
        raise UserError(f"unknown hidden-state drafter kind {kind!r}; use one of {KINDS}")
    return SPECS[kind]


def hidden_spec(kind: str, config: ModelConfig, depth: int = 4, tuned_gamma: int | None = None,
                tuned_tree=None, options: dict | None = None,
                tuned_branch: int | None = None) -> HiddenSpec:
    """The spec of a `kind` drafter for a target with `config` (`HiddenSpec`); `options`: the
    kind's own settings (`HiddenSpec.options`)."""
    return _spec_class(kind)(config, depth, tuned_gamma, tuned_tree, tuned_branch=tuned_branch,
                             **(options or {}))


def head_params(kind: str, config: ModelConfig, depth: int, key, target_params=None) -> dict:
    """Freshly initialised trained weights of a `kind` head (`init_head` of its spec)."""
    return _spec_class(kind).init_head(config, depth, key, target_params)


def hidden_drafter(target, kind: str, head, vocab_ids=None, depth: int = 4,
                   tuned_gamma: int | None = None, name: str = "", tuned_tree=None,
                   tuned_accept=None, options: dict | None = None,
                   tuned_branch: int | None = None) -> Drafter:
    """A hidden-state drafter of `kind` over `target` (a jaxspec Model) with trained weights
    `head` (from `head_params` or a checkpoint); `vocab_ids` [K] are the token ids its head
    proposes (default: the whole vocabulary)."""
    tree = None if tuned_tree is None else tuple(tuple(int(r) for r in p) for p in tuned_tree)
    spec = hidden_spec(kind, target.config, depth, tuned_gamma, tree, options, tuned_branch)
    vocab_ids = (np.arange(target.config.vocab_size) if vocab_ids is None
                 else np.asarray(vocab_ids))
    dtype = target.params["embed"].dtype  # weights in the target's precision
    head = jax.tree.map(lambda x: jnp.asarray(x, dtype), head)
    params = {"shared": spec.shared(target.params, vocab_ids), "head": head,
              "vocab_ids": jnp.asarray(vocab_ids, jnp.int32)}
    spec.validate(params, target)
    return Drafter(params, spec, name or kind,
                   None if tuned_accept is None else tuple(map(float, tuned_accept)))
