"""Subprocess worker for the hidden-state head tests: a tiny deterministic head training run.

    python _heads_worker.py OUT_DIR [--kind eagle] [--mesh d,f,t ...] [--steps N]
        [--save-every K] [--step-sleep S] [--compile-cache DIR]

For each mesh (on the first d*f*t devices) it trains a `kind` head of a tiny random target on
rows with a simple pattern, in `OUT_DIR/<d>x<f>x<t>/` (resuming from any checkpoint there), and
writes the logged losses and the final head params to `OUT_DIR/<dxfxt>.npz`.
Tests import it too, to compute the same run in-process.
"""

import argparse
import functools
import json
import math
import time
from pathlib import Path

import jax
import numpy as np

from jaxspec import sharding
from jaxspec.config import ModelConfig
from jaxspec.drafters import hidden
from jaxspec.models.model import Model
from jaxspec.models.params import draw_in_major, param_shapes
from jaxspec.training import data, heads, trainer

TINY = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, intermediate_size=64, max_position=512)
DEPTH = 2
OPTIONS = {"streams": {"top": 1}}  # the kinds' own settings


def np_init(config: ModelConfig, seed: int, std: float = 0.5) -> dict:
    """Random params drawn by numpy (XLA's random kernels take seconds to compile on CPU),
    matrices in the [in, out] layout of old and turned, as `init_params` does: a seed gives
    the model it gave then."""
    rng = np.random.default_rng(seed)

    def draw(path, shape):
        name = path[-1].key
        if name.endswith("norm"):
            return np.ones(shape, np.float32)
        return draw_in_major(name, shape, lambda s: rng.normal(0, std, s).astype(np.float32))

    return jax.tree.map_with_path(draw, param_shapes(config),
                                  is_leaf=lambda x: isinstance(x, tuple))


@functools.cache
def tiny_target(seed: int = 0) -> Model:
    return Model(TINY, np_init(TINY, seed), None, "tiny")


def pattern_rows(n: int = 32, length: int = 25, seed: int = 0):
    """Rows counting up from a random start by a row's own step (1..3) through ids 3..63;
    the first two tokens of each row are not loss targets."""
    rng = np.random.default_rng(seed)
    start, step = rng.integers(0, 61, n), rng.integers(1, 4, n)
    tokens = (3 + (start[:, None] + step[:, None] * np.arange(length)) % 61).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[:, :2] = 0
    return tokens, mask


class SlowBatches(data.Batches):
    """Batches that take `sleep` seconds each, so a test can kill a run mid-way."""

    def __init__(self, *args, sleep: float = 0.0, **kw):
        super().__init__(*args, **kw)
        self.sleep = sleep

    def next(self):
        time.sleep(self.sleep)
        return super().next()


def settings(**kw) -> trainer.TrainSettings:
    base = dict(steps=3, batch_size=16, seq_len=24, grad_accum=2, lr=1e-2, warmup_steps=1,
                log_every=1, save_every=100)
    return trainer.TrainSettings(**{**base, **kw})


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree.flatten_with_path(tree)[0]}


@functools.cache
def _initial_head(kind: str) -> dict:
    return jax.device_get(hidden.head_params(kind, TINY, DEPTH, jax.random.key(1),
                                             tiny_target().params))


def initial_head(kind: str = "eagle") -> dict:
    """The head params a run starts from, as {path: array}."""
    return _flat(_initial_head(kind))


def run(workdir, kind: str = "eagle", dims=(1, 1, 1), step_sleep: float = 0.0, **kw) -> dict:
    """Train; {"losses": logged losses, "params": {path: array}}."""
    workdir = Path(workdir)
    target = tiny_target()
    tokens, mask = pattern_rows()
    spec = hidden.hidden_spec(kind, TINY, DEPTH, options=OPTIONS.get(kind))
    feats = heads.target_features(target, tokens, workdir.parent / f"{workdir.name}-features",
                                  feature_layer=spec.feature_layer)
    s = settings(mesh=tuple(dims), **kw)
    mesh = sharding.make_mesh(*dims, devices=jax.devices()[:math.prod(dims)])
    vocab_ids = np.arange(TINY.vocab_size, dtype=np.int32)
    head = _initial_head(kind)
    batches = SlowBatches(tokens, mask, s.batch_size, seed=0, sleep=step_sleep, features=feats)
    out = trainer.train(
        s, TINY, head, batches, workdir, mesh=mesh,
        loss=heads.head_loss(spec, trainer.head_index(vocab_ids, TINY.vocab_size)),
        frozen=spec.shared(target.params, vocab_ids),
        param_shardings=jax.tree.map(lambda _: sharding.replicated(mesh), head))
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {"losses": np.asarray([json.loads(ln)["loss"] for ln in lines if '"loss"' in ln]),
            "params": _flat(trainer.host_params(out))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--kind", default="eagle")
    ap.add_argument("--mesh", nargs="+", default=["1,1,1"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--compile-cache", default="", help="a persistent compilation cache shared "
                    "by the runs of one test (a resumed run skips compiling)")
    args = ap.parse_args()
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    for mesh_arg in args.mesh:
        dims = tuple(int(x) for x in mesh_arg.split(","))
        name = "x".join(map(str, dims))
        r = run(Path(args.out) / name, args.kind, dims, args.step_sleep, steps=args.steps,
                save_every=args.save_every)
        np.savez(Path(args.out) / f"{name}.npz", losses=r["losses"], **r["params"])


if __name__ == "__main__":
    main()
