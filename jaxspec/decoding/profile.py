"""`jaxspec profile`: what a target call over S new positions costs next to one position, what
a drafter costs per drafted token, how close a step comes to the memory roofline, and what a
whole decode-loop step drafting gamma tokens costs next to a plain one (`step_costs`).

Results are cached per (model and its config, dtype, drafter, machine) under
`$JAXSPEC_CACHE/profile/`, so planners (adaptive gamma) read them without measuring again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import runner
from jaxspec.decoding.plan import per_position_acceptance, plan
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.speculative import cache_dtype, reads_features
from jaxspec.decoding.trees import chain
from jaxspec.drafters.base import DraftInput
from jaxspec.errors import UserError
from jaxspec.files import cache_dir, warn_rebuild, write_atomic
from jaxspec.models.cache import init_cache, storage_dtype
from jaxspec.models.transformer import forward

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)


def _best_of(fn, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls, after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """Memory read bandwidth (GB/s) of a jitted sum over `gib` GiB of float32."""
    x = jnp.ones((int(gib * 2**28),), jnp.float32)
    total = jax.jit(jnp.sum)
    seconds = _best_of(lambda: total(x), repeats)
    del x
    return gib * 2**30 / seconds / 1e9


def step_bytes(model, cache_len: int) -> int:
    """Bytes a decode step must read: every weight once, plus the keys/values of the cache."""
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    c = model.config
    item = storage_dtype(cache_dtype(model.params)).itemsize
    return weights + 2 * c.num_layers * cache_len * c.num_kv_heads * c.head_dim * item


def target_ms(model, sizes=SIZES, cache_len: int = 256, repeats: int = 10) -> dict[int, float]:
    """Milliseconds of one target forward over S new positions (batch 1), for each S."""
    c = model.config
    fwd = jax.jit(lambda p, t, pos, cache: forward(p, c, t, pos, cache)[0])
    cache = init_cache(c, 1, cache_len, cache_dtype(model.params))
    out = {}
    for S in sizes:
        tokens = jnp.ones((1, S), jnp.int32)
        positions = jnp.arange(S)[None] + cache_len // 2
        out[S] = 1e3 * _best_of(lambda: fwd(model.params, tokens, positions, cache), repeats)
    return out


def drafter_ms(drafter, config, gamma: int = 1, cache_len: int = 256,
               repeats: int = 10) -> float:
    """Milliseconds per drafted token: one greedy `propose` of `gamma` tokens for a target with
    `config`, divided by gamma (one by default: a call's fixed part, EAGLE's refeed of its last
    16 positions, is paid by every drafting step). A call timed alone costs less than in the
    decode loop (`loop_ms`), so gamma "auto" plans from the loop."""
    spec = drafter.spec
    tokens = jnp.ones((1, cache_len), jnp.int32)
    lengths = jnp.array([cache_len // 2], jnp.int32)
    feats = jnp.zeros((1, cache_len, config.hidden_size if reads_features(drafter) else 0))
    inp = DraftInput(tokens, lengths, feats, config.vocab_size, init_cache(config, 1, cache_len))
    state = jax.jit(spec.init)(drafter.params, inp)
    propose = jax.jit(lambda p, s, i, k: spec.propose(p, s, i, k, Sampling(),
                                                      chain(gamma)).tokens_BxN)
    key = jax.random.key(0)
    ms = 1e3 * _best_of(lambda: propose(drafter.params, state, inp, key), repeats)
    return ms / gamma


def loop_ms(target, drafter, G: int, tokens: int = 6, rounds: int = 3) -> list[float]:
    """Milliseconds per decode-loop step drafting g tokens, g = 0..G, greedy, batch 1: a plain
    step (g = 0, `generate`), and steps of the very loop gamma="auto" with drafts of up to G then
    runs (one compiled function: the step costs are its data), each length forced by costs that
    make every other length hopeless; lengths 1, 2 and G are timed (the line below gives the
    others). A sample is the slope of wall time against steps between a one-token and a
    `tokens` output of one prompt, taken back to back (a slope the timer cannot resolve, as a
    tiny model's, is taken again over longer outputs, then from the whole longer call). On a
    small shared machine the speed drifts by 10% over seconds, so a round of drafting samples
    lies between two plain ones, each drafting sample is divided by the plain step interpolated
    to its place in the round, and the costs come from those ratios: the plain step is the
    median of its samples, and a drafting step that times the least squares line a + b * g
    through each length's median ratio (drafting costs a fixed part and a part per drafted
    token), its slope no less than what one more draft costs the drafter alone (`step_line`)."""
    prompt = [[2 + i % 11 for i in range(16)]]

    def call(g: int, n: int):
        kw = dict(max_new_tokens=n, sampling=Sampling(), seed=0, stop=None, chat=False)
        if g == 0:
            return runner.DECODER(target, None, prompt, gamma=0, **kw)
        forced_G1 = np.full(G + 1, 1e6, np.float32)
        forced_G1[g] = 1.0
        return runner.DECODER(target, drafter, prompt, gamma="auto", gamma_max=G,
                              costs=forced_G1, remember=False, **kw)

    def sample(g: int) -> float:
        n = tokens
        for _ in range(3):  # a step below the timer's noise (a tiny model): longer outputs
            short, long = call(g, 1), call(g, n)
            steps = len(long.accept_lengths[0]) - len(short.accept_lengths[0])
            if long.wall_time_s > short.wall_time_s and steps > 0:
                return 1e3 * (long.wall_time_s - short.wall_time_s) / steps
            n *= 2
        return 1e3 * long.wall_time_s / len(long.accept_lengths[0])  # the whole call, per step

    call(0, 1), call(1, 1)  # an executable's first run is slow: not a sample
    lengths = sorted({1, 2, G} & set(range(1, G + 1)))
    plain, ratios = [sample(0)], {g: [] for g in lengths}
    for _ in range(rounds):
        drafting = [sample(g) for g in lengths]
        plain.append(sample(0))
        for i, (g, step_ms) in enumerate(zip(lengths, drafting)):  # against the plain step's
            w = (i + 1) / (len(lengths) + 1)                      # drift over the round
            ratios[g].append(step_ms / ((1 - w) * plain[-2] + w * plain[-1]))
    ms = float(np.median(plain))
    floor = max(2 * drafter_ms(drafter, target.config, 2) - drafter_ms(drafter, target.config), 0)
    return [ms] + [ms * c for c in step_line(lengths, [np.median(r) for r in ratios.values()],
                                             floor / ms, G)]


def step_line(lengths, medians, floor: float, G: int) -> list[float]:
    """Step costs of drafts 1..G on the least squares line a + b * g through each timed
    length's median cost, its slope at least `floor` (what one more draft costs the drafter
    alone, in plain steps): a noisy round can tilt the free line flat or downward."""
    b = float(np.polyfit(lengths, medians, 1)[0]) if len(lengths) > 1 else floor
    b = max(b, floor)
    a = float(np.mean(medians)) - b * float(np.mean(lengths))
    return [a + b * g for g in range(1, G + 1)]


def machine_id() -> str:
    """Processor, core count and backend: the profile of one machine does not hold on another."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        names = [l for l in open("/proc/cpuinfo") if l.startswith("model name")]
        cpu = names[0].split(":", 1)[1].strip() if names else cpu
    devices = jax.devices()
    return f"{cpu}|{os.cpu_count()} cores|{devices[0].device_kind} x{len(devices)}|jax {jax.__version__}"


_FORMAT = 5  # bump when a measurement changes meaning (or the step it times changes speed)


def _cache_path(model, model_name: str, dtype: str, drafter: str | None, what: str = "profile"):
    key = hashlib.sha256(f"{model_name}|{model.config!r}|{dtype}|{drafter}|{machine_id()}"
                         .encode()).hexdigest()
    return cache_dir("profile", _FORMAT) / f"{what}-{key[:16]}.json"


def _read(path, need: str) -> dict | None:
    """A cached result holding `need`, or None (a damaged file is removed with a warning)."""
    if not path.exists():
        return None
    try:
        result = json.loads(path.read_text())
        result[need]
        return result
    except (OSError, ValueError, KeyError, TypeError) as err:
        warn_rebuild("a cached profile", path, err)
        path.unlink(missing_ok=True)
        return None


def profile(model, model_name: str, drafter=None, drafter_name: str | None = None,
            refresh: bool = False, cache_len: int = 256) -> dict:
    """Measure (or read from the cache) the cost curve of `model` and the cost of `drafter`."""
    dtype = str(jax.tree.leaves(model.params)[0].dtype)
    path = _cache_path(model, model_name, dtype, drafter_name)
    cached = None if refresh else _read(path, "target_ms")
    if cached is not None:
        return cached
    ms = target_ms(model, cache_len=cache_len)
    bw = bandwidth_gbs()
    nbytes = step_bytes(model, cache_len)
    result = {
        "model": model_name, "dtype": dtype, "machine": machine_id(), "cache_len": cache_len,
        "target_ms": {str(s): round(t, 4) for s, t in ms.items()},
        "relative_cost": {str(s): round(t / ms[1], 3) for s, t in ms.items()},
        "bytes_per_step": nbytes, "bandwidth_gbs": round(bw, 2),
        "roofline_fraction": round(nbytes / (ms[1] / 1e3) / (bw * 1e9), 3),
    }
    if drafter is not None:
        d_ms = drafter_ms(drafter, model.config, cache_len=cache_len)
        result.update(drafter=drafter_name, drafter_ms_per_token=round(d_ms, 4),
                      c=round(d_ms / ms[1], 4))
    _write(path, result)
    return result


def _write(path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(result, indent=1))


def step_costs(model, model_name: str, drafter, drafter_name: str, gamma_max: int) -> list[float]:
    """The cost of a decode-loop step drafting 0..gamma_max tokens, in plain steps of that loop,
    measured (`loop_ms`) and cached per machine; a longer draft is taken to cost at least what a
    shorter one does. The loop costs more than its parts (Gemma 3 bfloat16 with an EAGLE head:
    a gamma-1 step about 1.08 plain steps, each further draft about +0.05 to +0.09, where the
    profile's verify and one-token drafter costs predicted +0.04 to +0.06), and planned from the
    parts, gamma "auto" drafted too long."""
    dtype = str(jax.tree.leaves(model.params)[0].dtype)
    path = _cache_path(model, model_name, dtype, f"{drafter_name}|{gamma_max}", "loop")
    result = _read(path, "loop_ms")
    if result is None or len(result["loop_ms"]) != gamma_max + 1:
        t0 = time.perf_counter()
        ms = loop_ms(model, drafter, gamma_max)
        result = {"model": model_name, "dtype": dtype, "drafter": drafter_name,
                  "machine": machine_id(), "loop_ms": [float(f"{t:.4g}") for t in ms],
                  "seconds": round(time.perf_counter() - t0, 1)}
        _write(path, result)
    ms = result["loop_ms"]
    return list(np.maximum.accumulate([t / ms[0] for t in ms]))


def format_profile(r: dict) -> str:
    lines = [f"{r['model']} ({r['dtype']}), {r['machine']}",
             "S        " + " ".join(f"{s:>7}" for s in r["target_ms"]),
             "ms       " + " ".join(f"{t:7.1f}" for t in r["target_ms"].values()),
             "c(S)/c(1)" + " ".join(f"{t:7.2f}" for t in r["relative_cost"].values()),
             f"a step reads {r['bytes_per_step'] / 1e6:.0f} MB; measured bandwidth "
             f"{r['bandwidth_gbs']:.1f} GB/s; one-position step at "
             f"{100 * r['roofline_fraction']:.0f}% of that roofline"]
    if "c" in r:
        lines.append(f"drafter {r['drafter']}: {r['drafter_ms_per_token']:.2f} ms per drafted "
                     f"token, c = {r['c']:.3f} of a target step")
    if "step_costs" in r:
        lines.append("decode-loop step cost by gamma, in plain steps: " + ", ".join(
            f"{g}: {c:.3f}" for g, c in enumerate(r["step_costs"])))
    return "\n".join(lines)


def plan_drafter(target, target_name: str, drafter, drafter_name: str, prompts,
                 gamma_max: int = 8, max_new_tokens: int = 64, stop=None, chat: bool = False,
                 images=None):
    """`Plan` for `drafter` on `target`: acceptance measured on `prompts` (with `images`, one
    entry per prompt, for a vision-language target) at draft length `gamma_max`, step costs
    measured in the decode loop (cached)."""
    if not 1 <= gamma_max < SIZES[-1]:
        raise UserError(f"gamma_max must be in [1, {SIZES[-1] - 1}], got {gamma_max}")
    costs_G1 = step_costs(target, target_name, drafter, drafter_name, gamma_max)
    r = runner.DECODER(target, drafter, prompts, gamma=gamma_max, max_new_tokens=max_new_tokens,
                       sampling=Sampling(), seed=0, stop=stop, chat=chat, images=images)
    accept_G = per_position_acceptance(r.accept_lengths, gamma_max)
    return plan(accept_G, costs_G1, range(gamma_max + 1))
