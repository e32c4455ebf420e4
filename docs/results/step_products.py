"""XLA op time a decode-loop step, grouped by each fusion's output shape (so the output head's
[262144, 3] product, the body's [2048, 3] ... and a head's [8192, 3] stand apart): plain (the
lower of two traces) and a head at gamma 1 / 2, 4 de->en dev sentences of 48 tokens
(docs/results/heads_data.md): `python docs/results/step_products.py [HEAD]` (2026-12-07)."""
import collections
import glob
import json
import re
import sys
import tempfile

import jax
import yaml

import jaxspec
from jaxspec.decoding import runner

template = yaml.safe_load(open("configs/bench/deen_dev.yaml"))["template"]
questions = [json.loads(line)["turns"][0].split(":", 1)[1]
             for line in open("../shared/data/specbench/deen_question.jsonl")][:4]
prompts = [template.format(prompt=q) for q in questions]
target = jaxspec.load("gemma3-270m", dtype="bfloat16")
head = jaxspec.load_drafter(sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m-deen-drafter",
                            target=target)
INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) fusion\(")
MODULE = re.compile(r"^HloModule (\S+?),")


def run(g: int, n: int):
    if g == 0:
        return [jaxspec.generate(target, [p], max_new_tokens=n) for p in prompts]
    return [jaxspec.speculative_generate(target, head, [p], gamma=g, max_new_tokens=n)
            for p in prompts]


def shapes() -> dict[tuple[str, str], str]:
    """(module, fusion) -> its output shape, over the compiled decode loops."""
    out = {}
    for text in runner.DECODER.hlo_texts():
        module = ""
        for line in text.splitlines():
            if m := MODULE.match(line):
                module = m.group(1)
            elif m := INSTR.match(line):
                out[(module, m.group(1))] = m.group(2)
    return out


def per_step(g: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            results = run(g, 48)
        data = jax.profiler.ProfileData.from_file(
            glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    where = shapes()
    steps = sum(len(r.accept_lengths[0]) if g else r.num_new_tokens for r in results)
    ms = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats:
                    kind = re.sub(r"\.\d+$", "", stats["hlo_op"])
                    shape = where.get((stats.get("hlo_module", ""), stats["hlo_op"]), "")
                    ms[f"{kind} {shape}".strip()] += event.duration_ns / 1e6 / steps
    return ms


for g in (0, 1, 2):  # compile
    run(g, 1), run(g, 48)
first, second = per_step(0), per_step(0)
plain = {k: min(first.get(k, 0), second.get(k, 0)) for k in first.keys() | second.keys()}
by_gamma = [plain, per_step(1), per_step(2)]
print("ms of ops a step (summed over threads): "
      + " / ".join(f"{sum(m.values()):.1f}" for m in by_gamma) + "  (plain / gamma 1 / gamma 2)")
for k in sorted(set().union(*by_gamma), key=lambda k: -max(m.get(k, 0) for m in by_gamma))[:20]:
    print("  ".join(f"{m.get(k, 0):7.2f}" for m in by_gamma) + f"  {k}")
