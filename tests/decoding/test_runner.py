"""Compiled shapes do not follow the prompt: prompts are prefilled in fixed chunks, caches and
batches are padded to buckets, so new prompts reuse the compiled function. Checked by counting
compilations, never by timing."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

import jaxspec
from jaxspec.decoding import runner


@pytest.fixture(scope="module")
def model(tiny):
    return tiny.model(tiny.config(intermediate_size=40), 30, "bucketed")


def test_prompt_lengths_compile_once(model):
    """Lengths 5, 20, 40 and 100, other budgets and seeds: one compiled decode function."""
    n0 = runner.DECODER.compiles
    outs = [jaxspec.generate(model, [[i % 60 + 1 for i in range(n)]], max_new_tokens=m, seed=s)
            for n, m, s in ((5, 8, 0), (20, 30, 1), (40, 8, 2), (100, 12, 3))]
    assert runner.DECODER.compiles == n0 + 1
    assert [len(o.token_ids[0]) for o in outs] == [8, 30, 8, 12]
    assert outs[0].compile_time_s > 0 and outs[1].compile_time_s < outs[0].compile_time_s


def test_batch_pads_to_a_power_of_two(model):
    n0 = runner.DECODER.compiles
    three = jaxspec.generate(model, [[5], [6, 7], [8, 9, 10]], max_new_tokens=[4, 5, 6])
    four = jaxspec.generate(model, [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 9, 7, 9], [2, 7, 1], [8],
                                    [2, 8, 1, 8]], max_new_tokens=[5, 9, 20, 2], seed=6)
    assert runner.DECODER.compiles == n0 + 1
    assert [len(t) for t in three.token_ids] == [4, 5, 6]  # padded rows are not returned
    assert [len(t) for t in four.token_ids] == [5, 9, 20, 2]


def test_speculative_reuses_the_compiled_function(model):
    jaxspec.speculative_generate(model, jaxspec.ngram_drafter(2), [[1, 2, 1, 2, 1]], gamma=3,
                                 max_new_tokens=8)
    n = runner.DECODER.compiles
    jaxspec.speculative_generate(model, jaxspec.ngram_drafter(2), [[7, 3, 3, 7, 3, 3] * 9],
                                 gamma=3, max_new_tokens=20, seed=1)
    assert runner.DECODER.compiles == n


def test_executables_are_bounded(model):
    """The decoder keeps the most recently used executables only."""
    decoder = runner.Decoder(max_size=2)
    kw = dict(max_new_tokens=3, sampling=jaxspec.decoding.sampling.Sampling(), seed=0, stop=None,
              chat=False)
    for gamma in (1, 2, 3, 1):
        decoder(model, jaxspec.ngram_drafter(2), [[1, 2, 3]], gamma=gamma, **kw)
    assert len(decoder._compiled) == 2
    assert decoder.compiles == 4  # gamma 1 was evicted by 3, so it compiled again


_SCRIPT = textwrap.dedent("""
    import jax, jaxspec
    from jaxspec.models.params import init_params
    cfg = jaxspec.ModelConfig(arch="llama", vocab_size=64, hidden_size=32, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                              max_position=512)
    model = jaxspec.Model(cfg, init_params(cfg, jax.random.key(0), std=0.5), None, "p")
    from jaxspec.decoding import runner
    compiled, real = [], runner._compile
    runner._compile = lambda *a, **kw: compiled.append(1) or real(*a, **kw)
    print("RESULT", jaxspec.generate(model, [[1, 2, 3]], max_new_tokens=5).token_ids[0])
    print("COMPILED", len(compiled))
""")


def _run_script(env):
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    result = [line for line in lines if line.startswith("RESULT")][0]
    return result, int([line for line in lines if line.startswith("COMPILED")][0].split()[1])


def test_a_second_process_compiles_nothing_new(tmp_path):
    """The first process writes its decode loop to `$JAXSPEC_CACHE/executables`; a second one
    reads it back without tracing or compiling and decodes the same tokens; with the cache off
    every process compiles and nothing is written."""
    env = {**os.environ, "JAXSPEC_CACHE": str(tmp_path),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    first, compiled = _run_script(env)
    entries = sorted(p.name for p in (tmp_path / "executables").rglob("*.pkl"))
    assert compiled == 1 and len(entries) == 1 and entries[0].startswith("run-")
    assert _run_script(env) == (first, 0)
    assert sorted(p.name for p in (tmp_path / "executables").rglob("*.pkl")) == entries
    off = {**env, "JAXSPEC_CACHE": str(tmp_path / "off"), "JAXSPEC_COMPILATION_CACHE": "0"}
    assert _run_script(off) == (first, 1) and not (tmp_path / "off" / "executables").exists()


def test_one_row_decode_loop_writes_the_cache_in_place(tiny):
    """A plain step of one row writes one slot per layer; no compiled loop body copies a
    layer's cache. With one kv head (Gemma 3 270M) XLA turned a one-position write into a
    select and a dynamic update, then copied each cache array four times a step."""
    model = tiny.model(tiny.config(num_kv_heads=1), 31, "one-kv-head")
    runner.DECODER.clear()
    jaxspec.generate(model, [[5, 6, 7]], max_new_tokens=4)
    (hlo,) = runner.DECODER.hlo_texts()
    c = model.config
    bodies = set(re.findall(r"while\(.*body=%([\w.\-]+)", hlo))
    computations = dict(re.findall(r"^(?:ENTRY )?%([\w.\-]+) .*?\{\n(.*?)^\}", hlo, re.M | re.S))
    cache = re.compile(rf"= f32\[1,\d+,{c.num_kv_heads},{c.head_dim}\]\S* copy\(")
    assert bodies and bodies <= computations.keys()
    assert not [b for b in bodies if cache.search(computations[b])]
