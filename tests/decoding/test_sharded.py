"""Decoding over a mesh: 8 simulated CPU devices (in a subprocess, since the device count is
fixed when JAX starts) and two cooperating processes give the tokens of one device; params and
caches are really split; distillation over 8 devices writes the same shards; bad meshes and
plans that do not fit are refused clearly. The memory planner runs here on abstract meshes."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from jaxspec import sharding
from jaxspec.decoding import memory, runner
from jaxspec.decoding.sampling import Sampling
from jaxspec.errors import UserError
from jaxspec.models.cache import storage_dtype

WORKER = Path(__file__).with_name("_sharded_worker.py")


def _start(*args, devices: int) -> subprocess.Popen:
    """The worker on `devices` CPU devices; XLA optimises less, since compiling (one function
    per case) is most of its time."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXSPEC_COMPILATION_CACHE="0",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                         f"--xla_backend_optimization_level=0 "
                         f"--xla_llvm_disable_expensive_passes=true")
    return subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> None:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{out[-4000:]}"


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "meshes.json"
    _finish(_start(out, "meshes", devices=8))
    return json.loads(out.read_text())


def test_every_mesh_decodes_the_tokens_of_one_device(meshes):
    ref = meshes["ref"]
    assert len(meshes["mesh"]) == 8
    assert sum(len(runs) for runs in meshes["mesh"].values()) == 4 + 2 * 2 + 1 + 3 + 4 + 2 + 1
    for mesh, runs in meshes["mesh"].items():
        assert runs, mesh
        for case, tokens in runs.items():
            assert [len(t) for t in tokens] == [10, 10, 10], (mesh, case)
            assert tokens == ref[case], (mesh, case)
    # The cases differ: sampling is not greedy, Gemma is not Llama.
    assert ref["llama/model/1.0"] != ref["llama/model/0.0"] != ref["gemma/model/0.0"]


def test_params_and_caches_are_split(meshes):
    """(2,1,4): heads, kv heads, MLP and vocabulary over tensor (4), rows over data (2)."""
    s = meshes["shardings"]
    assert s["wq"]["shape"] == [16, 4, 32] and s["wq"]["shard"] == [4, 4, 32]
    assert s["wk"]["shard"] == [2, 4, 32]
    assert s["w_down"]["shard"] == [32, 16]
    assert s["embed"]["shard"] == [16, 32]  # the tied output head, split by vocabulary
    for cache in ("cache", "drafter_cache"):
        assert s[cache]["shape"] == [8, 64, 8, 4]
        assert s[cache]["shard"] == [4, 64, 2, 4], cache
        assert "tensor" in s[cache]["spec"] and "data" in s[cache]["spec"]
    assert s["tokens"]["shard"] == [4, 64]


def test_load_puts_a_checkpoint_onto_the_mesh(meshes):
    loaded = meshes["loaded"]
    assert loaded["wq"] == "('tensor', None, 'fsdp')" and loaded["wq_shard"] == [2, 4, 32]
    assert loaded["tokens"] == meshes["ref"]["llama/ar/0.0"]


def test_bad_meshes_are_refused_clearly(meshes):
    e = meshes["errors"]
    assert "tensor (size 8) do not divide" in e["kv_heads"]
    assert "num_kv_heads=4" in e["kv_heads"] and "'kv_heads': None" in e["kv_heads"]
    assert e["axis"] == ("rule 'mlp' -> 'model': the mesh has no axis 'model' (its axes: data, "
                         "fsdp, tensor)")
    assert "the mesh has no axis 'tp'" in e["load_axis"]


def test_distillation_over_8_devices_writes_the_same_shards(meshes):
    one, mesh = meshes["distill"]["one"], meshes["distill"]["mesh"]
    assert sorted(one) == [f"t0-b00000{b}.jsonl" for b in range(3)]
    assert mesh == one
    records = [json.loads(ln) for ln in one["t0-b000000.jsonl"].splitlines()]
    assert len(records) == 4 and records[0]["prompt_ids"] == records[3]["prompt_ids"]
    assert records[0]["response_ids"] != records[3]["response_ids"]  # sampled, own keys


def test_two_processes_decode_together(tmp_path, meshes):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    out = tmp_path / "pair.json"
    procs = [_start(out, "pair", f"{port},2,{pid}", devices=4) for pid in (0, 1)]
    for p in procs:
        _finish(p)
    p0, p1 = (json.loads((tmp_path / f"pair-p{pid}.json").read_text()) for pid in (0, 1))
    assert p0["devices"] == 8 and p0["local"] == 4
    assert p0["tokens"] == p1["tokens"]
    for case, tokens in p0["tokens"].items():
        assert tokens == meshes["ref"][case], case


LLAMA_7B = memory.SHAPES["llama-7b"]


def test_memory_plan_splits_by_the_mesh():
    one = memory.plan(LLAMA_7B, batch=8, cache_len=2048, dtype="bfloat16",
                      mesh=AbstractMesh((1, 1, 1), sharding.MESH_AXES))
    tensor8 = memory.plan(LLAMA_7B, batch=8, cache_len=2048, dtype="bfloat16",
                          mesh=AbstractMesh((1, 1, 8), sharding.MESH_AXES))
    data8 = memory.plan(LLAMA_7B, batch=8, cache_len=2048, dtype="bfloat16",
                        mesh=AbstractMesh((8, 1, 1), sharding.MESH_AXES))
    n_params = 32000 * 4096 + 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 4096
    assert one.params == 2 * n_params  # bf16, tied head
    item = storage_dtype(jnp.bfloat16).itemsize  # the weights' precision, as this backend stores it
    cache = 8 * 2048 * 32 * 4096 * 2 * item  # rows, slots, layers, kv heads x head dim, k+v
    assert cache <= one.state < 1.01 * cache
    assert one.params / 8 < tensor8.params < one.params / 7.99  # norms are replicated
    rest = one.state - cache  # token buffer, logs, key: split over rows, not over tensor
    assert tensor8.state == cache // 8 + rest
    assert data8.params == one.params and abs(data8.state * 8 - one.state) <= 8 * 8  # key
    assert 0 < tensor8.activations < one.activations
    # A layer-skip drafter shares the params and adds a cache for its layers.
    skip = memory.plan(LLAMA_7B, batch=8, cache_len=2048, dtype="bfloat16",
                       mesh=AbstractMesh((1, 1, 8), sharding.MESH_AXES),
                       drafter=memory._abstract_drafter("layerskip:16-31", LLAMA_7B, "bfloat16"))
    assert skip.params == tensor8.params and skip.state > 1.45 * tensor8.state


def test_memory_plan_refuses_what_does_not_fit():
    mesh = AbstractMesh((1, 1, 1), sharding.MESH_AXES)
    p = memory.plan(LLAMA_7B, batch=8, cache_len=2048, mesh=mesh, dtype="bfloat16")
    with pytest.raises(UserError, match=r"the params alone exceed it: split them over more "
                                        r"devices \(a larger tensor or fsdp mesh axis\)"):
        memory.check(p, 8 * memory.GiB)
    with pytest.raises(UserError, match=r"decode at most (\d) rows per call \(now 8\)") as e:
        memory.check(p, 20 * memory.GiB)
    fit = int(e.value.args[0].split("at most ")[1].split()[0])
    assert fit >= 1
    memory.check(memory.plan(LLAMA_7B, batch=fit, cache_len=2048, mesh=mesh, dtype="bfloat16"),
                 20 * memory.GiB)
    with pytest.raises(UserError, match="the mesh has no axis 'model'"):
        memory.plan(LLAMA_7B, batch=1, cache_len=64, mesh=mesh,
                    rules={**sharding.RULES, "heads": "model"})


def test_memory_table_cli(capsys):
    memory.main(["llama-7b", "--mesh", "1,1,1", "--mesh", "1,1,8", "--batch", "1",
                 "--cache-len", "512", "--device-memory", "8"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("| model | mesh") and len(rows) == 4
    assert "| llama-7b | 1,1,1 | 12.307 GiB |" in rows[2] and "| no: " in rows[2]
    assert rows[3].startswith("| llama-7b | 1,1,8 | 1.539 GiB |") and rows[3].endswith("| yes |")


def test_decoder_checks_the_plan_before_compiling(monkeypatch, tiny):
    """Where the device reports its memory, a decode that cannot fit is refused up front."""
    target = tiny.model(tiny.config(), 0)
    monkeypatch.setattr(memory, "device_bytes", lambda: 1 << 16)
    with pytest.raises(UserError, match=r"decoding needs .* but a device holds 0.00 GiB"):
        runner.Decoder()(target, None, [[1, 2, 3]], gamma=0, max_new_tokens=2,
                         sampling=Sampling(), seed=0, stop=None, chat=False)
    monkeypatch.setattr(memory, "device_bytes", lambda: 1 << 30)
    assert len(runner.Decoder()(target, None, [[1, 2, 3]], gamma=0, max_new_tokens=2,
                                sampling=Sampling(), seed=0, stop=None, chat=False
                                ).token_ids[0]) == 2
