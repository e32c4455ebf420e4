"""Continuous batching in `distill`: finished rows' slots take the next prompts. The records equal
those of one prompt at a time (each starting from the keys and values of the prompts' shared
template, computed once), three compiled functions serve every refill, sampled records do not
depend on the batch size, and a killed run resumes to the same shards."""

import io
import types

import numpy as np
import pytest

import jaxspec
from jaxspec.decoding import api, runner
from jaxspec.training import distill


@pytest.fixture(scope="module")
def worker(helper):
    return helper("_distill_refill_worker")


@pytest.fixture(scope="module")
def target(worker):
    return worker.tiny_target()


@pytest.fixture
def decoder(monkeypatch):
    """A fresh decoder for `distill`, so its compilations can be counted from zero."""
    fresh = runner.Decoder()
    monkeypatch.setattr(runner, "DECODER", fresh)
    return fresh


def _files(out_dir):
    return {p.name: p.read_text() for p in sorted(out_dir.glob("*.jsonl"))}


def test_refilled_greedy_equals_one_prompt_at_a_time(tmp_path, worker, target, decoder):
    kw = dict(temperatures=(0.0,), max_new_tokens=24, block_size=5, batch_size=4,
              stop=worker.STOP)
    distill.distill(target, worker.PROMPTS, tmp_path / "a", **kw)
    # 13 prompts through 4 slots, refilled one at a time (refill size 4 // 8 -> 1): one prefill
    # per prompt, and decoding stopped for refills many times; still one compiled shared
    # prefix, one compiled prefill and one compiled decode loop.
    stats = dict(decoder.stream_stats)
    assert stats["prefill_calls"] == len(worker.PROMPTS) and stats["decode_calls"] >= 5
    assert decoder.compiles == 3
    ids = [target.tokenizer(p).input_ids for p in worker.PROMPTS]
    assert runner._shared_prefix(ids) >= len("Translate German to English:")  # byte tokens

    records = distill.read_distilled(tmp_path / "a")
    assert [r["id"] for r in records] == list(range(len(worker.PROMPTS)))
    lengths = [r["num_tokens"] for r in records]
    assert min(lengths) < 6 and max(lengths) == 24 and len(set(lengths)) >= 5  # stop at all steps
    for r, prompt in zip(records, worker.PROMPTS):
        alone = jaxspec.generate(target, [prompt], max_new_tokens=24, stop=worker.STOP)
        assert r["prompt"] == prompt and r["prompt_ids"] == target.tokenizer(prompt).input_ids
        assert r["response_ids"] == alone.token_ids[0] and r["response"] == alone.texts[0]

    # Other prompts (other lengths, in the same cache bucket): nothing new to compile.
    n = decoder.compiles
    others = [p + " Bitte." for p in worker.PROMPTS[::-1]]
    distill.distill(target, others, tmp_path / "b", **kw)
    assert decoder.compiles == n


def test_stream_is_independent_of_batch_and_refill_sizes(worker, target):
    """Two slots refilled one at a time, stopping after every step; and more slots than prompts,
    three prompts prefilled per group, four steps per call."""
    seeds = np.arange(len(worker.PROMPTS)) * 7919
    runs = []
    for batch_size, refill_size, max_steps in ((2, 1, 1), (16, 3, 4)):
        stream = api.stream_generate(target, worker.PROMPTS, seeds, batch_size=batch_size,
                                        max_new_tokens=16, temperature=1.0, stop=worker.STOP,
                                        refill_size=refill_size, max_steps=max_steps)
        runs.append(dict(stream))
    assert sorted(runs[0]) == list(range(len(worker.PROMPTS)))
    assert runs[0] == runs[1]


def test_sampled_distillation_is_the_same_for_any_batch_size(tmp_path, worker):
    for batch_size in (2, 5):
        worker.run(tmp_path / f"b{batch_size}", batch_size=batch_size)
    assert _files(tmp_path / "b2") == _files(tmp_path / "b5")
    records = distill.read_distilled(tmp_path / "b2")
    greedy, sampled = records[:13], records[13:]
    assert [r["temperature"] for r in sampled] == [1.0] * 13
    assert [r["response_ids"] for r in greedy] != [r["response_ids"] for r in sampled]


def test_killed_run_resumes_to_the_same_shards(tmp_path, worker, procs):
    reference = tmp_path / "reference"
    worker.run(reference)
    assert len(_files(reference)) == 8  # 2 temperatures x 4 blocks
    out = tmp_path / "killed"
    proc = procs.start("_distill_refill_worker", out, "--sleep", 1.0)
    procs.kill_when(proc, lambda: len(list(out.glob("*.jsonl"))) >= 2)
    assert 2 <= len(_files(out)) < 8
    procs.finish(procs.start("_distill_refill_worker", out))
    assert _files(out) == _files(reference)


def test_a_fixed_batch_distillation_is_not_resumed_with_other_samples(tmp_path, worker):
    """Sampled shards of the fixed-batch path (a generate_fn) used other seeds: the manifest
    refuses to mix them with continuously batched ones; greedy shards mix."""
    def fixed(model, prompts, **kw):
        return types.SimpleNamespace(token_ids=[[70]] * len(prompts), texts=["C"] * len(prompts))

    worker.run(tmp_path, generate_fn=fixed)
    with pytest.raises(ValueError, match=r"other settings \(\['sampling_keys'\]\)"):
        worker.run(tmp_path)
    # Greedy output is the same either way: a greedy distillation resumes.
    worker.run(tmp_path / "greedy", generate_fn=fixed, temperatures=(0.0,), block_size=13)
    (tmp_path / "greedy" / "t0-b000000.jsonl").unlink()
    worker.run(tmp_path / "greedy", temperatures=(0.0,), block_size=13)
    assert len(distill.read_distilled(tmp_path / "greedy")) == 13


def test_distill_speed_reports_tokens_and_the_products_share(worker, target, decoder):
    from jaxspec.bench import distill_speed

    printed = io.StringIO()
    (row,) = distill_speed.measure(target, worker.PROMPTS, [4], max_new_tokens=8, stop=None,
                                   profile=True, out=printed)
    assert 0 < row["tokens"] <= 8 * len(worker.PROMPTS) and row["tokens_per_s"] > 0
    assert "matrix products" in printed.getvalue()
    assert 0.0 < row["ops"]["product_share"] < 1.0
    # Prefill labels count every prompt token they label.
    ids = runner.encode_prompts(target, list(worker.PROMPTS), False)
    (row,) = distill_speed.measure(target, worker.PROMPTS, [4], modes=("labels",), out=printed)
    assert row["tokens"] == sum(map(len, ids)) and row["tokens_per_s"] > 0


def test_the_shared_prefix_leaves_every_prompt_a_token_of_its_own():
    assert runner._shared_prefix([[1, 2, 3], [1, 2, 4, 5]]) == 2
    assert runner._shared_prefix([[1, 2], [1, 2, 3]]) == 1
    assert runner._shared_prefix([[5, 1], [6, 1]]) == 0
    assert runner._shared_prefix([[7, 8, 9]]) == 2
