"""The scaling figure's inputs: the drafter at each finetuning checkpoint and the tokens it saw."""

import json
from pathlib import Path

import numpy as np
import pytest

import jaxspec
from jaxspec.bench import scaling
from jaxspec.config import load_yaml
from jaxspec.training import drafter_init, recipe

CONFIGS = Path(__file__).parents[2] / "configs"


def test_scaling_rows_follow_the_recipe_checkpoints(tmp_path, recording):
    # Finetuning with ce over a full head: every response token is a logged target.
    cfg = load_yaml(CONFIGS / "tiny.yaml", [f"distill.out_dir={tmp_path / 'distill'}",
                                            f"train.workdir={tmp_path / 'train'}",
                                            "train.eval_every=0", "train.finetune.loss=ce",
                                            "drafter.head_vocab_size=null"])
    recipe.run_distill(cfg)
    saved = jaxspec.load(recipe.run_train(cfg))
    target = recipe.load_target(cfg["target"])

    logged = [json.loads(ln) for ln in
              (tmp_path / "train" / "finetune" / "metrics.jsonl").read_text().splitlines()]
    seen = scaling.response_tokens(cfg, target.config.pad_token_id, [2])
    assert seen[1] == logged[0]["targets"] > 0
    assert seen[2] == logged[0]["targets"] + logged[1]["targets"]

    # Step 0 is the pretrained drafter, not the initialisation; the last step is the saved one.
    _, init = drafter_init.from_target(target.config, target.params, 1)
    _, before, _ = scaling.drafter_at(cfg, target, 0)
    _, after, _ = scaling.drafter_at(cfg, target, 2)
    assert not np.allclose(before["layers"][0]["wq"], init["layers"][0]["wq"])
    assert not np.allclose(before["layers"][0]["wq"], after["layers"][0]["wq"])
    np.testing.assert_array_equal(after["layers"][0]["wq"], saved.params["layers"][0]["wq"])

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "deen",
                                             "turns": [f"Translate German to English:{t}"]}) + "\n"
                                 for i, t in enumerate(["Guten Morgen", "Danke schön"])))
    greedy = recording("generate")
    spec = recording("speculative_generate")
    rows = scaling.measure(cfg, str(questions), limit=2, gamma=2, max_new_tokens=6)
    assert [r["step"] for r in rows] == [0, 2]
    assert [r["finetune_tokens"] for r in rows] == [0, seen[2]]
    # Each row: two prompts, their speculative runs against the greedy ones; tau is new tokens
    # per verification step over both, recomputed here from the runs themselves.
    assert len(greedy) == 2 and len(spec) == 4
    for r, runs in zip(rows, (spec[:2], spec[2:])):
        assert r["identical"] and [o.token_ids for o in runs] == [g.token_ids for g in greedy]
        gains = [a for o in runs for a in o.accept_lengths[0]]
        assert sum(gains) == sum(len(o.token_ids[0]) for o in runs) and max(gains) <= 3
        assert r["tau"] == pytest.approx(np.mean(gains))
    assert max(r["tau"] for r in rows) > 1  # drafts are accepted somewhere
