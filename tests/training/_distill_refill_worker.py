"""Subprocess worker for the continuous-batching distillation tests: a real distillation of a
tiny random model, optionally pausing after each shard it writes (so a test can kill it between
shards).

    python _distill_refill_worker.py OUT_DIR [--sleep SECONDS]
"""

import argparse
import time

import jax

from jaxspec.config import ModelConfig
from jaxspec.models.model import Model
from jaxspec.models.params import init_params
from jaxspec.training import data, distill

SENTENCES = ["Hallo.", "Ja.", "Danke schön.", "Wie geht es dir heute?",
             "Ich trinke jeden Morgen einen Kaffee.",
             "Der Zug nach Berlin hat heute leider eine Stunde Verspätung, weil es auf der "
             "Strecke einen Unfall gab.", "Gut.", "Wir sehen uns morgen.", "Das Wetter ist schön.",
             "Nein, danke.", "Kannst du mir helfen?", "Es regnet.",
             "Am Wochenende fahren wir ans Meer."]
PROMPTS = [f"Translate German to English:{s}" for s in SENTENCES]
STOP = "z"  # a byte the model emits early in some responses, late or never in others
KW = dict(temperatures=(0.0, 1.0), max_new_tokens=24, block_size=4, batch_size=3, seed=5,
          stop=STOP)


def tiny_target() -> Model:
    """Peaked (std 0.5) so greedy decoding has no near-ties."""
    config = ModelConfig(arch="llama", vocab_size=264, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64, max_position=256,
                         eos_token_ids=(2,))
    return Model(config, init_params(config, jax.random.key(5), std=0.5), data.byte_tokenizer(),
                 "refill")


def run(out_dir, sleep: float = 0.0, **kw):
    if sleep:
        real = distill.write_atomic

        def slow(path, text):
            real(path, text)
            time.sleep(sleep)
        distill.write_atomic = slow
    return distill.distill(tiny_target(), PROMPTS, out_dir, **{**KW, **kw})


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sleep", type=float, default=0.0)
    args = ap.parse_args()
    run(args.out, args.sleep)
