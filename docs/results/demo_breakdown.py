"""`jaxspec demo`, timed by part: where a newcomer's first run goes.

    JAXSPEC_CACHE=$(mktemp -d) python docs/results/demo_breakdown.py   # cold
    python docs/results/demo_breakdown.py --json runs/demo-cold-1.json   # add to the table

Wall time of loading the target (GGUF conversion or the cache), compiling the decode loops,
measuring gamma auto's step costs (compiles excluded), and in all; each sentence's speedup, tau
and draft lengths, so repeated runs can be compared.
"""

import argparse
import json
import resource
import sys
import time
from collections import defaultdict

from jaxspec import demo, loading
from jaxspec.decoding import profile, runner

spent = defaultdict(float)


def timed(owner, name, part):
    """Add the time of `owner.name` to `part`, less the compiling done inside it."""
    real = getattr(owner, name)

    def wrapper(*a, **k):
        t0, compiled = time.perf_counter(), spent["compile"]
        try:
            return real(*a, **k)
        finally:
            inner = spent["compile"] - compiled if part != "compile" else 0.0
            spent[part] += time.perf_counter() - t0 - inner
    setattr(owner, name, wrapper)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    timed(loading, "_convert_gguf", "load")
    timed(runner.Decoder, "_executable", "compile")
    timed(profile, "loop_ms", "profile")
    rows = demo.run()
    total = time.perf_counter() - t0
    out = {"wall_s": round(total, 1), **{k: round(v, 1) for k, v in spent.items()},
           "compiles": runner.DECODER.compiles,
           "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
           "sentences": [{"language": r["language"], "speedup": round(
               r["tokens_per_s"] / r["baseline_tokens_per_s"], 3), "tau": round(r["tau"], 3),
               "identical": r["identical"], "draft_lengths": r["draft_lengths"]} for r in rows]}
    print(json.dumps(out, indent=1), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
