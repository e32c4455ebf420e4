"""Subprocess worker for the training tests: a tiny deterministic training run.

    python _worker.py OUT_DIR [--mesh d,f,t ...] [--steps N] [--loss ce|kl|tvdpp]
        [--save-every K] [--step-sleep S] [--distributed PORT,NUM,PID]

For each mesh (on the first d*f*t devices) it trains the same drafter on the same data in
`OUT_DIR/<d>x<f>x<t>/` (resuming from any checkpoint there) and writes the logged losses, the
final params and (with --distributed) each process's loss of the final params on one batch to
`OUT_DIR/<dxfxt>-p<process>.npz`.
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
from jaxspec.models.model import Model
from jaxspec.models.params import param_shapes
from jaxspec.training import data, trainer

TINY = ModelConfig(arch="llama", vocab_size=264, hidden_size=64, num_layers=2, num_heads=8,
                   num_kv_heads=4, head_dim=8, intermediate_size=128, max_position=256,
                   eos_token_ids=(2,))


def np_init(config: ModelConfig, seed: int) -> dict:
    """Random params drawn by numpy (XLA's random kernels take seconds to compile on CPU)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map_with_path(
        lambda path, shape: np.ones(shape, np.float32) if path[-1].key.endswith("norm")
        else rng.normal(0, 0.02, shape).astype(np.float32),
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))


@functools.cache
def tiny_setup(seed: int = 0):
    """(teacher Model, drafter config, drafter host params, packed tokens, mask)."""
    teacher = Model(TINY, np_init(TINY, seed))
    drafter_cfg = TINY.replace(num_layers=1)
    drafter = np_init(drafter_cfg, seed + 1)
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(64):
        n_prompt, n_resp = int(rng.integers(3, 12)), int(rng.integers(3, 20))
        ids = rng.integers(3, 264, size=n_prompt + n_resp).tolist()
        examples.append((ids, [0] * n_prompt + [1] * n_resp))
    tokens, mask = data.pack(examples, 32, 0)
    return teacher, drafter_cfg, drafter, tokens, mask


class SlowBatches(data.Batches):
    """Batches that take `sleep` seconds each, so a test can kill a run mid-way."""

    def __init__(self, *args, sleep: float = 0.0, **kw):
        super().__init__(*args, **kw)
        self.sleep = sleep

    def next(self):
        time.sleep(self.sleep)
        return super().next()


def settings(**kw) -> trainer.TrainSettings:
    base = dict(steps=3, batch_size=16, seq_len=32, grad_accum=2, loss="kl", lr=1e-2,
                warmup_steps=1, log_every=1, save_every=100)
    return trainer.TrainSettings(**{**base, **kw})


def final_loss(s, cfg, teacher, params, tokens, mask, mesh) -> np.ndarray:
    """This process's copy of the (replicated) loss of `params` on the first batch."""
    p_sh, t_sh = sharding.param_shardings(cfg, mesh), sharding.param_shardings(TINY, mesh)
    row_sh = sharding.batch_sharding(mesh)
    loss_fn = jax.jit(trainer.make_loss(cfg, s, TINY, None), in_shardings=(
        p_sh, t_sh, row_sh, row_sh), out_shardings=sharding.replicated(mesh))
    rows = data.Batches(tokens, mask, s.micro_batch, seed=0).next()
    loss, _ = loss_fn(params, jax.tree.map(sharding.global_array, teacher.params, t_sh),
                      *(sharding.global_array(rows[k], row_sh) for k in ("tokens", "mask")))
    return np.asarray(loss.addressable_data(0))


def run(workdir, dims=(1, 1, 1), step_sleep: float = 0.0, with_final_loss: bool = False,
        **kw) -> dict:
    """Train; {"losses": logged losses (process 0), "params": {path: array}} and, if asked,
    "final_loss": the loss of the final params on the first batch."""
    teacher, cfg, params, tokens, mask = tiny_setup()
    s = settings(mesh=tuple(dims), **kw)
    mesh = sharding.make_mesh(*dims, devices=jax.devices()[:math.prod(dims)])
    batches = SlowBatches(tokens, mask, s.batch_size, seed=0, sleep=step_sleep)
    out = trainer.train(s, cfg, params, batches, workdir, teacher=teacher, mesh=mesh)
    result = {"losses": np.asarray([]), "params": {
        jax.tree_util.keystr(p): np.asarray(v)
        for p, v in jax.tree.flatten_with_path(trainer.host_params(out))[0]}}
    if jax.process_index() == 0:
        lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
        result["losses"] = np.asarray([json.loads(ln)["loss"] for ln in lines if '"loss"' in ln])
    if with_final_loss:
        result["final_loss"] = final_loss(s, cfg, teacher, out, tokens, mask, mesh)
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--mesh", nargs="+", default=["1,1,1"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--loss", default="kl")
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--distributed", default="")
    args = ap.parse_args()
    if args.distributed:
        port, num, pid = args.distributed.split(",")
        sharding.init_distributed({"coordinator_address": f"localhost:{port}",
                                   "num_processes": int(num), "process_id": int(pid)})
    for mesh_arg in args.mesh:
        dims = tuple(int(x) for x in mesh_arg.split(","))
        name = "x".join(map(str, dims))
        r = run(Path(args.out) / name, dims, args.step_sleep, bool(args.distributed),
                steps=args.steps, loss=args.loss, save_every=args.save_every)
        params = r.pop("params")
        np.savez(Path(args.out) / f"{name}-p{jax.process_index()}.npz", **r, **params)


if __name__ == "__main__":
    main()
