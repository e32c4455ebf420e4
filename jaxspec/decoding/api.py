"""The public decoding functions: `generate`, `speculative_generate` (gamma="auto" measures the
loop's step costs here, through `profile`) and `stream_generate`, over `runner.DECODER`."""

from __future__ import annotations

from typing import Sequence

from jaxspec.decoding import profile, runner
from jaxspec.decoding.runner import GenerationResult, check_auto, encode_prompts
from jaxspec.decoding.sampling import Sampling
from jaxspec.drafters.hybrid import hybrid_drafter
from jaxspec.drafters.model import as_drafter
from jaxspec.errors import UserError


def stream_generate(model, prompts, seeds=None, *, batch_size: int = 8,
                    max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                    top_p: float | None = None, stop=None, chat: bool = False,
                    refill_size: int | None = None, max_steps: int = 64,
                    cache_slots: int | None = None):
    """Continuous batching: yields (prompt index, new token ids) as rows finish (see
    `Decoder.stream`). Each row's tokens equal those of `generate` on that prompt alone when
    greedy; sampled rows use their own keys (`seeds`, one uint32 per prompt), so the output does
    not depend on `batch_size`."""
    ids = encode_prompts(model, prompts, chat)
    return runner.DECODER.stream(model, ids, seeds, batch_size=batch_size,
                                 max_new_tokens=max_new_tokens,
                                 sampling=Sampling(temperature, top_k, top_p), stop=stop,
                                 refill_size=refill_size, max_steps=max_steps,
                                 cache_slots=cache_slots)


def generate(model, prompts, max_new_tokens: int | Sequence[int] = 64, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0, stop=None,
             chat: bool = False, images=None) -> GenerationResult:
    """Autoregressive decoding: prefill, then one `lax.while_loop` of one token per step.

    images: for a vision-language target (Gemma 3 4B and larger), one entry per prompt: an
    image (a path, an array [H, W, 3] or a PIL image), a list of them, or None; a single prompt
    may take one image alone. Each goes to a `<start_of_image>` of its prompt, or before the
    text when there is none (`image_prompts`).

    stop: a string, a token id, or a list of them; the model's end-of-sequence ids always stop.
    A row ends at the token whose text completes a stop string (inside the token or spelled over
    several, in the generated text only): its ids end with that token, its text just before the
    string."""
    return runner.DECODER(model, None, prompts, gamma=0, max_new_tokens=max_new_tokens,
                          sampling=Sampling(temperature, top_k, top_p), seed=seed, stop=stop,
                          chat=chat, images=images)


def speculative_generate(target, drafter, prompts, gamma: int | str | None = None,
                         max_new_tokens: int | Sequence[int] = 64, temperature: float = 0.0,
                         top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                         stop=None, chat: bool = False, gamma_max: int = 4,
                         costs: Sequence[float] | None = None, tree=None,
                         remember: bool = True, images=None,
                         image_placeholder=None) -> GenerationResult:
    """Speculative decoding: `drafter` (a jaxspec Model or a Drafter from `layer_skip_drafter`,
    `ngram_drafter`, `model_drafter`) proposes `gamma` tokens, the target verifies them in one
    call, and each row keeps what it accepts. Greedy output equals `generate`'s; sampled output
    has exactly the target's distribution.

    gamma="auto": each row picks its draft length (0 to `gamma_max`) every step from its
    acceptance so far and the cost model (`costs`: the step cost of each length relative to a
    plain step; by default measured by `jaxspec profile` and cached). Rows start from what
    earlier calls in this process measured of the same drafter, target and sampling, per draft
    position (`plan.AcceptanceMemory`), and this call's counts are added to it; remember=False
    starts from the prior alone and leaves the history as it was.

    tree: instead of a chain of gamma, each step drafts a token tree, given as Medusa/EAGLE
    "choices" (paths of candidate ranks, e.g. [(0,), (1,), (0, 0), (0, 1), (1, 0)]) or a
    `trees.Tree`, and the target verifies all its nodes in one call (greedy and sampled output
    stay exact). The model, layer-skip, n-gram, Medusa, Hydra and EAGLE drafters draft trees.
    An EAGLE head also drafts EAGLE-2's dynamic trees, a shape per row and step (greedy):
    "dynamic:BUDGET[:DEPTH[:WIDTH]]" or a `trees.DynamicTree`.
    With neither gamma nor tree, a trained drafter's tuned tree, else its tuned gamma, else 4,
    with n-gram lookup's branch beside it where the head was tuned with one (`tuned_branch`:
    `hybrid_drafter`; the head alone at any gamma or tree given, "auto" included).

    images (as for `generate`): the target reads them; the drafter sees the text only, each
    image dropped or replaced by `image_placeholder` (a text or token ids), so any language-only
    drafter of the target's vocabulary, or a prefix of it, serves (`drafters.text_view`)."""
    if drafter is None:
        raise UserError("speculative_generate needs a drafter; use generate without one")
    if tree is not None and gamma is not None:
        raise UserError("give gamma (a chain) or tree, not both")
    if gamma is None and tree is None:
        tuned = as_drafter(drafter)
        spec = tuned.spec
        tree = spec.tuned_tree
        gamma = None if tree is not None else spec.tuned_gamma or 4
        if spec.tuned_branch:
            drafter = hybrid_drafter(tuned, length=spec.tuned_branch)
    if gamma == "auto" and costs is None:
        costs = _measured_costs(target, drafter, gamma_max)
    return runner.DECODER(target, drafter, prompts, gamma=gamma, max_new_tokens=max_new_tokens,
                          sampling=Sampling(temperature, top_k, top_p), seed=seed, stop=stop,
                          chat=chat, gamma_max=gamma_max, costs=costs, tree=tree,
                          remember=remember, images=images, image_placeholder=image_placeholder)


def _measured_costs(target, drafter, gamma_max: int) -> list[float]:
    """The step costs of draft lengths 0..gamma_max measured in the decode loop (and cached) for
    this target and drafter, or one that costs the same (`cost_key`), on this machine."""
    check_auto(drafter)
    drafter = as_drafter(drafter, target)
    key = drafter.spec.cost_key or drafter.name
    return profile.step_costs(target, target.name, drafter, key, gamma_max)
