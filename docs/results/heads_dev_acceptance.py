"""Teacher-forced acceptance by draft position of saved hidden-state heads on a pair's real dev
sentences (the target's greedy translations, prompted as `jaxspec bench --config
configs/bench/<pair>_dev.yaml` prompts them), and the expected tokens a step of a greedy chain
of 1-4 drafts (docs/results/heads_data.md).
`python docs/results/heads_dev_acceptance.py --pair deen HEAD [HEAD ...]` (2026-12-07)."""
import argparse, json
import numpy as np, yaml
import jaxspec
from jaxspec.decoding import plan
from jaxspec.training import heads

SEQ_LEN = 128  # the recipes' train.seq_len


def dev_rows(target, pair: str, lo: int, hi: int):
    """Rows (tokens, mask, the target's features) of dev questions [lo, hi): each the prompt
    and the target's greedy translation (64 tokens at most, stop at a newline)."""
    b = yaml.safe_load(open(f"configs/bench/{pair}_dev.yaml"))
    qs = [json.loads(line)["turns"][0] for line in open(b["questions"])][lo:hi]
    prompts = [b["template"].format(prompt=q) for q in qs]
    res = jaxspec.generate(target, prompts, max_new_tokens=64, stop="\n")
    ids = [target.tokenizer.encode(p) for p in prompts]
    rows = [(i + r, [0] * len(i) + [1] * len(r)) for i, r in zip(ids, res.token_ids)]
    tok, mask = heads.example_rows(rows, SEQ_LEN, target.config.pad_token_id)
    return tok, mask, heads.target_features(target, tok, "runs/heads_curve/devfeats",
                                            heads.row_lengths(mask))


def acceptance(drafter, rows) -> list[float]:
    tok, mask, feats = rows
    h, c = heads.agreement(drafter.spec, drafter.params, np.asarray(feats), tok, mask, 4)
    return [round(float(x), 3) for x in h / np.maximum(c, 1)]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--pair", default="deen")
    a = ap.parse_args()
    target = jaxspec.load("gemma3-270m", dtype="bfloat16")
    n = sum(1 for _ in open(yaml.safe_load(open(f"configs/bench/{a.pair}_dev.yaml"))["questions"]))
    sets = {f"dev{lo + 1}-{min(hi, n)}": dev_rows(target, a.pair, lo, hi)
            for lo, hi in ((0, 40), (40, 79)) if lo < n}
    for path in a.heads:
        drafter = jaxspec.load_drafter(path, target=target)
        for name, rows in sets.items():
            acc = acceptance(drafter, rows)
            print(json.dumps({"head": path, "set": name, "accept": acc,
                              "chain_tokens": [round(plan.expected_tokens(acc, g), 3)
                                               for g in range(1, len(acc) + 1)]}), flush=True)
