"""Wall ms per decode-loop step, plain and a head at gamma 1 / 2 (6 de->en dev sentences, 64
tokens each without a stop, prefill subtracted, two rounds), and the XLA op groups a gamma-2
step adds over a plain one, and each step's op time by output shape (products told apart)
(docs/results/heads_data.md):
`python docs/results/loop_step_cost.py [HEAD]` (2026-12-07)."""
import collections
import json
import sys
import time

import yaml

import jaxspec
from jaxspec.bench import op_profile
from jaxspec.decoding import runner

template = yaml.safe_load(open("configs/bench/deen_dev.yaml"))["template"]
questions = [json.loads(line)["turns"][0].split(":", 1)[1]
             for line in open("../shared/data/specbench/deen_question.jsonl")][:6]
prompts = [template.format(prompt=q) for q in questions]
target = jaxspec.load("gemma3-270m", dtype="bfloat16")
head = jaxspec.load_drafter(sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m-deen-drafter",
                            target=target)


def run(g: int, n: int):
    if g == 0:
        return [jaxspec.generate(target, [p], max_new_tokens=n) for p in prompts]
    return [jaxspec.speculative_generate(target, head, [p], gamma=g, max_new_tokens=n)
            for p in prompts]


def steps(g: int, results) -> int:
    return sum(len(r.accept_lengths[0]) if g else r.num_new_tokens for r in results)


for g in (0, 1, 2):  # compile
    run(g, 1), run(g, 64)
ms = collections.defaultdict(list)
for _ in range(2):
    for g in (0, 1, 2):
        t0 = time.perf_counter()
        run(g, 1)
        t1 = time.perf_counter()
        results = run(g, 64)
        t2 = time.perf_counter()
        decode_steps = steps(g, results) - (0 if g else len(prompts))  # plain: first token
        ms[g].append(1e3 * ((t2 - t1) - (t1 - t0)) / decode_steps)     # came with prefill
        tau = sum(r.num_new_tokens for r in results) / steps(g, results)
        print(f"gamma {g}: {ms[g][-1]:.1f} ms a step, tau {tau:.2f}", flush=True)
print("step cost in plain steps:",
      {g: round(sum(v) / sum(ms[0]), 3) for g, v in ms.items()})

groups, shapes = {}, {}
for g in (0, 0, 1, 2):  # plain twice: the lower of its two traces
    out = {}
    r = op_profile.trace(lambda: out.setdefault("r", run(g, 64)), runner.DECODER.hlo_texts)
    n = steps(g, out["r"])
    for into, key in ((groups, "groups_ms"), (shapes, "shapes_ms")):
        ms = {k: v / n for k, v in r[key].items()}
        into[g] = {k: min(v, into[g].get(k, v)) for k, v in ms.items()} if g in into else ms
    print(f"gamma {g}: XLA ops {r['op_ms'] / n:.2f} ms a step, products "
          f"{100 * r['product_share']:.0f}%")
added = {k: groups[2].get(k, 0) - groups[0].get(k, 0) for k in groups[0].keys() | groups[2]}
for k, v in sorted(added.items(), key=lambda kv: -abs(kv[1]))[:15]:
    print(f"{v:8.2f} ms a step  {k}")
print("ms a step by output shape (summed over threads), plain / gamma 1 / gamma 2:")
for k in sorted(set().union(*shapes.values()), key=lambda k: -shapes[2].get(k, 0))[:16]:
    print("  ".join(f"{shapes[g].get(k, 0):7.2f}" for g in (0, 1, 2)) + f"  {k}")
