"""Self-distillation shards: content, exact resume after a kill, settings pinned by a manifest."""

import json

import jax
import pytest

import jaxspec
from jaxspec.config import ModelConfig
from jaxspec.models.model import Model
from jaxspec.models.params import init_params
from jaxspec.training import data, distill


@pytest.fixture(scope="module")
def worker(helper):
    return helper("_distill_worker")


def _files(out_dir):
    return {p.name: p.read_text() for p in sorted(out_dir.glob("*.jsonl"))}


def test_shards_hold_every_prompt_at_every_temperature(tmp_path, worker):
    worker.run(tmp_path)
    assert sorted(_files(tmp_path)) == [f"t{t}-b{b:06d}.jsonl" for t in (0, 1) for b in range(5)]
    records = distill.read_distilled(tmp_path)
    assert [(r["temperature"], r["id"]) for r in records] == [
        (t, i) for t in (0.0, 0.7) for i in range(20)]
    r = records[3]
    assert r["prompt"] == worker.PROMPTS[3]
    assert r["prompt_ids"] == data.byte_tokenizer()(worker.PROMPTS[3]).input_ids
    assert r["num_tokens"] == len(r["response_ids"]) >= 1
    assert r["response"] == data.byte_tokenizer().decode(r["response_ids"])
    # Each shard has its own seed: the same prompt differs across temperatures and blocks.
    assert records[0]["response_ids"] != records[20]["response_ids"]


def test_rerun_generates_only_missing_shards(tmp_path, worker):
    worker.run(tmp_path)
    before = _files(tmp_path)
    (tmp_path / "t1-b000003.jsonl").unlink()
    calls = []

    def counting(*args, **kw):
        calls.append(args[1])
        return worker.fake_generate(*args, **kw)

    distill.distill(worker.tiny_target(), worker.PROMPTS, tmp_path, temperatures=(0.0, 0.7),
                    max_new_tokens=6, block_size=4, batch_size=2, seed=11, generate_fn=counting)
    assert _files(tmp_path) == before
    assert len(calls) == 2 and sum(len(c) for c in calls) == 4  # one block of 4, batches of 2


def test_killed_job_resumes_without_duplicates_or_gaps(tmp_path, worker, procs):
    reference = tmp_path / "reference"
    worker.run(reference)
    out = tmp_path / "killed"
    proc = procs.start("_distill_worker", out, "--sleep", 0.4)
    procs.kill_when(proc, lambda: len(list(out.glob("*.jsonl"))) >= 2)
    assert 2 <= len(list(out.glob("*.jsonl"))) < 10
    with pytest.raises(FileNotFoundError, match="shards missing"):
        distill.read_distilled(out)
    procs.finish(procs.start("_distill_worker", out))
    assert _files(out) == _files(reference)
    records = distill.read_distilled(out)
    keys = [(r["temperature"], r["id"]) for r in records]
    assert len(keys) == len(set(keys)) == 40


def test_changed_settings_are_refused(tmp_path, worker):
    worker.run(tmp_path)
    with pytest.raises(ValueError, match=r"other settings \(\['max_new_tokens'\]\)"):
        distill.distill(worker.tiny_target(), worker.PROMPTS, tmp_path, temperatures=(0.0, 0.7),
                        max_new_tokens=7, block_size=4, batch_size=2, seed=11,
                        generate_fn=worker.fake_generate)


def test_processes_split_the_shards(tmp_path, worker):
    for pid in (0, 1):
        distill.distill(worker.tiny_target(), worker.PROMPTS, tmp_path, temperatures=(0.0, 0.7),
                        max_new_tokens=6, block_size=4, batch_size=2, seed=11,
                        generate_fn=worker.fake_generate, process_index=pid, process_count=2)
        if pid == 0:
            assert len(_files(tmp_path)) == 5
    worker.run(tmp_path / "single")
    assert _files(tmp_path) == _files(tmp_path / "single")


def test_real_generate_on_a_tiny_model_resumes_exactly(tmp_path):
    config = ModelConfig(arch="llama", vocab_size=264, hidden_size=32, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64, max_position=128,
                         eos_token_ids=(2,))
    target = Model(config, init_params(config, jax.random.key(0)), data.byte_tokenizer())
    prompts = ["Translate German to English:Hallo.", "Translate German to English:Ja.",
               "Translate German to English:Danke schön."]
    kw = dict(temperatures=(0.0, 1.0), max_new_tokens=5, block_size=2, batch_size=2, seed=3,
              generate_fn=jaxspec.generate)
    distill.distill(target, prompts, tmp_path, **kw)
    before = _files(tmp_path)
    (tmp_path / "t1-b000000.jsonl").unlink()
    distill.distill(target, prompts, tmp_path, **kw)
    assert _files(tmp_path) == before
    records = distill.read_distilled(tmp_path)
    assert len(records) == 6 and all(1 <= r["num_tokens"] <= 5 for r in records)
    greedy = jaxspec.generate(target, prompts, max_new_tokens=5)
    assert [r["response_ids"] for r in records[:3]] == greedy.token_ids
    assert json.loads((tmp_path / "manifest.json").read_text())["temperatures"] == [0.0, 1.0]


def test_stop_token_ends_each_response(tmp_path):
    config = ModelConfig(arch="llama", vocab_size=264, hidden_size=32, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64, max_position=128,
                         eos_token_ids=(2,))
    target = Model(config, init_params(config, jax.random.key(0)), data.byte_tokenizer())
    prompts = ["Translate German to English:Hallo.", "Translate German to English:Danke."]
    free = jaxspec.generate(target, prompts, max_new_tokens=12)
    stop_id = free.token_ids[0][3]  # a token the first row emits: it must end there
    stop = target.tokenizer.decode([stop_id])
    distill.distill(target, prompts, tmp_path, temperatures=(0.0,), max_new_tokens=12,
                    block_size=2, batch_size=2, stop=stop)
    first = distill.read_distilled(tmp_path)[0]["response_ids"]
    assert first == free.token_ids[0][:free.token_ids[0].index(stop_id) + 1]


def test_shards_read_back_text_holding_unicode_line_breaks(tmp_path):
    """Shards keep text raw (ensure_ascii off); U+2028 and U+0085, which `str.splitlines` breaks
    at, must not split a record (a German source sentence the target wrote held U+2028)."""
    config = ModelConfig(arch="llama", vocab_size=264, hidden_size=32, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64, max_position=128)
    target = Model(config, init_params(config, jax.random.key(0)), data.byte_tokenizer())
    prompts = ["Bedeutung \u2028.", "Ende\x85 gut", "plain"]
    distill.distill(target, prompts, tmp_path, temperatures=(0.0,), max_new_tokens=3,
                    block_size=3, batch_size=3)
    assert [r["prompt"] for r in distill.read_distilled(tmp_path)] == prompts
    jsonl = tmp_path / "texts.jsonl"
    jsonl.write_text("".join(json.dumps({"text": p}, ensure_ascii=False) + "\n" for p in prompts),
                     encoding="utf-8")
    assert [r["text"] for r in data.read_text(jsonl)] == prompts
