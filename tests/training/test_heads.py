"""Hidden-state drafter heads (medusa, hydra, eagle): rows and cached target features, loss
falling on self-distilled text, teacher-forced agreement equal to acceptance in decoding, exact
resume after SIGKILL, 8 simulated devices, and the recipe end to end."""

import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import sharding
from jaxspec.checkpoints import heads as ckpt_heads
from jaxspec.config import load_yaml
from jaxspec.drafters import hidden
from jaxspec.drafters.head import feature, shared_params
from jaxspec.errors import UserError
from jaxspec.models.cache import init_cache
from jaxspec.models.transformer import forward
from jaxspec.training import drafter_init, heads, recipe, trainer
from jaxspec.training.data import Batches

CONFIGS = Path(__file__).parents[2] / "configs"

PROMPT, NEW = 4, 28  # self-distilled rows: a 4-token prompt and 28 greedy tokens
TRAIN, EVAL = 240, 16  # self-distilled rows to train on, prompts to decode
DEPTH, HEAD_VOCAB, STEPS = 3, 48, 150
HEADS = ("medusa", "hydra", "eagle")  # streams: test_streams.py


@pytest.fixture(scope="module")
def worker(helper):
    return helper("_heads_worker")


@functools.partial(jax.jit, static_argnums=1)
def _full_features(params, config, tokens_BxN):
    """The target's last-layer hidden states (float32) from one full forward."""
    B, N = tokens_BxN.shape
    return forward(params, config, tokens_BxN, jnp.broadcast_to(jnp.arange(N), (B, N)),
                   init_cache(config, B, N), features=True)[2]


@pytest.fixture(scope="module")
def selfgen(worker, tmp_path_factory):
    """A one-layer random target (std 0.4: greedy text that varies, and that a head can learn
    to predict about a third of the time), its greedy continuations of 256 random prompts
    (240 train rows, 16 to decode), its cached features of the train rows, and a 48-id head
    vocabulary."""
    config = worker.TINY.replace(num_layers=1)
    target = jaxspec.Model(config, worker.np_init(config, 0, std=0.4), None, "tiny1")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 64, PROMPT).tolist() for _ in range(TRAIN + EVAL)]
    out = jaxspec.generate(target, prompts, max_new_tokens=NEW)
    examples = [(p + t, [0] * PROMPT + [1] * NEW) for p, t in zip(prompts, out.token_ids)]
    tokens, mask = heads.example_rows(examples[:TRAIN], PROMPT + NEW - 1, 0)
    assert mask.sum() == TRAIN * NEW  # no early stop: every row is whole
    feats = heads.target_features(target, tokens, tmp_path_factory.mktemp("features"))
    vocab_ids = drafter_init.frequent_vocab(out.token_ids[:TRAIN], HEAD_VOCAB, 64)
    return dict(target=target, prompts=prompts[TRAIN:], greedy=out.token_ids[TRAIN:],
                tokens=tokens, mask=mask, feats=feats, vocab_ids=vocab_ids)


@pytest.fixture(scope="module")
def trained(selfgen, tmp_path_factory):
    """trained(kind) -> (head params, workdir): 150 steps on the self-distilled rows."""
    done = {}

    def train(kind):
        if kind not in done:
            t = selfgen["target"]
            V, ids = t.config.vocab_size, selfgen["vocab_ids"]
            spec = hidden.hidden_spec(kind, t.config, DEPTH)
            head = jax.device_get(hidden.head_params(kind, t.config, DEPTH, jax.random.key(0),
                                                     t.params))
            s = trainer.TrainSettings(steps=STEPS, batch_size=8, seq_len=PROMPT + NEW - 1,
                                      lr=2e-2, warmup_steps=2, log_every=1, save_every=1000,
                                      mesh=(1, 1, 1))
            mesh = sharding.make_mesh(1, 1, 1)
            workdir = tmp_path_factory.mktemp(kind)
            out = trainer.train(
                s, t.config, head,
                Batches(selfgen["tokens"], selfgen["mask"], 8, 0, features=selfgen["feats"]),
                workdir, mesh=mesh,
                loss=heads.head_loss(spec, trainer.head_index(ids, V), unroll=DEPTH),
                frozen=shared_params(t.params, ids),
                param_shardings=jax.tree.map(lambda _: sharding.replicated(mesh), head))
            done[kind] = trainer.host_params(out), workdir
        return done[kind]

    return train


# ------------------------------------------------------------------------ rows and features

def test_example_rows_keep_one_example_per_row():
    examples = [([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 1, 1]),  # long: its last 4 tokens
                ([11, 12], [0, 1]),  # short: padded, mask 0
                ([20, 21, 22, 23], [0, 1, 1, 0])]  # exactly one row
    tokens, mask = heads.example_rows(examples, seq_len=3, pad_id=99)
    np.testing.assert_array_equal(tokens, [[7, 8, 9, 10], [11, 12, 99, 99], [20, 21, 22, 23]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0]])
    assert tokens.dtype == mask.dtype == np.int32


def test_target_features_are_the_forward_features_cached(worker, tmp_path, monkeypatch):
    target = worker.tiny_target()
    tokens, _ = worker.pattern_rows(n=20, length=12, seed=3)
    monkeypatch.setattr(heads, "_BLOCK", 8)  # 3 blocks: 8, 8, 4 rows
    feats = heads.target_features(target, tokens, tmp_path, batch_size=16)
    assert feats.dtype == jnp.bfloat16 and feats.shape == (20, 12, 32)
    want = np.asarray(_full_features(target.params, target.config, tokens)).astype(jnp.bfloat16)
    # One bfloat16 rounding of float32 values equal up to their last bits (batched and full
    # forwards run different product shapes): one bfloat16 step apart at most.
    np.testing.assert_allclose(feats.astype(np.float32), want.astype(np.float32),
                               rtol=2 ** -6, atol=1e-6)
    assert np.mean(feats == want) > 0.99
    (cached,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    files = sorted(cached.glob("features-*.npy"))
    assert len(files) == 3
    stamps = [f.stat().st_mtime_ns for f in files]

    # A second call reads the blocks: the target never runs.
    def no_forward(*args, **kw):
        raise AssertionError("cached features were computed again")

    monkeypatch.setattr(heads, "_features_fn", no_forward)
    np.testing.assert_array_equal(heads.target_features(target, tokens, tmp_path), feats)
    assert [f.stat().st_mtime_ns for f in files] == stamps
    # The same rows of another target are refused, not served.
    other = jaxspec.Model(target.config, target.params, None, "other")
    with pytest.raises(UserError, match="another target"):
        heads.target_features(other, tokens, tmp_path)
    # A killed run left one block missing: only that block is computed.
    monkeypatch.undo()
    monkeypatch.setattr(heads, "_BLOCK", 8)
    files[1].unlink()
    np.testing.assert_array_equal(heads.target_features(target, tokens, tmp_path), feats)
    assert [f.stat().st_mtime_ns for f in (files[0], files[2])] == [stamps[0], stamps[2]]
    # Other rows are other features, in their own cache.
    other_rows = tokens[::-1].copy()
    np.testing.assert_allclose(
        heads.target_features(target, other_rows, tmp_path).astype(np.float32),
        feats[::-1].astype(np.float32), rtol=2 ** -7, atol=1e-6)
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2


def test_prefill_labels_and_features_are_those_of_step_by_step_decoding(worker, tmp_path):
    """Training labels at prefill speed: one forward over a text gives, at every position, the
    feature and the greedy next token that decoding the text one token at a time gives."""
    target = worker.tiny_target()
    c = target.config
    tokens, _ = worker.pattern_rows(n=6, length=12, seed=4)
    # bucket 8: rows of 12 run the output head over two chunks of 8, the last one padded.
    feats, labels = heads.target_features(target, tokens, tmp_path, batch_size=4, bucket=8,
                                          labels=True)
    assert labels.shape == tokens.shape and labels.dtype == np.int32
    B, L = tokens.shape
    step = jax.jit(lambda p, cache, t_Bx1, pos_Bx1: forward(p, c, t_Bx1, pos_Bx1, cache,
                                                            features=True))
    cache, want_labels, want_feats = init_cache(c, B, L), [], []
    for i in range(L):
        logits, cache, x = step(target.params, cache, jnp.asarray(tokens[:, i:i + 1]),
                                jnp.full((B, 1), i))
        want_labels.append(np.asarray(jnp.argmax(logits[:, 0], -1)))
        want_feats.append(np.asarray(x[:, 0]))
    np.testing.assert_array_equal(labels, np.stack(want_labels, 1))
    np.testing.assert_allclose(feats.astype(np.float32), np.stack(want_feats, 1),
                               rtol=2 ** -7, atol=1e-5)
    assert len(set(labels.ravel().tolist())) > 5  # a real test: labels vary
    # Cached: a second call reads both.
    again = heads.target_features(target, tokens, tmp_path, batch_size=4, bucket=8, labels=True)
    np.testing.assert_array_equal(again[1], labels)


# ------------------------------------------------------------------------------- training

@pytest.mark.parametrize("kind", HEADS)
def test_loss_falls_on_self_distilled_text(kind, trained):
    params, workdir = trained(kind)
    logged = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in logged]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    assert all(np.isfinite(losses)) and all(r["targets"] > 0 for r in logged)
    # Well below batch noise (medusa, whose deeper heads learn least, ends near 0.8x).
    assert losses[-1] < 0.85 * losses[0], losses
    assert np.mean(losses[-10:]) < 0.85 * np.mean(losses[:10]), losses


@pytest.mark.parametrize("kind", HEADS)
def test_the_loss_drafts_the_labels_when_given(kind, selfgen):
    """Labels (the target's greedy token after each position) replace the text's next tokens as
    what each position drafts; on the target's own greedy text they are the same."""
    t = selfgen["target"]
    spec = hidden.hidden_spec(kind, t.config, DEPTH)
    params = {"head": hidden.head_params(kind, t.config, DEPTH, jax.random.key(1), t.params),
              "shared": shared_params(t.params, np.arange(t.config.vocab_size))}
    tokens = jnp.asarray(selfgen["tokens"][:8])
    feats = jnp.asarray(selfgen["feats"][:8], jnp.float32)
    mask = jnp.asarray(selfgen["mask"][:8], bool)
    to_head = jnp.arange(t.config.vocab_size)
    loss = functools.partial(spec.loss, params, feats, tokens, mask, to_head, 1.0, DEPTH)
    text = loss()[0]
    np.testing.assert_allclose(loss(jnp.roll(tokens, -1, axis=1))[0], text, rtol=1e-6)
    other = jnp.asarray(np.random.default_rng(0).integers(3, 64, tokens.shape))
    assert abs(float(loss(other)[0]) - float(text)) > 0.1


def _teacher_forced(drafter, feats_BxNxD, tokens_BxN, depth):
    """(drafts, margins): drafts[k][b, p] is head/stage k's top-1 token for position p + 2 + k,
    from the target's full-forward features and the true tokens (the per-position functions
    training uses); margins[k][b, p] the gap between its two highest logits."""
    logits = [np.asarray(lg) for lg in _forced_logits(drafter, feats_BxNxD, tokens_BxN, depth)]
    ids = np.asarray(drafter.params["vocab_ids"])
    top2 = [np.sort(lg, -1)[..., -2:] for lg in logits]
    return [ids[lg.argmax(-1)] for lg in logits], [t[..., 1] - t[..., 0] for t in top2]


@functools.partial(jax.jit, static_argnums=3)
def _forced_logits(drafter, feats_BxNxD, tokens_BxN, depth):
    return drafter.spec.forced_logits(drafter.params, feats_BxNxD, tokens_BxN, depth)


_TIE = 1e-3  # logit margin under which incremental and full-forward float noise may flip a draft


def _replay(drafts, margins, row, prompt_len, gains, gamma):
    """(gain, near_tie) of each greedy verification step along the run's own positions: the
    drafts of the step at length L are drafts[k][L - 2]; they are accepted while they equal the
    target's greedy tokens `row`; the gain is capped by the budget (the end of `row`)."""
    out, L = [], prompt_len
    for actual in gains:
        n, tie = 0, False
        while n < gamma and L + n < len(row):
            tie |= margins[n][L - 2] < _TIE
            if drafts[n][L - 2] != row[L + n]:
                break
            n += 1
        out.append((min(n + 1, len(row) - L), tie))
        L += actual
    assert L == len(row)
    return out


@pytest.mark.parametrize("kind,gamma", [("eagle", 3), ("hydra", 3), ("medusa", 3)])
def test_teacher_forced_agreement_is_the_acceptance(kind, gamma, selfgen, trained):
    """Greedy decoding accepts a draft exactly when the head, teacher-forced on the target's
    own features and tokens, predicts the target's next token: drafting and training must see
    the same inputs at the same positions (eagle's later drafts read its own predicted features,
    as its unrolled training does)."""
    target, prompts, greedy = selfgen["target"], selfgen["prompts"], selfgen["greedy"]
    head, _ = trained(kind)
    drafter = hidden.hidden_drafter(target, kind, head, selfgen["vocab_ids"], DEPTH)
    res = jaxspec.speculative_generate(target, drafter, prompts, gamma=gamma,
                                       max_new_tokens=NEW)
    assert res.token_ids == greedy
    rows = np.array([p + g for p, g in zip(prompts, greedy)], np.int32)
    feats = _full_features(target.params, target.config, rows)
    drafts, margins = _teacher_forced(drafter, feats, jnp.asarray(rows), gamma)
    forced, ties = [], 0
    for b in range(len(rows)):
        actual = res.accept_lengths[b]
        got = _replay([d[b] for d in drafts], [m[b] for m in margins], rows[b], PROMPT, actual,
                      gamma)
        # Every step agrees, but for a near tie between a head's two best tokens.
        bad = [(i, g, a) for i, ((g, tie), a) in enumerate(zip(got, actual)) if g != a]
        assert all(got[i][1] for i, _, _ in bad), (b, bad)
        ties += len(bad)
        forced += [g for g, _ in got]
    assert ties <= 1
    drafted = gamma * len(forced)
    agreement = sum(g - 1 for g in forced) / drafted  # teacher-forced, on the run's positions
    assert abs(agreement - res.acceptance_rate) <= ties * gamma / drafted + 1e-9
    # A trained head: the comparison sees many accepted first drafts and, with gamma 3,
    # accepted second drafts (so later heads/stages are compared too), not only misses.
    gains = np.bincount(forced, minlength=gamma + 2)
    assert gains[2:].sum() >= 30 and (gamma == 1 or gains[3:].sum() >= 10), gains


def test_eagle_unrolled_steps_read_its_own_features(selfgen, trained):
    """Unrolled step j at p is what drafting computes for draft j + 1: EAGLE fed the target's
    features up to p, then its own predictions (with the true tokens) at p + 1 .. p + j; fed
    the target's features there instead, the outputs differ."""
    target = selfgen["target"]
    drafter = hidden.hidden_drafter(target, "eagle", trained("eagle")[0], selfgen["vocab_ids"],
                                    DEPTH)
    spec, params, c = drafter.spec, drafter.params, target.config
    tokens = jnp.asarray(selfgen["tokens"][:4])
    feats = jnp.asarray(selfgen["feats"][:4], jnp.float32)
    B, N = tokens.shape
    unrolled = spec.unroll(params, feats, tokens, DEPTH)
    normed = feature(params["shared"], c, feats)
    for p in (0, 5, N - 2 - DEPTH):
        cache = init_cache(c, B, N, num_layers=1)
        h, cache = spec.layer(params, normed[:, :p + 1], tokens[:, 1:p + 2],
                                    jnp.broadcast_to(jnp.arange(p + 1), (B, p + 1)), cache)
        own = true = h[:, -1]
        for j in range(DEPTH):
            if j:
                pos = jnp.full((B, 1), p + j)
                tok = tokens[:, p + j + 1][:, None]
                own, cache = spec.layer(params, own[:, None], tok, pos, cache)
                own = own[:, 0]
                true = spec.layer(params, normed[:, :p + j + 1], tokens[:, 1:p + j + 2],
                                        jnp.broadcast_to(jnp.arange(p + j + 1), (B, p + j + 1)),
                                        init_cache(c, B, N, num_layers=1))[0][:, -1]
                assert float(jnp.max(jnp.abs(unrolled[j, :, p] - true))) > 1e-2
            np.testing.assert_allclose(unrolled[j, :, p], own, atol=2e-5, rtol=1e-4)


# -------------------------------------------------------------------- resume and sharding

@pytest.mark.parametrize("kind,param", [("eagle", "['layer']['wq']"), ("streams", "['embed']")])
def test_killed_head_training_resumes_to_the_same_params(kind, param, tmp_path, procs):
    """An eagle head (nested params: fc and a decoder layer) and streams (their features are a
    lower layer's), features cached on disk."""
    steps = ["--kind", kind, "--steps", 8, "--save-every", 2, "--compile-cache", tmp_path / "xla"]
    workdir = tmp_path / "killed" / "1x1x1"
    uninterrupted = procs.start("_heads_worker", tmp_path / "uninterrupted", *steps)
    proc = procs.start("_heads_worker", tmp_path / "killed", *steps, "--step-sleep", 0.5)
    saved = lambda: [p for p in (workdir / "checkpoints").glob("*") if p.name.isdigit()]  # noqa
    procs.kill_when(proc, lambda: (workdir / "checkpoints").is_dir() and saved())
    killed_at = max(int(p.name) for p in saved())
    assert killed_at < 8 and not (tmp_path / "killed" / "1x1x1.npz").exists()
    logged = len((workdir / "metrics.jsonl").read_text().splitlines())
    procs.finish(procs.start("_heads_worker", tmp_path / "killed", *steps))
    resumed = [json.loads(ln) for ln in
               (workdir / "metrics.jsonl").read_text().splitlines()[logged:]]
    assert resumed[0]["step"] == killed_at + 1 and resumed[-1]["step"] == 8
    procs.finish(uninterrupted)
    want = np.load(tmp_path / "uninterrupted" / "1x1x1.npz")
    got = np.load(tmp_path / "killed" / "1x1x1.npz")
    assert sorted(got.files) == sorted(want.files) and param in want.files
    for name in want.files:
        if name != "losses":
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_8_devices_train_the_head_of_one_device(tmp_path, procs, worker):
    """A hydra head (the resume test trains eagle): rows and their features split over
    data x fsdp = 4, replicated over tensor = 2; the head and the target's shared arrays
    replicated everywhere."""
    proc = procs.start("_heads_worker", tmp_path, "--kind", "hydra", "--mesh", "2,2,2",
                       devices=8)
    reference = worker.run(tmp_path / "reference", "hydra")  # computed while the worker runs
    procs.finish(proc)
    assert len(reference["losses"]) == 3 and reference["losses"][-1] < reference["losses"][0]
    out = np.load(tmp_path / "2x2x2.npz")
    np.testing.assert_allclose(out["losses"], reference["losses"], rtol=1e-5)
    assert sorted(out.files) == sorted([*reference["params"], "losses"])
    for name, value in reference["params"].items():
        assert not np.array_equal(value, worker.initial_head("hydra")[name]), name  # trained
        np.testing.assert_allclose(out[name], value, atol=2e-5, err_msg=name)


def test_a_head_loss_refuses_teacher_losses(tmp_path, worker):
    """A given `loss` reads the frozen arrays: settings asking for kl/tvdpp (whose teacher
    params would reach it instead) are refused."""
    target, tokens, mask = worker.tiny_target(), *worker.pattern_rows()
    spec = hidden.hidden_spec("hydra", target.config, worker.DEPTH)
    with pytest.raises(ValueError, match="set loss to 'ce'"):
        trainer.train(worker.settings(loss="kl"), target.config, {}, Batches(tokens, mask, 16),
                      tmp_path, teacher=target, loss=heads.head_loss(spec, np.arange(64)),
                      frozen=shared_params(target.params, np.arange(64)))


# ------------------------------------------------------------------------------ recipe

def _eagle_config(tmp_path, *overrides):
    cfg = load_yaml(CONFIGS / "tiny.yaml", [f"distill.out_dir={tmp_path / 'distill'}",
                                            f"train.workdir={tmp_path / 'train'}", *overrides])
    cfg["drafter"] = {"kind": "eagle", "head_vocab_size": 128, "gamma": 3}
    return cfg


def test_tiny_eagle_recipe_end_to_end(tmp_path, monkeypatch):
    # The head's loss is its own (cross-entropy + feature regression): a teacher loss is refused
    # before anything runs.
    with pytest.raises(UserError, match="finetune.*loss"):
        recipe.check_config(_eagle_config(tmp_path))
    cfg = _eagle_config(tmp_path, "train.finetune.loss=ce", "distill.temperatures=[0.0]")
    recipe.run_distill(cfg)
    taus = []

    def spy(target, drafter, prompts, **kw):
        taus.append(jaxspec.speculative_generate(target, drafter, prompts, **kw))
        return taus[-1]

    path = recipe.run_train(cfg, speculative_fn=spy)
    assert path == tmp_path / "train" / "drafter"
    for stage in ("pretrain", "finetune"):
        logged = [json.loads(ln) for ln in
                  (tmp_path / "train" / stage / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in logged if "loss" in r] == [1, 2]
        assert [r["tau"] for r in logged if "tau" in r] == [pytest.approx(taus.pop(0).tau)]
    target = recipe.load_target(cfg["target"])
    heads_ = {}
    for name, stage in (("drafter", "finetune"), ("drafter-generic", "pretrain")):
        meta = ckpt_heads.read_meta(tmp_path / "train" / name)
        assert (meta["kind"], meta["tuned_gamma"], meta["stage"]) == ("eagle", 3, stage)
        assert len(meta["vocab_ids"]) == 128 and 2 in meta["vocab_ids"]  # EOS always in
        heads_[name] = jaxspec.load_drafter(tmp_path / "train" / name, target=target)
        assert heads_[name].spec.kind == "eagle"
    # Each stage trained the head (one step at lr 1e-3 after warmup moves most weights by more
    # than a bfloat16 rounding): the generic one from the initial head, the final one from the
    # generic one.
    init = hidden.head_params("eagle", target.config, 4, jax.random.key(0), target.params)
    fc = [np.asarray(init["fc"]).astype(jnp.bfloat16).astype(np.float32)] + [
        np.asarray(heads_[n].params["head"]["fc"]) for n in ("drafter-generic", "drafter")]
    assert np.mean(fc[1] != fc[0]) > 0.5 and np.mean(fc[2] != fc[1]) > 0.5
    prompts = ["Hallo Welt", "Guten Morgen, wie geht es dir?"]
    greedy = jaxspec.generate(target, prompts, max_new_tokens=12)
    spec = jaxspec.speculative_generate(target, heads_["drafter"], prompts, gamma=3,
                                        max_new_tokens=12)
    assert spec.token_ids == greedy.token_ids
    with pytest.raises(UserError, match="needs its target"):
        jaxspec.load_drafter(path)

    # Another pair finetunes this generic head (drafter.generic) instead of pretraining its own.
    other = _eagle_config(tmp_path, "train.finetune.loss=ce", "distill.temperatures=[0.0]",
                          f"train.workdir={tmp_path / 'other'}", "train.pretrain.steps=0")
    other["drafter"]["generic"] = str(tmp_path / "train" / "drafter-generic")
    generic = recipe._generic_head(other["drafter"]["generic"], "eagle", 4, target, init)
    np.testing.assert_array_equal(generic["fc"], fc[1])
    # A shipped drafter's name is resolved too (and refused here: it reads Gemma 3 270M).
    with pytest.raises(UserError, match="gemma3-270m-deen-drafter was trained for a target"):
        recipe._generic_head("gemma3-270m-deen-drafter", "eagle", 4, target, init)
    seen, real = [], recipe.trainer.train

    def first_params(s, config, params, *a, **kw):
        seen.append(np.asarray(params["fc"]))
        return real(s, config, params, *a, **kw)

    monkeypatch.setattr(recipe.trainer, "train", first_params)
    recipe.run_train(other)
    assert len(seen) == 1  # finetune only, from the generic head
    np.testing.assert_array_equal(seen[0], fc[1])
    assert ckpt_heads.read_meta(tmp_path / "other" / "drafter")["stage"] == "finetune"
    with pytest.raises(UserError, match="set train.pretrain steps to 0"):
        recipe.check_config({**other, "train": {**other["train"], "pretrain": {"steps": 2}}})
    with pytest.raises(UserError, match="is a eagle head of depth 4; this recipe trains medusa"):
        recipe._generic_head(other["drafter"]["generic"], "medusa", 4, target, init)

    # The align stage starts from the finetuned head and trains it on the same rows, unrolled
    # `drafter.unroll` drafts deep; the stages before it train one draft ahead.
    aligned = {**other, "drafter": {**other["drafter"], "unroll": 3,
                                    "generic": str(tmp_path / "other" / "drafter")},
               "train": {**other["train"], "workdir": str(tmp_path / "aligned"),
                         "finetune": {"steps": 0}, "align": {"steps": 2, "loss": "ce"}}}
    depths, real_loss = [], recipe.heads.head_loss
    monkeypatch.setattr(recipe.heads, "head_loss",
                        lambda *a: depths.append(a[-1]) or real_loss(*a))
    seen.clear()
    recipe.run_train(aligned)
    assert depths == [3] and len(seen) == 1
    np.testing.assert_array_equal(
        seen[0], jaxspec.load_drafter(tmp_path / "other" / "drafter",
                                      target=target).params["head"]["fc"])
    assert ckpt_heads.read_meta(tmp_path / "aligned" / "drafter")["stage"] == "align"
    depths.clear()
    recipe.run_train(other | {"train": {**other["train"], "workdir": str(tmp_path / "one")}})
    assert depths == [1]
    with pytest.raises(UserError, match="drafter.unroll is the align stage's depth"):
        recipe.check_config({**other, "drafter": {**other["drafter"], "unroll": 3}})
    with pytest.raises(UserError, match="train.align unrolls an EAGLE head"):
        recipe.check_config({**aligned, "drafter": {**aligned["drafter"], "kind": "medusa"}})

    # Another distillation's rows (distill.also) are trained on beside out_dir's, the target's
    # features over them cached beside them.
    shutil.copytree(tmp_path / "distill", tmp_path / "more" / "distill")
    rows = []
    monkeypatch.setattr(recipe.trainer, "train",
                        lambda s, config, params, batches, *a, **kw:
                        rows.append(len(batches.tokens_RxL)) or real(s, config, params, batches,
                                                                     *a, **kw))
    also = {**other, "distill": {**other["distill"], "also": [str(tmp_path / "more" / "distill")]},
            "train": {**other["train"], "workdir": str(tmp_path / "also")}}
    recipe.run_train(also)
    recipe.run_train(other | {"train": {**other["train"], "workdir": str(tmp_path / "alone")}})
    assert rows[0] == 2 * rows[1] > 0
    assert list((tmp_path / "more" / "features").glob("*/features-00000.npy"))
    with pytest.raises(UserError, match="distill.also must be a list"):
        recipe.check_config({**also, "distill": {**also["distill"], "also": "runs/x"}})
