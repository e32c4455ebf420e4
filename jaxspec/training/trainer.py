"""Drafter training: next-token pretraining and finetuning on distilled data (ce / kl / tvdpp).

One jitted step with explicit in/out shardings over a ("data", "fsdp", "tensor") mesh: a scan over
gradient-accumulation micro-batches, then AdamW (warmup + cosine, global-norm clipping). The
teacher (target) runs forward inside the step for kl/tvdpp. Orbax keeps the latest N checkpoints
(async); each holds step, params, optimizer state and the data position, so a resumed run takes
the same steps as an uninterrupted one. With a reduced head (`vocab_ids`), ce skips targets outside
the head and kl/tvdpp compare with the teacher renormalised over the head's ids.
Training is deterministic given the config: the data order comes from (seed, epoch) and the eval
seed from (seed, step), so no PRNG state needs carrying.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec import sharding as shd
from jaxspec.config import ModelConfig
from jaxspec.decoding.api import speculative_generate
from jaxspec.drafters.model import model_drafter
from jaxspec.errors import UserError
from jaxspec.loading import forward_logits
from jaxspec.models.model import Model
from jaxspec.training.data import Batches
from jaxspec.training.losses import loss_fn_by_name

TEACHER_LOSSES = ("kl", "tvdpp")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Static training settings (the `train` section of a recipe, less data and model keys)."""

    steps: int
    batch_size: int = 8  # sequences per optimizer step, over all micro-batches and devices
    seq_len: int = 128
    grad_accum: int = 1
    loss: str = "ce"  # ce | kl | tvdpp
    lr: float = 3e-4
    warmup_steps: int = 0
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    bf16: bool = False  # compute in bfloat16 (params and optimizer state stay float32)
    seed: int = 0
    mesh: tuple[int, int, int] = (-1, 1, 1)  # data, fsdp, tensor; one may be -1
    log_every: int = 10
    save_every: int = 100
    keep: int = 3
    eval_every: int = 0  # measure tau every K steps; 0 skips
    eval_gamma: int = 4
    eval_max_new_tokens: int = 32
    eval_temperature: float = 0.0
    freeze: tuple[str, ...] = ()  # top-level params left as initialised, e.g. ("embed",)

    def __post_init__(self):
        loss_fn_by_name(self.loss)
        if self.batch_size % self.grad_accum:
            raise UserError(f"batch_size {self.batch_size} is not a multiple of grad_accum "
                            f"{self.grad_accum}")
        if self.steps < 1 or self.save_every < 1 or self.keep < 1:
            raise UserError("steps, save_every and keep must be positive")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainSettings":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise UserError(f"unknown train settings {sorted(unknown)}; known: {sorted(names)}")
        d = dict(d)
        if isinstance(d.get("mesh"), dict):
            m = d["mesh"]
            d["mesh"] = (m.get("data", -1), m.get("fsdp", 1), m.get("tensor", 1))
        if "mesh" in d:
            d["mesh"] = tuple(int(x) for x in d["mesh"])
        if "freeze" in d:
            d["freeze"] = tuple(d["freeze"])
        return cls(**d)

    @property
    def micro_batch(self) -> int:
        return self.batch_size // self.grad_accum


def _zero(names: tuple[str, ...]) -> optax.GradientTransformation:
    """Zero the updates of these top-level params (before clipping, and after weight decay)."""
    def update(updates, state, params=None):
        return {k: jax.tree.map(jnp.zeros_like, v) if k in names else v
                for k, v in updates.items()}, state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(s: TrainSettings) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW over a warmup + cosine schedule, after global-norm clipping; no decay on vectors."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, s.lr, s.warmup_steps, max(s.steps, s.warmup_steps + 1), s.lr * s.end_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    opt = optax.chain(_zero(s.freeze), optax.clip_by_global_norm(s.clip_norm),
                      optax.adamw(schedule, s.b1, s.b2, weight_decay=s.weight_decay,
                                  mask=decay_mask),
                      _zero(s.freeze))
    return opt, schedule


def head_index(vocab_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """Full vocab id -> head index (-1 outside the head)."""
    out = np.full(vocab_size, -1, np.int32)
    out[np.asarray(vocab_ids)] = np.arange(len(vocab_ids), dtype=np.int32)
    return out


def make_loss(config: ModelConfig, s: TrainSettings, teacher_config: ModelConfig | None,
              vocab_ids: np.ndarray | None):
    """`loss(params, teacher_params, tokens_BxL, mask_BxL) -> (loss, num_targets)`."""
    loss_fn = loss_fn_by_name(s.loss)
    dtype = jnp.bfloat16 if s.bf16 else jnp.float32
    cast = lambda tree: jax.tree.map(lambda p: p.astype(dtype), tree)  # noqa: E731
    if vocab_ids is not None:
        to_head_V = jnp.asarray(head_index(vocab_ids, config.vocab_size))
        vocab_ids = jnp.asarray(vocab_ids)

    def loss(params, teacher_params, tokens_BxL, mask_BxL):
        inputs_BxS, targets_BxS = tokens_BxL[:, :-1], tokens_BxL[:, 1:]
        mask_BxS = mask_BxL[:, 1:].astype(bool)
        logits_BxSxK = forward_logits(cast(params), config, inputs_BxS)  # K: the head's vocab
        batch = {"targets": targets_BxS, "mask": mask_BxS}
        if vocab_ids is not None:
            batch["targets"] = to_head_V[targets_BxS]
            if s.loss == "ce":  # targets outside the head cannot be predicted
                batch["mask"] = mask_BxS & (batch["targets"] >= 0)
        if s.loss in TEACHER_LOSSES:
            teacher_BxSxV = forward_logits(cast(teacher_params), teacher_config, inputs_BxS)
            if vocab_ids is not None:
                teacher_BxSxV = teacher_BxSxV[..., vocab_ids]
            batch["teacher_logits"] = jax.lax.stop_gradient(teacher_BxSxV)
        return loss_fn(logits_BxSxK, batch), jnp.sum(batch["mask"])

    return loss


def make_train_step(config: ModelConfig, s: TrainSettings, opt: optax.GradientTransformation,
                    schedule, teacher_config: ModelConfig | None = None,
                    vocab_ids: np.ndarray | None = None, loss: Callable | None = None
                    ) -> Callable:
    """`step(state, batch, teacher_params) -> (state, metrics)`; batch arrays are
    [grad_accum, micro_batch, seq_len + 1, ...]; the loss and gradient are means over
    micro-batches. `loss(params, teacher_params, micro_batch) -> (loss, num_targets)` replaces
    the drafter model's next-token loss (`make_loss`), e.g. a hidden-state head's."""
    if loss is None:
        model_loss = make_loss(config, s, teacher_config, vocab_ids)
        loss = lambda p, t, b: model_loss(p, t, b["tokens"], b["mask"])  # noqa: E731
    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def step(state, batch, teacher_params):
        params = state["params"]

        def micro(acc, xs):
            (loss, n), grads = grad_fn(params, teacher_params, xs)
            acc = jax.tree.map(jnp.add, acc, (loss, n, grads))
            return acc, None

        zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32),
                 jax.tree.map(jnp.zeros_like, params))
        (loss, n, grads), _ = jax.lax.scan(micro, zeros, batch)
        loss, grads = loss / s.grad_accum, jax.tree.map(lambda g: g / s.grad_accum, grads)
        updates, opt_state = opt.update(grads, state["opt_state"], params)
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                     "opt_state": opt_state}
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": schedule(state["step"]), "targets": n}
        return new_state, metrics

    return step


def abstract_state(params, opt) -> dict:
    """Shapes and dtypes of the train state: float32 params shaped like `params`."""
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.float32), params)
    return {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
            "opt_state": jax.eval_shape(opt.init, params)}


def state_shardings(p_sh, params, opt, mesh) -> dict:
    """Shardings of the train state: params by `p_sh`, optimizer moments like their params,
    scalars replicated."""
    opt_sh = optax.tree_map_params(opt, lambda _, sh: sh, abstract_state(params, opt)["opt_state"],
                                   p_sh, transform_non_params=lambda _: shd.replicated(mesh))
    return {"step": shd.replicated(mesh), "params": p_sh, "opt_state": opt_sh}


def _place(tree, shardings):
    """Host or device values -> global arrays with these shardings (every process holds all)."""
    return jax.tree.map(lambda x, sh: shd.global_array(np.asarray(x), sh), tree, shardings)


def host_params(params) -> dict:
    """Full params as numpy on every process."""
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return jax.device_get(params)
    return multihost_utils.process_allgather(params, tiled=True)


class MetricsLog:
    """Metrics to `<workdir>/metrics.jsonl` and TensorBoard (`<workdir>/tb`), on process 0."""

    def __init__(self, workdir: Path):
        self.enabled = jax.process_index() == 0
        if self.enabled:
            from tensorboardX import SummaryWriter

            self.jsonl = open(workdir / "metrics.jsonl", "a", encoding="utf-8")
            self.tb = SummaryWriter(str(workdir / "tb"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        for k, v in metrics.items():
            self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tb.close()


def measure_tau(teacher, config: ModelConfig, params, tokenizer, vocab_ids, prompts: Sequence[str],
                s: TrainSettings, step: int, speculative_fn: Callable | None, chat: bool,
                drafter_fn: Callable | None = None) -> float:
    """Mean tokens per verification step of the drafter against the target on `prompts`;
    `drafter_fn(params)` builds the drafter when it is not a model (a hidden-state head)."""
    params = jax.tree.map(jnp.asarray, host_params(params))
    if drafter_fn is not None:
        drafter = drafter_fn(params)
    else:
        drafter = Model(config, params, tokenizer, "drafter")
        if vocab_ids is not None:
            drafter = model_drafter(drafter, vocab_ids)
    out = (speculative_fn or speculative_generate)(teacher, drafter, list(prompts), gamma=s.eval_gamma,
                         max_new_tokens=s.eval_max_new_tokens, temperature=s.eval_temperature,
                         seed=s.seed + step, chat=chat)
    return float(out.tau)


def _checkpoint_manager(directory: Path, s: TrainSettings):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(s.keep),
        enable_async_checkpointing=True)
    return ocp.CheckpointManager(directory.absolute(), options=options)


def train(s: TrainSettings, config: ModelConfig, init_params, batches: Batches,
          workdir: str | os.PathLike, *, teacher=None, vocab_ids: np.ndarray | None = None,
          eval_prompts: Sequence[str] = (), speculative_fn: Callable | None = None,
          tokenizer=None, chat: bool = False, mesh=None, loss: Callable | None = None,
          param_shardings=None, drafter_fn: Callable | None = None, frozen=None) -> dict:
    """Train the drafter `config` from `init_params` (host arrays) on `batches`, resuming from
    the latest checkpoint in `<workdir>/checkpoints`. `teacher` (a Model) gives the kl/tvdpp
    targets and is the target for tau. Returns the final params (global arrays).

    A drafter that is not a model (a hidden-state head) passes its `loss` (see
    `make_train_step`), `param_shardings`, `drafter_fn` (params -> Drafter, for tau) and the
    `frozen` arrays its loss reads (replicated, passed where a teacher's params go)."""
    import orbax.checkpoint as ocp
    from tqdm.auto import tqdm

    if batches.batch_size != s.batch_size:
        raise ValueError(f"batches hold {batches.batch_size} rows, settings ask {s.batch_size}")
    if batches.tokens_RxL.shape[1] != s.seq_len + 1:
        raise ValueError(f"packed rows have {batches.tokens_RxL.shape[1]} tokens, expected "
                         f"seq_len + 1 = {s.seq_len + 1}")
    if loss is not None and s.loss != "ce":
        raise ValueError(f"settings ask loss {s.loss!r}, but a given `loss` replaces the drafter "
                         f"model's losses (and gets `frozen`, not the teacher's params); set "
                         f"loss to 'ce'")
    if s.loss in TEACHER_LOSSES and teacher is None:
        raise ValueError(f"loss {s.loss!r} needs the target as teacher")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    mesh = mesh or shd.make_mesh(*s.mesh)
    opt, schedule = make_optimizer(s)
    p_sh = param_shardings or shd.param_shardings(config, mesh)
    state_sh = state_shardings(p_sh, init_params, opt, mesh)
    use_teacher = s.loss in TEACHER_LOSSES
    teacher_params, teacher_sh = {}, {}
    if use_teacher:
        teacher_sh = shd.param_shardings(teacher.config, mesh)
        teacher_params = _place(teacher.params, teacher_sh)
    elif frozen is not None:
        teacher_sh = jax.tree.map(lambda _: shd.replicated(mesh), frozen)
        teacher_params = _place(frozen, teacher_sh)
    arrays = {"tokens": batches.tokens_RxL, "mask": batches.mask_RxL, **batches.extra}
    batch_sh = {k: shd.batch_sharding(mesh, ndim=v.ndim + 1, leading=1)
                for k, v in arrays.items()}
    for k, v in arrays.items():
        shd.check_divisible(f"micro-batch {k}", (s.grad_accum, s.micro_batch, *v.shape[1:]),
                            batch_sh[k].spec, mesh)
    step_fn = jax.jit(
        make_train_step(config, s, opt, schedule, teacher.config if use_teacher else None,
                        vocab_ids, loss),
        in_shardings=(state_sh, batch_sh, teacher_sh),
        out_shardings=(state_sh, shd.replicated(mesh)), donate_argnums=0)

    mngr = _checkpoint_manager(workdir / "checkpoints", s)
    start = mngr.latest_step()
    if start is None:
        params = _place(init_params, state_sh["params"])
        opt_state = jax.jit(opt.init, out_shardings=state_sh["opt_state"])(params)
        step0 = shd.global_array(np.zeros((), np.int32), state_sh["step"])
        state = {"step": step0, "params": params, "opt_state": opt_state}
        start = 0
    else:
        abstract = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
            abstract_state(init_params, opt), state_sh)
        restored = mngr.restore(start, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        state = restored["state"]
        batches.restore(restored["data"])

    log = MetricsLog(workdir)
    bar = tqdm(total=s.steps, initial=start, desc=f"train ({s.loss})", unit="step",
               file=sys.stderr, disable=jax.process_index() != 0)
    pending, t0 = None, time.perf_counter()
    for step in range(start, s.steps):
        rows = batches.next()
        host = {k: v.reshape(s.grad_accum, s.micro_batch, *v.shape[1:]) for k, v in rows.items()}
        batch = {k: shd.global_array(v, batch_sh[k]) for k, v in host.items()}
        state, metrics = step_fn(state, batch, teacher_params)
        done = step + 1
        if pending is not None:  # read the previous step's metrics: never stall the device
            _report(log, bar, *pending, t0)
        pending = (done, metrics) if done % s.log_every == 0 or done == s.steps else None
        if done % s.save_every == 0 or done == s.steps:
            mngr.save(done, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    data=ocp.args.JsonSave(batches.state)))
        if s.eval_every and done % s.eval_every == 0 and teacher is not None and eval_prompts:
            tau = measure_tau(teacher, config, state["params"], tokenizer, vocab_ids,
                              eval_prompts, s, done, speculative_fn, chat, drafter_fn)
            log.log(done, {"tau": tau})
            bar.set_postfix(tau=f"{tau:.2f}")
        bar.update(1)
    if pending is not None:
        _report(log, bar, *pending, t0)
    mngr.wait_until_finished()
    mngr.close()
    bar.close()
    log.close()
    return state["params"]


def _report(log: MetricsLog, bar, step: int, metrics, t0: float) -> None:
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    values["elapsed_s"] = time.perf_counter() - t0
    log.log(step, values)
    bar.set_postfix(loss=f"{values['loss']:.4f}")
