"""The trainer: sharded equivalence (8 simulated devices, two processes), exact resume after
SIGKILL, reduced-vocabulary losses, gradient accumulation, tau evaluation and logs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh

from jaxspec import sharding
from jaxspec.models.model import Model
from jaxspec.training import data, losses, trainer


@pytest.fixture(scope="module")
def worker(helper):
    return helper("_worker")


@pytest.fixture(scope="module")
def reference(worker, tmp_path_factory):
    """The 3-step kl run on one device, in this process."""
    return worker.run(tmp_path_factory.mktemp("reference"))


def _assert_same_params(npz, ref, atol=2e-5):
    for name, value in ref["params"].items():
        np.testing.assert_allclose(npz[name], value, atol=atol, err_msg=name)


def test_meshes_of_8_devices_match_one_device(tmp_path, procs, request):
    meshes = ["8,1,1", "2,2,2", "1,2,4"]
    proc = procs.start("_worker", tmp_path, "--mesh", *meshes, devices=8)
    reference = request.getfixturevalue("reference")  # computed while the worker runs
    procs.finish(proc)
    assert len(reference["losses"]) == 3 and reference["losses"][-1] < reference["losses"][0]
    for m in meshes:
        out = np.load(tmp_path / f"{m.replace(',', 'x')}-p0.npz")
        np.testing.assert_allclose(out["losses"], reference["losses"], rtol=1e-5, err_msg=m)
        _assert_same_params(out, reference)


def test_two_processes_agree(tmp_path, procs, reference):
    port = procs.free_port()
    workers = [procs.start("_worker", tmp_path, "--mesh", "1,2,1", "--distributed",
                           f"{port},2,{pid}") for pid in (0, 1)]
    for w in workers:
        procs.finish(w)
    p0, p1 = (np.load(tmp_path / f"1x2x1-p{pid}.npz") for pid in (0, 1))
    assert p0["final_loss"] == p1["final_loss"]
    for name in reference["params"]:
        np.testing.assert_array_equal(p0[name], p1[name], err_msg=name)
    np.testing.assert_allclose(p0["losses"], reference["losses"], rtol=1e-5)
    _assert_same_params(p0, reference)


def test_killed_training_resumes_to_the_same_params(tmp_path, procs):
    steps = ["--steps", 8, "--save-every", 2]
    workdir = tmp_path / "killed" / "1x1x1"
    uninterrupted = procs.start("_worker", tmp_path / "uninterrupted", *steps)
    proc = procs.start("_worker", tmp_path / "killed", *steps, "--step-sleep", 0.5)
    saved = lambda: [p for p in (workdir / "checkpoints").glob("*") if p.name.isdigit()]  # noqa
    procs.kill_when(proc, lambda: (workdir / "checkpoints").is_dir() and saved())
    killed_at = max(int(p.name) for p in saved())
    assert killed_at < 8 and not (tmp_path / "killed" / "1x1x1-p0.npz").exists()
    logged = len((workdir / "metrics.jsonl").read_text().splitlines())
    procs.finish(procs.start("_worker", tmp_path / "killed", *steps))
    resumed = [json.loads(ln) for ln in
               (workdir / "metrics.jsonl").read_text().splitlines()[logged:]]
    assert resumed[0]["step"] == killed_at + 1 and resumed[-1]["step"] == 8
    procs.finish(uninterrupted)
    want = np.load(tmp_path / "uninterrupted" / "1x1x1-p0.npz")
    got = np.load(tmp_path / "killed" / "1x1x1-p0.npz")
    assert sorted(got.files) == sorted(want.files)
    for name in want.files:
        if name != "losses":
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_reduced_vocab_losses_use_the_head_ids(worker):
    teacher, cfg, params, tokens, mask = worker.tiny_setup()
    vocab_ids = np.arange(100, 228, dtype=np.int32)
    from jaxspec.training import drafter_init

    small_cfg, small = drafter_init.reduce_head(cfg, params, vocab_ids)
    small, teacher_params = jax.tree.map(jnp.asarray, (small, teacher.params))
    tokens_BxL, mask_BxL = jnp.asarray(tokens[:2]), jnp.asarray(mask[:2])
    forward = jax.jit(trainer.forward_logits, static_argnums=1)
    logits = forward(small, small_cfg, tokens_BxL[:, :-1])
    targets = tokens_BxL[:, 1:]
    in_head = (targets >= 100) & (targets < 228)
    want_ce = losses.cross_entropy(logits, targets - 100, mask_BxL[:, 1:].astype(bool) & in_head)
    got_ce, n = trainer.make_loss(small_cfg, worker.settings(loss="ce"), None, vocab_ids)(
        small, {}, tokens_BxL, mask_BxL)
    np.testing.assert_allclose(got_ce, want_ce, rtol=1e-6)
    assert n == int(jnp.sum(mask_BxL[:, 1:].astype(bool) & in_head)) > 0
    teacher_logits = forward(teacher_params, teacher.config, tokens_BxL[:, :-1])
    want_kl = losses.forward_kl(logits, teacher_logits[..., 100:228], mask_BxL[:, 1:])
    got_kl, _ = trainer.make_loss(small_cfg, worker.settings(loss="kl"), teacher.config,
                                  vocab_ids)(small, teacher_params, tokens_BxL, mask_BxL)
    np.testing.assert_allclose(got_kl, want_kl, rtol=1e-5)


def test_gradient_accumulation_equals_one_big_batch(worker):
    """The accumulated gradient itself, not Adam's sign-like first step: `optax.identity` makes
    the update the gradient, so a missing or doubled `/ grad_accum` scales it visibly."""
    _, cfg, params, tokens, _ = worker.tiny_setup()
    # A full mask gives equal target counts: the mean of micro-batch means is the batch mean.
    rows = {"tokens": tokens[:8], "mask": np.ones_like(tokens[:8])}
    opt = optax.identity()
    grads, metrics = {}, {}
    for accum in (1, 2, 4):
        s = worker.settings(batch_size=8, grad_accum=accum, loss="ce")
        step = jax.jit(trainer.make_train_step(cfg, s, opt, lambda step: 0.0))
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt.init(params)}
        batch = {k: v.reshape(accum, 8 // accum, -1) for k, v in rows.items()}
        new, metrics[accum] = step(state, batch, {})
        grads[accum] = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b,
                                    new["params"], params)
    scale = max(np.abs(g).max() for g in jax.tree.leaves(grads[1]))
    assert scale > 1e-4  # a real gradient
    for accum in (2, 4):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * scale),
                     grads[accum], grads[1])
        np.testing.assert_allclose(metrics[accum]["loss"], metrics[1]["loss"], rtol=1e-5)
        np.testing.assert_allclose(metrics[accum]["grad_norm"], metrics[1]["grad_norm"],
                                   rtol=1e-4)


def test_tau_is_measured_every_k_steps_and_logged(tmp_path, worker):
    teacher, cfg, params, tokens, mask = worker.tiny_setup()
    vocab_ids = np.arange(0, 264, 2, dtype=np.int32)
    from jaxspec.training import drafter_init

    cfg, params = drafter_init.reduce_head(cfg, params, vocab_ids)
    calls = []

    class Out:
        tau = 2.5

    def fake_speculative(target, drafter, prompts, **kw):
        calls.append((target, drafter, prompts, kw))
        return Out()

    s = worker.settings(steps=4, loss="ce", eval_every=2, eval_gamma=3, save_every=2, keep=1,
                        bf16=True)
    trainer.train(s, cfg, params, data.Batches(tokens, mask, 16), tmp_path, teacher=teacher,
                  vocab_ids=vocab_ids, eval_prompts=["a", "b"], speculative_fn=fake_speculative)
    assert [c[3]["seed"] for c in calls] == [2, 4]
    target, drafter, prompts, kw = calls[0]
    assert target is teacher and prompts == ["a", "b"] and kw["gamma"] == 3
    np.testing.assert_array_equal(drafter.params["vocab_ids"], vocab_ids)  # a model_drafter
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "tau" in r] == [2, 4]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in records if "loss" in r)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [
        "4"]  # keep=1


def test_sharding_rules_and_clear_errors(worker):
    mesh = AbstractMesh((1, 2, 4), sharding.MESH_AXES)
    sh = sharding.param_shardings(worker.TINY, mesh)
    assert sh["layers"][0]["wq"].spec == jax.P("tensor", None, "fsdp")
    assert sh["embed"].spec == jax.P("tensor", "fsdp")
    with pytest.raises(ValueError, match=r"param \['layers'\]\[0\]\['wk'\]: dim 0 .* size 4, which "
                                         r"mesh axes tensor \(size 8\) do not divide"):
        sharding.param_shardings(worker.TINY, AbstractMesh((1, 1, 8), sharding.MESH_AXES))
    with pytest.raises(ValueError, match="needs 2 devices, 1 are available"):
        sharding.make_mesh(2, 1, 1)
    assert sharding.make_mesh().shape == {"data": 1, "fsdp": 1, "tensor": 1}


def test_settings_are_checked():
    with pytest.raises(ValueError, match="unknown train settings"):
        trainer.TrainSettings.from_dict({"steps": 1, "lr_max": 1})
    with pytest.raises(ValueError, match="not a multiple of grad_accum"):
        trainer.TrainSettings(steps=1, batch_size=6, grad_accum=4)
    with pytest.raises(ValueError, match="Unknown loss"):
        trainer.TrainSettings(steps=1, loss="mse")
    s = trainer.TrainSettings.from_dict({"steps": 2, "mesh": {"fsdp": 2}})
    assert s.mesh == (-1, 2, 1)


def test_teacher_losses_need_a_teacher(tmp_path, worker):
    _, cfg, params, tokens, mask = worker.tiny_setup()
    with pytest.raises(ValueError, match="needs the target as teacher"):
        trainer.train(worker.settings(), cfg, params, data.Batches(tokens, mask, 16), tmp_path)
    with pytest.raises(ValueError, match="expected seq_len"):
        trainer.train(worker.settings(seq_len=16), cfg, params,
                      data.Batches(tokens, mask, 16), tmp_path, teacher=Model(cfg, params))
