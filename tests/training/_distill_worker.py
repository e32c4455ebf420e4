"""Subprocess worker for the distillation tests: a distillation with a deterministic fake
generate function (optionally slow, so a test can kill the job mid-way).

    python _distill_worker.py OUT_DIR [--sleep SECONDS]
"""

import argparse
import time

from jaxspec.config import ModelConfig
from jaxspec.models.model import Model
from jaxspec.training import data, distill

PROMPTS = [f"Translate German to English:Satz Nummer {i}." for i in range(20)]


class Result:
    def __init__(self, token_ids, texts):
        self.token_ids, self.texts = token_ids, texts


def fake_generate(model, prompts, max_new_tokens, temperature, seed, sleep=0.0, **kw):
    """Responses that depend only on (prompt ids, temperature, seed)."""
    time.sleep(sleep)
    out = []
    for ids in prompts:
        h = sum(ids) * 31 + int(temperature * 100) * 7 + seed
        out.append([3 + (h + j * 13) % 250 for j in range(1 + h % max_new_tokens)])
    return Result(out, [model.tokenizer.decode(t) for t in out])


def tiny_target() -> Model:
    config = ModelConfig(arch="llama", vocab_size=264, hidden_size=16, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8, intermediate_size=32)
    return Model(config, {}, data.byte_tokenizer())


def run(out_dir, sleep: float = 0.0):
    return distill.distill(
        tiny_target(), PROMPTS, out_dir, temperatures=(0.0, 0.7), max_new_tokens=6,
        block_size=4, batch_size=2, seed=11,
        generate_fn=lambda *a, **kw: fake_generate(*a, sleep=sleep, **kw))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sleep", type=float, default=0.0)
    args = ap.parse_args()
    run(args.out, args.sleep)
