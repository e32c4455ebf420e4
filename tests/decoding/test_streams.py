"""Speculative streaming (drafters/streams.py): streams through the target's top layers draft
for it, its output unchanged; trained with the heads' trainer on the target's own text."""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import sharding
from jaxspec.checkpoints import heads as ckpt_heads
from jaxspec.decoding import speculative
from jaxspec.decoding.sampling import Sampling
from jaxspec.drafters import hidden
from jaxspec.drafters.head import head_logits
from jaxspec.drafters.streams import StreamSpec
from jaxspec.errors import UserError
from jaxspec.models.cache import KVCache, init_cache
from jaxspec.models.transformer import forward
from jaxspec.training import heads, trainer
from jaxspec.training.data import Batches

CONFIGS = pathlib.Path(__file__).parents[2] / "configs"
DEPTH, TOP, STEPS = 3, 1, 200
PROMPTS = [[5, 17, 3, 22, 9], [7, 1, 40], [12, 30, 12, 30, 12, 44, 2], [60, 8]]
MAX_NEW = [20, 13, 17, 9]


@pytest.fixture(scope="module")
def cycling(tiny):
    """Two layers without attention output: the next token is a function of the last, so the
    text cycles and a stream can learn the tokens two and more places ahead."""
    t = tiny.model(tiny.config(), 0, "cycling2")
    layers = [{**lp, "wo": jnp.zeros_like(lp["wo"])} for lp in t.params["layers"]]
    return jaxspec.Model(t.config, {**t.params, "layers": layers}, None, "cycling2")


def _rows(target, n, seed):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 64, 4).tolist() for _ in range(n)]
    out = jaxspec.generate(target, prompts, max_new_tokens=24).token_ids
    examples = [(p + t, [0] * 4 + [1] * 24) for p, t in zip(prompts, out)]
    return heads.example_rows(examples, 27, 0)


@pytest.fixture(scope="module")
def trained(cycling, tmp_path_factory):
    """(drafter, workdir): streams trained STEPS steps on the target's own greedy text."""
    spec = hidden.hidden_spec("streams", cycling.config, DEPTH, options={"top": TOP})
    tokens, mask = _rows(cycling, 160, 0)
    feats = heads.target_features(cycling, tokens, tmp_path_factory.mktemp("features"),
                                  feature_layer=spec.feature_layer)
    ids = np.arange(cycling.config.vocab_size)
    shared = spec.shared(cycling.params, ids)
    head = hidden.head_params("streams", cycling.config, DEPTH, jax.random.key(0))
    s = trainer.TrainSettings(steps=STEPS, batch_size=8, seq_len=27, lr=2e-2, warmup_steps=2,
                              log_every=1, save_every=1000, mesh=(1, 1, 1))
    mesh = sharding.make_mesh(1, 1, 1)
    workdir = tmp_path_factory.mktemp("streams")
    out = trainer.train(s, cycling.config, head, Batches(tokens, mask, 8, 0, features=feats),
                        workdir, mesh=mesh, loss=heads.head_loss(spec, trainer.head_index(ids, 64)),
                        frozen=shared,
                        param_shardings=jax.tree.map(lambda _: sharding.replicated(mesh), head))
    head = trainer.host_params(out)
    return hidden.hidden_drafter(cycling, "streams", head, ids, DEPTH,
                                 options={"top": TOP}), workdir


def test_a_forward_from_a_layers_input_is_the_whole_forward(tiny):
    """`feature_layer` gives the input of that layer, and the top layers run from it (in place
    of the tokens) give the whole forward's logits: what the streams build on."""
    m = tiny.model(tiny.config(num_layers=3), 4)
    B, S = 2, 9
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 64, (B, S)))
    pos = jnp.broadcast_to(jnp.arange(S), (B, S))
    logits, _, f1 = forward(m.params, m.config, toks, pos, init_cache(m.config, B, S),
                            features=True, feature_layer=1)
    _, _, f2 = forward(m.params, m.config, toks, pos, init_cache(m.config, B, S), features=True,
                       feature_layer=2)
    top, _ = forward(m.params, m.config, None, pos, init_cache(m.config, B, S, num_layers=2),
                     layers=(1, 2), inputs_BxSxD=f1)
    np.testing.assert_allclose(top, logits, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(f1 - f2))) > 1e-2  # the layers' inputs differ


def test_the_targets_logits_are_bit_identical_with_streams_on(tiny):
    """All that streams change in the target's own forward is which layer's input it hands
    back as features: its logits and cache are the same bits (float32), and in bfloat16 its
    greedy tokens are the same."""
    for dtype in (jnp.float32, jnp.bfloat16):
        m = tiny.model(tiny.config(num_layers=3), 5)
        params = jax.tree.map(lambda p: p.astype(dtype), m.params)
        toks = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 11)))
        pos = jnp.broadcast_to(jnp.arange(11), toks.shape)
        run = functools.partial(forward, params, m.config, toks, pos,
                                init_cache(m.config, 2, 16, dtype), features=True)
        plain, with_streams = run(), run(feature_layer=2)
        for a, b in zip(jax.tree.leaves(plain[:2]), jax.tree.leaves(with_streams[:2])):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        assert float(jnp.max(jnp.abs(plain[2] - with_streams[2]))) > 1e-2  # other features


def test_gemma3s_logits_are_bit_identical_with_streams_on(gemma3):
    """The same on Gemma 3 270M (float32): its logits and cache with layer 16's input handed
    back as the features (the shipped streams' `feature_layer`) are its logits and cache."""
    ids = gemma3.tokenizer("Der Bäcker öffnet seinen Laden jeden Tag.")["input_ids"]
    toks = jnp.asarray([ids])
    pos = jnp.broadcast_to(jnp.arange(len(ids)), toks.shape)
    run = functools.partial(forward, gemma3.params, gemma3.config, toks, pos,
                            init_cache(gemma3.config, 1, 32), features=True)
    plain, with_streams = run(), run(feature_layer=16)
    for a, b in zip(jax.tree.leaves(plain[:2]), jax.tree.leaves(with_streams[:2])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_features_of_a_layer_keep_the_labels(cycling, tmp_path):
    """Prefill labels (the target's greedy next tokens) come out the same when the cached
    features are a lower layer's input (pretraining streams on any text)."""
    tokens, _ = _rows(cycling, 6, 2)
    last, labels = heads.target_features(cycling, tokens, tmp_path, labels=True)
    lower, same = heads.target_features(cycling, tokens, tmp_path, labels=True, feature_layer=1)
    np.testing.assert_array_equal(same, labels)
    np.testing.assert_array_equal(labels[:, 4:-1], tokens[:, 5:])  # its own greedy text
    assert np.abs(last.astype(np.float32) - lower.astype(np.float32)).max() > 1e-2


def test_loss_falls(trained):
    _, workdir = trained
    losses = [json.loads(ln)["loss"] for ln in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == STEPS and all(np.isfinite(losses))
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10]), losses


@pytest.mark.parametrize("rows", [1, 4], ids=["batch1", "ragged4"])
@pytest.mark.parametrize("shape", [dict(gamma=3), dict(gamma=1),
                                   dict(tree=[(0,), (1,), (0, 0), (0, 0, 0)])],
                         ids=["chain3", "chain1", "tree4"])
def test_output_is_the_targets_and_streams_are_accepted(cycling, trained, shape, rows):
    drafter, _ = trained
    ref = jaxspec.generate(cycling, PROMPTS[:rows], max_new_tokens=MAX_NEW[:rows]).token_ids
    res = jaxspec.speculative_generate(cycling, drafter, PROMPTS[:rows],
                                       max_new_tokens=MAX_NEW[:rows], **shape)
    assert res.token_ids == ref
    assert res.tau >= (1.6 if shape.get("gamma") != 1 else 1.3), res.tau


def test_untrained_streams_change_nothing(cycling):
    """Random streams are seldom accepted; the output is the target's all the same."""
    drafter = hidden.hidden_drafter(cycling, "streams", hidden.head_params(
        "streams", cycling.config, DEPTH, jax.random.key(3)), depth=DEPTH, options={"top": 2})
    ref = jaxspec.generate(cycling, PROMPTS, max_new_tokens=12).token_ids
    assert jaxspec.speculative_generate(cycling, drafter, PROMPTS, gamma=3,
                                        max_new_tokens=12).token_ids == ref


def test_teacher_forced_streams_are_the_drafted_ones(cycling, trained):
    """Training's streams of every position in one forward equal drafting's at that position
    (prefilled to it, the target's cache holding the text before it)."""
    drafter, _ = trained
    spec, V = drafter.spec, cycling.config.vocab_size
    tokens, _ = _rows(cycling, 2, 9)
    feats = forward(cycling.params, cycling.config, jnp.asarray(tokens),
                    jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
                    init_cache(cycling.config, *tokens.shape), features=True,
                    feature_layer=spec.feature_layer)[2]
    forced = spec.forced_logits(drafter.params, feats, jnp.asarray(tokens), DEPTH)
    for length in (2, 7, 20):
        T = 32
        toks = jnp.asarray(np.pad(tokens[:, :length], ((0, 0), (0, T - length))))
        state = speculative.prefill(cycling.params, cycling.config, drafter, toks,
                                    jnp.full((2,), length), jnp.full((2,), 4), jax.random.key(0))
        h = spec.streams(drafter.params, state.draft_input(V), DEPTH)
        drafted = head_logits(drafter.params["shared"], h)
        for j in range(DEPTH):
            if length - 2 < forced[j].shape[1]:
                np.testing.assert_allclose(drafted[:, j], forced[j][:, length - 2], rtol=1e-4,
                                           atol=1e-4)


def test_streams_see_neither_later_text_nor_later_streams(cycling, trained):
    """Changing the text after the streams' position, or the cache's scratch slots, leaves
    their drafts as they were; a stream's own earlier streams do matter."""
    drafter, _ = trained
    spec, V = drafter.spec, cycling.config.vocab_size
    toks = jnp.asarray([[5, 17, 3, 22, 9, 0, 0, 0, 0, 0, 0, 0]])
    state = speculative.prefill(cycling.params, cycling.config, drafter, toks, jnp.asarray([5]),
                                jnp.asarray([4]), jax.random.key(0))
    inp = state.draft_input(V)
    base = spec.streams(drafter.params, inp, DEPTH)
    junk = KVCache(tuple(k.at[:, 4:].set(7.0) for k in inp.target_cache.keys),
                   tuple(v.at[:, 4:].set(-3.0) for v in inp.target_cache.values))
    np.testing.assert_array_equal(spec.streams(drafter.params, inp.replace(target_cache=junk),
                                               DEPTH), base)
    one = spec.streams(drafter.params, inp, 1)
    np.testing.assert_allclose(one[:, 0], base[:, 0], rtol=1e-5, atol=1e-6)


def test_sampling_matches_target_distribution(small_target, exact):
    """Untrained streams through the top layer of the distribution tests' target: their drafts
    carry real but not full mass, and the output stays distributed as the target's."""
    s = Sampling(1.0)
    drafter = hidden.hidden_drafter(small_target, "streams", hidden.head_params(
        "streams", small_target.config, 2, jax.random.key(1)), depth=2, options={"top": 1})
    want, _ = exact.exact_joint(small_target, s)
    got = exact.empirical_joint(small_target, drafter, s, 2, exact.SEEDS // 2)
    assert exact.tv(got, want) < exact.TV_BOUND
    res = jaxspec.speculative_generate(small_target, drafter, [exact.PROMPT] * 256, gamma=2,
                                       max_new_tokens=2, temperature=1.0)
    assert 0.05 < res.acceptance_rate < 0.95


def test_checkpoint_round_trip_and_refusals(cycling, trained, tiny, tmp_path):
    drafter, _ = trained
    head = drafter.params["head"]
    path = ckpt_heads.save(tmp_path / "streams", "streams", head, drafter.params["vocab_ids"],
                           cycling, DEPTH, 3, extra={"options": drafter.spec.options})
    loaded = jaxspec.load_drafter(path, target=cycling)
    assert loaded.spec == StreamSpec(cycling.config, DEPTH, 3, None, top=TOP)
    for want, got in zip(jax.tree.leaves(head), jax.tree.leaves(loaded.params["head"])):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=2 ** -8)
    deeper = tiny.model(tiny.config(num_layers=3), 0, "cycling2")
    with pytest.raises(UserError, match="num_layers"):
        jaxspec.load_drafter(path, target=deeper)
    with pytest.raises(UserError, match="has 3 heads; gamma 4"):
        jaxspec.speculative_generate(cycling, drafter, PROMPTS, gamma=4, max_new_tokens=4)
    with pytest.raises(UserError, match="top 3 layers"):
        hidden.hidden_drafter(cycling, "streams", head, depth=DEPTH, options={"top": 3})


def test_recipe_takes_the_streams_layers():
    from jaxspec.config import load_yaml
    from jaxspec.training import recipe
    cfg = load_yaml(CONFIGS / "deen_gemma3_streams.yaml")
    assert cfg["drafter"]["top"] == 2
    recipe.check_config(cfg)
    with pytest.raises(UserError, match="tops"):
        recipe.check_config({**cfg, "drafter": {**cfg["drafter"], "tops": 2}})
