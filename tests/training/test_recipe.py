"""Recipes: every YAML preset is valid, and the tiny one runs end to end and resumes."""

import json
from pathlib import Path

import numpy as np
import pytest

import jaxspec
from jaxspec.config import load_yaml
from jaxspec.training import distill, drafter_init, recipe

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


def test_tiny_recipe_end_to_end_and_resume(tmp_path):
    cfg = load_yaml(CONFIGS / "tiny.yaml", [f"distill.out_dir={tmp_path / 'distill'}",
                                            f"train.workdir={tmp_path / 'train'}"])
    out = recipe.run_distill(cfg)
    records = distill.read_distilled(out)
    assert {r["temperature"] for r in records} == {0.0, 1.0}
    assert all(r["prompt"].startswith("Translate German to English:") for r in records)

    path = recipe.run_train(cfg)
    drafter = jaxspec.load(path)
    assert drafter.config.num_layers == 1 and drafter.config.head_vocab_size == 128
    vocab_ids = drafter_init.load_vocab_ids(path)
    assert len(vocab_ids) == 128 and 2 in vocab_ids  # EOS always in the head
    for stage in ("pretrain", "finetune"):
        logged = [json.loads(ln) for ln in
                  (tmp_path / "train" / stage / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in logged if "loss" in r] == [1, 2]
        assert [r["tau"] >= 1 for r in logged if "tau" in r] == [True]
    # The finetuned drafter is the target's first layer after 4 steps: close, not equal.
    target = recipe.load_target(cfg["target"])
    assert not np.array_equal(drafter.params["layers"]["wq"], target.params["layers"]["wq"][:1])

    # A rerun finds both stages finished and saves the same drafter.
    again = jaxspec.load(recipe.run_train(cfg))
    np.testing.assert_array_equal(again.params["lm_head"], drafter.params["lm_head"])
