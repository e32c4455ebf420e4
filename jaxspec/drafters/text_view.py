"""A language-only drafter for a vision-language target (Gagrani et al. 2024, arXiv
2404.08856): the drafter sees the text without its images.

The target's rows hold each image as a span (`<start_of_image>`, the image tokens,
`<end_of_image>`); the drafter's rows are the same text with every span dropped, or replaced by
`placeholder` tokens. Its row b is the target's shifted by a fixed `shift[b]` once past the
prompt (what is generated is text), so each step reads the target's tokens at position
t + shift and the drafter underneath drafts as it would for a text prompt. Its tokens are
position-free, so the target verifies them as any draft.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.drafters.base import Draft, Drafter, DraftInput, DraftSpec
from jaxspec.errors import UserError


@flax.struct.dataclass
class ViewState:
    inner: object  # the wrapped drafter's state
    prompt_BxT: jax.Array  # the drafter's view of each prompt, padded
    prompt_len_B: jax.Array
    shift_B: jax.Array  # target position - drafter position past the prompt


@dataclasses.dataclass(frozen=True)
class TextViewSpec(DraftSpec):
    inner: DraftSpec
    span_ids: tuple[int, ...]  # the image token, <start_of_image>, <end_of_image>
    placeholder: tuple[int, ...] = ()

    drafts_trees = property(lambda self: self.inner.drafts_trees)
    drafts_dynamic_trees = property(lambda self: self.inner.drafts_dynamic_trees)
    fixed_shape = property(lambda self: self.inner.fixed_shape)
    cost_key = property(lambda self: self.inner.cost_key)
    tuned_gamma = property(lambda self: self.inner.tuned_gamma)
    tuned_tree = property(lambda self: self.inner.tuned_tree)

    def validate(self, params, target) -> None:
        self.inner.validate(params, target)

    def loop_spec(self) -> "TextViewSpec":
        return dataclasses.replace(self, inner=self.inner.loop_spec())

    def own_params(self, params):
        return self.inner.own_params(params)

    def extend(self, tree):
        return self.inner.extend(tree)

    def _text(self, tokens_BxT, lengths_B):
        """Each prompt without its image spans (each span's first token replaced by the
        placeholder): (tokens [B, T], lengths [B])."""
        B, T = tokens_BxT.shape
        span_BxT = jnp.isin(tokens_BxT, jnp.asarray(self.span_ids)) & (
            jnp.arange(T) < lengths_B[:, None])
        first_BxT = span_BxT & ~jnp.pad(span_BxT, ((0, 0), (1, 0)))[:, :-1]
        P = len(self.placeholder)
        width_BxT = jnp.where(span_BxT, jnp.where(first_BxT, P, 0), 1)
        at_BxT = jnp.cumsum(width_BxT, axis=1) - width_BxT  # where each token's output starts
        rows_Bx1 = jnp.arange(B)[:, None]
        text_BxT = jnp.zeros_like(tokens_BxT).at[
            rows_Bx1, jnp.where(span_BxT, T, at_BxT)].set(tokens_BxT, mode="drop")
        for j, tok in enumerate(self.placeholder):
            text_BxT = text_BxT.at[rows_Bx1, jnp.where(first_BxT, at_BxT + j, T)].set(
                tok, mode="drop")
        lengths_B = jnp.sum(jnp.where(jnp.arange(T) < lengths_B[:, None], width_BxT, 0), axis=1)
        return text_BxT, lengths_B

    def _view(self, state: ViewState, inp: DraftInput) -> DraftInput:
        """The drafter's input: its prompt, then the target's tokens shifted."""
        T = inp.tokens_BxT.shape[1]
        t_T = jnp.arange(T)
        later_BxT = jnp.take_along_axis(
            inp.tokens_BxT, jnp.minimum(t_T + state.shift_B[:, None], T - 1), axis=1)
        tokens_BxT = jnp.where(t_T < state.prompt_len_B[:, None], state.prompt_BxT, later_BxT)
        return inp.replace(tokens_BxT=tokens_BxT, lengths_B=inp.lengths_B - state.shift_B)

    def init(self, params, inp: DraftInput):
        text_BxT, text_len_B = self._text(inp.tokens_BxT, inp.lengths_B)
        state = ViewState(None, text_BxT, text_len_B, inp.lengths_B - text_len_B)
        return state.replace(inner=self.inner.init(params, self._view(state, inp)))

    def propose(self, params, state: ViewState, inp: DraftInput, key, sampling, shape) -> Draft:
        draft = self.inner.propose(params, state.inner, self._view(state, inp), key, sampling,
                                   shape)
        return draft.replace(state=state.replace(inner=draft.state))

    def has_draft(self, params, state: ViewState, inp: DraftInput):
        return self.inner.has_draft(params, state.inner, self._view(state, inp))

    def observe(self, params, state: ViewState, logits_BxN1xV):
        return state.replace(inner=self.inner.observe(params, state.inner, logits_BxN1xV))


def text_view(drafter: Drafter, vision_config, placeholder=()) -> Drafter:
    """`drafter` seeing a vision-language target's text only (`placeholder`: token ids standing
    for each image; none: the image is dropped). A drafter that reads the target's hidden
    states is refused: those states are the image's at its positions."""
    if drafter.spec.reads_features:
        raise UserError(f"{drafter.name or type(drafter.spec).__name__} reads the target's "
                        f"hidden states, which hold the image: with images, draft with a "
                        f"language-only drafter (a model, layer skip, n-gram)")
    vc = vision_config
    spec = TextViewSpec(drafter.spec, (vc.image_token_id, vc.boi_token_id, vc.eoi_token_id),
                        tuple(int(t) for t in placeholder))
    return dataclasses.replace(drafter, spec=spec)
