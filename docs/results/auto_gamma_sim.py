"""Replay recorded accept lengths under gamma="auto"'s policy and the measured step costs: the
modelled speedup of auto against each fixed gamma, with nothing else on the machine to blur it.

    python docs/results/auto_gamma_sim.py --record gemma3-270m-deen-drafter trace.json  # 79 q
    python docs/results/auto_gamma_sim.py trace.json --costs 1,1.076,1.133,1.183,1.276

A trace holds, per question, the drafts accepted at each step of greedy decoding with gamma
4; a step drafting g < 4 at the same point accepts min(n, g) of them. Replayed steps are taken
in the row's order but not aligned to text positions (a shorter step shifts the text).
"""

import argparse
import json

import numpy as np

from jaxspec.decoding import plan, speculative


def record(drafter_name: str, path: str, config: str = "configs/bench/deen_auto.yaml") -> None:
    """Accept lengths at gamma 4 on a bench config's questions, target, precision and template."""
    import jaxspec
    from jaxspec.questions import read_questions
    from jaxspec.config import load_yaml

    cfg = load_yaml(config, ["limit=79"])
    questions = read_questions(cfg["questions"])[:cfg["limit"]]
    target = jaxspec.load(cfg["target"], dtype=cfg["dtype"])
    drafter = jaxspec.load_drafter(drafter_name, target=target)
    traces = [[a - 1 for a in jaxspec.speculative_generate(
        target, drafter, [cfg["template"].format(prompt=q["turns"][0])], gamma=4,
        max_new_tokens=cfg["max_new_tokens"], stop=cfg["stop"]).accept_lengths[0]]
        for q in questions]
    with open(path, "w") as f:
        json.dump(traces, f)


def replay(traces, costs_G1, gamma: int | None = None) -> float:
    """Tokens per plain step's time over all rows: fixed `gamma`, or auto (None)."""
    G = len(costs_G1) - 1
    j_G = np.arange(1, G + 1)
    tokens = time = 0.0
    memory = plan.AcceptanceMemory()  # what the runner keeps between calls (questions)
    for trace in traces:
        need, got, i = sum(n + 1 for n in trace), 0, 0
        acc_1xG, tried_1xG = (x[None] for x in memory.prior("trace", G))
        gained, drafted = [], []
        while got < need:
            g = gamma if gamma is not None else int(plan.choose_gamma(
                acc_1xG, tried_1xG, np.asarray(costs_G1))[0])
            n = min(trace[i % len(trace)], g)
            i, got = i + 1, got + n + 1
            time += costs_G1[g]
            acc_1xG = speculative._MEMORY * acc_1xG + (j_G <= n)
            tried_1xG = speculative._MEMORY * tried_1xG + (j_G <= min(n + 1, g))
            gained.append(n + 1), drafted.append(g)
        memory.update("trace", [gained], [drafted], G)
        tokens += got
    return tokens / time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--record", metavar="DRAFTER", help="record the trace first")
    ap.add_argument("--costs", default="1,1.076,1.133,1.183,1.276")
    args = ap.parse_args()
    if args.record:
        record(args.record, args.trace)
    with open(args.trace) as f:
        traces = json.load(f)
    costs = [float(c) for c in args.costs.split(",")]
    fixed = {g: replay(traces, costs, g) for g in range(len(costs))}
    auto = replay(traces, costs)
    print("fixed gamma:", " ".join(f"{g}: {s:.3f}x" for g, s in fixed.items()))
    print(f"auto: {auto:.3f}x = {auto / max(fixed.values()):.3f} of the best fixed gamma")


if __name__ == "__main__":
    main()
