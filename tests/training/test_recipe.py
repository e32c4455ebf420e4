"""Recipes: every YAML preset is valid, and the tiny one runs end to end and resumes."""

import json
from pathlib import Path

import numpy as np
import pytest

import jaxspec
from jaxspec.config import load_yaml
from jaxspec.training import distill, recipe

CONFIGS = Path(__file__).parents[2] / "configs"
PRESETS = ["deen_gemma3", "fren_gemma3", "jaen_gemma3", "ruen_gemma3", "zhen_gemma3",
           "deen_smollm2", "tiny"]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_are_valid(name):
    cfg = load_yaml(CONFIGS / f"{name}.yaml")
    recipe.check_config(cfg)
    src, tgt = cfg["languages"]
    assert tgt == "en" and (name == "tiny" or name.startswith(src + "en"))
    assert set(cfg["data"]) == {"prompts", "pretrain", "eval"}
    if name != "tiny":
        assert cfg["distill"]["temperatures"] == [0.0, 0.3, 0.7, 1.0]
        assert cfg["target"] == ("smollm2-135m-instruct" if "smollm2" in name else "gemma3-270m")


def test_bad_keys_are_named():
    cfg = load_yaml(CONFIGS / "tiny.yaml", ["train.finetune.lossy=kl"])
    with pytest.raises(ValueError, match=r"unknown train settings \['lossy'\]"):
        recipe.check_config(cfg)
    cfg = load_yaml(CONFIGS / "tiny.yaml", ["data.prompts.type=csv"])
    with pytest.raises(ValueError, match="data.prompts: type must be one of"):
        recipe.check_config(cfg)
    with pytest.raises(ValueError, match=r"drafter.config: unknown keys \['width'\]"):
        recipe.check_config(load_yaml(CONFIGS / "tiny.yaml", ["drafter.config.width=3"]))


def test_numbers_in_exponent_form_are_numbers(tmp_path):
    # PyYAML reads "3e-4" (no dot) as text, and the optimizer then failed on a string lr.
    (tmp_path / "c.yaml").write_text("train: {lr: 1e-3, steps: 10}\n")
    cfg = load_yaml(tmp_path / "c.yaml", ["train.warmup=2E+1", "name=1e-3x", "n=12"])
    assert cfg["train"] == {"lr": 1e-3, "steps": 10, "warmup": 20.0}
    assert cfg["name"] == "1e-3x" and cfg["n"] == 12 and isinstance(cfg["n"], int)
    assert load_yaml(None, ["train.lr=3e-4"])["train"]["lr"] == 3e-4


def test_tiny_recipe_end_to_end_and_resume(tmp_path):
    cfg = load_yaml(CONFIGS / "tiny.yaml", [f"distill.out_dir={tmp_path / 'distill'}",
                                            f"train.workdir={tmp_path / 'train'}"])
    out = recipe.run_distill(cfg)
    records = distill.read_distilled(out)
    assert {r["temperature"] for r in records} == {0.0, 1.0}
    assert all(r["prompt"].startswith("Translate German to English:") for r in records)

    runs = []  # each stage's tau run (step 2 of 2), kept to recompute tau from it

    def spy(target, drafter, prompts, **kw):
        runs.append((prompts, kw, jaxspec.speculative_generate(target, drafter, prompts, **kw)))
        return runs[-1][2]

    path = recipe.run_train(cfg, speculative_fn=spy)
    drafter = jaxspec.load(path)
    assert drafter.config.num_layers == 1 and drafter.config.head_vocab_size == 128
    vocab_ids = jaxspec.load_drafter(path).params["vocab_ids"]
    assert len(vocab_ids) == 128 and 2 in vocab_ids  # EOS always in the head
    target = recipe.load_target(cfg["target"])
    assert len(runs) == 2
    for stage, (prompts, kw, res) in zip(("pretrain", "finetune"), runs):
        logged = [json.loads(ln) for ln in
                  (tmp_path / "train" / stage / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in logged if "loss" in r] == [1, 2]
        # The logged tau is new tokens per verification step of a greedy run with the eval
        # settings, whose output is the target's own.
        assert kw["gamma"] == 3 and kw["max_new_tokens"] == 8 and kw["temperature"] == 0
        greedy = jaxspec.generate(target, prompts, max_new_tokens=8, chat=kw["chat"])
        assert len(prompts) == 2 and res.token_ids == greedy.token_ids
        gains = [a for row in res.accept_lengths for a in row]
        assert sum(gains) == sum(map(len, res.token_ids)) and max(gains) <= 4
        assert [r["tau"] for r in logged if "tau" in r] == [pytest.approx(np.mean(gains))]
    # The finetuned drafter is the target's first layer after 4 steps: close, not equal.
    assert not np.array_equal(drafter.params["layers"][0]["wq"], target.params["layers"][0]["wq"])

    # A rerun finds both stages finished and its source texts cached: it generates nothing and
    # saves the same drafter.
    def no_generate(*args, **kw):
        raise AssertionError("a rerun generated text again")

    again = jaxspec.load(recipe.run_train(cfg, generate_fn=no_generate))
    np.testing.assert_array_equal(again.params["lm_head"], drafter.params["lm_head"])


def test_distill_rerun_reuses_its_prompts_and_template(tmp_path):
    calls = []
    real = jaxspec.generate

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    overrides = [f"distill.out_dir={tmp_path / 'distill'}", "template=Q: {prompt} A:"]
    cfg = load_yaml(CONFIGS / "tiny.yaml", overrides)
    out = recipe.run_distill(cfg, generate_fn=counting)
    first = len(calls)
    cached = json.loads((out / "prompts.json").read_text())["items"]
    assert cached and all(p.startswith("Q: Translate German to English:") and p.endswith(" A:")
                          for p in cached)
    # Every shard exists and the source text is cached: a rerun generates nothing.
    recipe.run_distill(cfg, generate_fn=counting)
    assert len(calls) == first
    # A different template is a different prompt set: not served from the cache.
    changed = load_yaml(CONFIGS / "tiny.yaml", [*overrides, "template={prompt} =>"])
    assert recipe._cached_prompts(changed, recipe.load_target(cfg["target"]), counting)[0] \
        .endswith(" =>")


def test_frozen_embedding_is_stored_as_a_reference_to_the_target(tmp_path):
    from jaxspec.checkpoints import store

    tiny = load_yaml(CONFIGS / "tiny.yaml")
    target = recipe.load_target(tiny["target"])
    store.save(tmp_path / "target", target.params, target.config, target.tokenizer)
    cfg = load_yaml(CONFIGS / "tiny.yaml", [
        f"target={tmp_path / 'target'}", f"distill.out_dir={tmp_path / 'distill'}",
        f"train.workdir={tmp_path / 'train'}", "train.freeze=[embed]", "train.pretrain.steps=0"])
    recipe.run_distill(cfg)
    path = recipe.run_train(cfg)
    assert store.read_meta(path)["embed_from"] == str(tmp_path / "target")
    drafter = jaxspec.load(path)
    np.testing.assert_array_equal(drafter.params["embed"], target.params["embed"])
    assert not np.array_equal(drafter.params["layers"][0]["wq"], target.params["layers"][0]["wq"])
    # The checkpoint holds no embedding of its own.
    stored = sum(f.stat().st_size for f in (path / "params").rglob("*") if f.is_file())
    assert stored < np.asarray(target.params["embed"]).nbytes + 200_000
