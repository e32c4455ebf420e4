"""`jaxspec tune-layer-skip`: which layers a self-speculative drafter (the target with layers
skipped, Draft & Verify) should skip, chosen from measured acceptance and measured cost.

Greedy acceptance of a layer-skip draft needs no decoding to measure: a draft is accepted when
the skipped model's argmax equals the target's on the target's own text, and the drafter's cache
holds the skipped model's own keys, so one teacher-forced forward per skip set gives its
acceptance at every position. The set is a data mask (`forward(keep_layers=)`): one compiled
function scores every candidate.

Search: greedy elimination from the full model. Each round drops the layer whose removal keeps
agreement highest, giving one candidate per size; each candidate's expected speedup comes from
the cost model (`plan`) with the drafter's cost per token = a head plus its kept layers,
interpolated between two measured drafters. Elimination stops once even the cheapest drafter at
the current agreement could not beat the best candidate (agreement only falls as layers go).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.api import generate
from jaxspec.decoding.plan import plan, step_cost
from jaxspec.decoding.runner import encode_prompts
from jaxspec.decoding.sampling import argmax
from jaxspec.drafters.model import layer_skip_drafter
from jaxspec.errors import UserError
from jaxspec.models.cache import init_cache
from jaxspec.models.transformer import forward


@dataclasses.dataclass(frozen=True)
class Candidate:
    skip: tuple[int, ...]
    agreement: float  # teacher-forced top-1 agreement with the target
    c: float  # drafting cost per token, in target steps
    gamma: int  # the draft length of the highest expected speedup
    expected: float  # expected speedup over plain decoding at that gamma


@dataclasses.dataclass(frozen=True)
class Search:
    candidates: list[Candidate]  # the elimination path, by number of skipped layers

    @property
    def best(self) -> Candidate:
        return max(self.candidates, key=lambda c: c.expected)

    def describe(self) -> str:
        rows = [f"skip {len(c.skip):2d} {_layers(c.skip):<24} agreement {c.agreement:.3f} "
                f"c {c.c:.3f} gamma {c.gamma}: expected {c.expected:.3f}x"
                for c in self.candidates]
        b = self.best
        verdict = (f"best: skip {_layers(b.skip)} at gamma {b.gamma} ({b.expected:.3f}x expected)"
                   if b.expected > 1 else
                   f"no skip set pays: the best, {_layers(b.skip)} at gamma {b.gamma}, is expected "
                   f"at {b.expected:.3f}x of plain decoding")
        return "\n".join([*rows, verdict])


def _layers(skip) -> str:
    return ",".join(map(str, skip)) or "-"


def greedy_texts(model, prompts, max_new_tokens: int, **generate_kw):
    """The target's own greedy continuations: token rows [B, L] (padded), and the weight [B, L]
    of each position whose next token is generated (the positions drafts are judged at)."""
    ids = encode_prompts(model, prompts, bool(generate_kw.get("chat")))
    res = generate(model, prompts, max_new_tokens=max_new_tokens, **generate_kw)
    rows = [p + n for p, n in zip(ids, res.token_ids)]
    L = max(len(r) for r in rows)
    tokens_BxL = np.full((len(rows), L), model.config.pad_token_id, np.int32)
    weight_BxL = np.zeros((len(rows), L), np.float32)
    for b, (p, r) in enumerate(zip(ids, rows)):
        tokens_BxL[b, :len(r)] = r
        weight_BxL[b, len(p) - 1:len(r) - 1] = 1
    if not weight_BxL.any():
        raise UserError("the target generated no tokens for these prompts")
    return tokens_BxL, weight_BxL


def agreement_fn(model, tokens_BxL, weight_BxL) -> Callable[[tuple[int, ...]], float]:
    """skip set -> top-1 agreement of the skipped model with the full one on these texts."""
    c, n = model.config, model.config.num_layers
    B, L = tokens_BxL.shape
    pos_BxL = jnp.broadcast_to(jnp.arange(L), (B, L))

    @jax.jit
    def predict(params, tokens_BxL, keep_layers):
        logits_BxLxV, _ = forward(params, c, tokens_BxL, pos_BxL, init_cache(c, B, L),
                                  keep_layers=keep_layers)
        return argmax(logits_BxLxV)

    tokens = jnp.asarray(tokens_BxL)
    ref_BxL = np.asarray(predict(model.params, tokens, jnp.ones(n, bool)))

    def agreement(skip) -> float:
        keep_layers = np.ones(n, bool)
        keep_layers[list(skip)] = False
        hit_BxL = np.asarray(predict(model.params, tokens, jnp.asarray(keep_layers))) == ref_BxL
        return float(np.sum(hit_BxL * weight_BxL) / np.sum(weight_BxL))

    return agreement


def measured_costs(model, model_name: str) -> tuple[dict, float, float]:
    """Verification costs relative to a plain step (the cached `jaxspec profile`), and the
    drafting cost per token of a drafter keeping one layer and of one keeping all of them."""
    from jaxspec.decoding import profile  # profile runs decoding: import when used

    prof = profile.profile(model, model_name)
    step_ms = prof["target_ms"]["1"]
    n = model.config.num_layers
    one = profile.drafter_ms(layer_skip_drafter(model, range(1, n)), model.config)
    full = profile.drafter_ms(layer_skip_drafter(model, ()), model.config)
    return prof["relative_cost"], one / step_ms, full / step_ms


def search(agreement: Callable, num_layers: int, relative_cost: dict, c_one: float,
           c_full: float, gamma_max: int = 4, max_skip: int | None = None) -> Search:
    """Greedy elimination (module docstring); `c_one`/`c_full`: cost per drafted token of a
    drafter keeping one layer / every layer, in target steps."""
    if num_layers < 2:
        raise UserError("layer skipping needs a target of at least 2 layers")
    max_skip = num_layers - 1 if max_skip is None else max_skip
    if not 1 <= max_skip < num_layers:
        raise UserError(f"max_skip must be in [1, {num_layers - 1}], got {max_skip}")
    gammas = range(1, gamma_max + 1)

    def cost(kept: int) -> float:
        return c_one + (kept - 1) * (c_full - c_one) / (num_layers - 1)

    def costs_G1(c: float) -> list[float]:
        return [step_cost(g, relative_cost, c) for g in range(gamma_max + 1)]

    def candidate(skip, a) -> Candidate:
        c = cost(num_layers - len(skip))
        p = plan(a, costs_G1(c), gammas)
        g = max(p.speedups, key=p.speedups.get)
        return Candidate(tuple(sorted(skip)), a, c, g, p.speedups[g])

    skip: tuple[int, ...] = ()
    path = []
    while len(skip) < max_skip:
        scored = [(agreement(skip + (layer,)), layer) for layer in range(num_layers)
                  if layer not in skip]
        a, layer = max(scored)  # ties: the later layer
        skip = skip + (layer,)
        path.append(candidate(skip, a))
        bound = max(plan(a, costs_G1(c_one), gammas).speedups.values())
        if bound < max(c.expected for c in path):
            break
    return Search(path)


def measure(model, skip, gamma: int, prompts, max_new_tokens: int, repeats: int = 2,
            **generate_kw) -> tuple[float, float]:
    """(speedup, tau) of the layer-skip drafter over plain decoding, greedy, one prompt at a
    time; each method's time is the fastest of `repeats` passes, taken in turn."""
    from jaxspec.decoding.api import speculative_generate

    drafter = layer_skip_drafter(model, skip)
    plain = lambda p: generate(model, [p], max_new_tokens=max_new_tokens, **generate_kw)  # noqa
    spec = lambda p: speculative_generate(model, drafter, [p], gamma=gamma,  # noqa
                                          max_new_tokens=max_new_tokens, **generate_kw)
    walls = {plain: [], spec: []}
    steps = tokens = 0
    for fn in walls:  # compile
        fn(prompts[0])
    for _ in range(repeats):
        for fn in walls:
            runs = [fn(p) for p in prompts]
            walls[fn].append(sum(r.wall_time_s for r in runs))
            if fn is spec:
                steps = sum(len(a) for r in runs for a in r.accept_lengths)
                tokens = sum(r.num_new_tokens for r in runs)
    return min(walls[plain]) / min(walls[spec]), tokens / max(steps, 1)


def bench_config(search: Search, measured: tuple[float, float] | None, run: dict) -> str:
    """A `jaxspec bench --config` file for the best skip set against plain decoding; the
    search's figures in its header."""
    import datetime

    import yaml

    b = search.best
    head = [f"Written by `jaxspec tune-layer-skip` on {datetime.date.today()}: greedy elimination "
            f"over {len(search.candidates)} sizes.",
            f"Best: skip {_layers(b.skip)}, gamma {b.gamma}; teacher-forced agreement "
            f"{b.agreement:.3f}, drafter cost {b.c:.3f} target steps per token; expected "
            f"{b.expected:.3f}x."]
    if measured is not None:
        head.append(f"Measured on the search prompts: {measured[0]:.3f}x, tau {measured[1]:.3f}.")
    if b.expected <= 1:
        head.append("No skip set is expected to pay on this machine; bench it to confirm.")
    body = {**run, "gammas": [b.gamma], "methods": ["ar", f"layerskip:{_layers(b.skip)}"]}
    return "".join(f"# {line}\n" for line in head) + yaml.safe_dump(body, sort_keys=False,
                                                                     allow_unicode=True)
