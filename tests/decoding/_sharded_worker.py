"""Subprocess worker for the sharded decoding tests (JAX on several CPU devices).

    python _sharded_worker.py OUT.json meshes            # one process, 8 devices
    python _sharded_worker.py OUT.json pair PORT,2,PID   # one of two processes (4 devices each)

`meshes` decodes tiny Llama and Gemma 3 models with every method on one device (the reference)
and over meshes of 8 devices, and records the output tokens, the shardings of params and caches,
the errors of bad meshes, and the shards of a distillation over one device and over 8. `pair`
decodes over a (2,1,4) mesh spanning two processes. The test asserts on the JSON written.
Each case compiles its own decode function (seconds on CPU): the cases are few and chosen.
"""

import functools
import json
import sys
from pathlib import Path

import jax
import numpy as np

import jaxspec
from jaxspec import sharding
from jaxspec.decoding import speculative, trees
from jaxspec.drafters import hidden
from jaxspec.errors import UserError
from jaxspec.loading import shard
from jaxspec.models.model import Model
from jaxspec.models.params import param_shapes

LLAMA = jaxspec.ModelConfig(arch="llama", vocab_size=64, hidden_size=32, num_layers=2,
                            num_heads=16, num_kv_heads=8, head_dim=4, intermediate_size=64,
                            max_position=512)
GEMMA = jaxspec.ModelConfig(arch="gemma3", vocab_size=64, hidden_size=32, num_layers=2,
                            num_heads=8, num_kv_heads=4, head_dim=8, intermediate_size=64,
                            max_position=512, layer_types=("sliding", "full"),
                            sliding_window=4, query_scale=0.3, rope_local_theta=100.0)
PROMPTS = [[4, 8, 15, 16, 23, 42, 4, 8, 15], [9, 1], [5, 6, 7, 5, 6]]
NEW = 10


@functools.cache
def models(config, seed):
    """(target, near drafter): numpy-drawn std 0.5 weights, so greedy decoding has no near-ties;
    the drafter adds 5% noise."""
    rng = np.random.default_rng(seed)
    draw = lambda path, shape: (np.ones(shape, np.float32) if path[-1].key.endswith("norm")  # noqa
                                else rng.normal(0, 0.5, shape).astype(np.float32))
    params = jax.tree.map_with_path(draw, param_shapes(config),
                                    is_leaf=lambda x: isinstance(x, tuple))
    noisy = jax.tree.map(lambda p: p + 0.025 * rng.normal(size=p.shape).astype(np.float32)
                         if p.ndim > 1 else p, params)
    return Model(config, params, None, "t"), Model(config, noisy, None, "d")


def decode(target, drafter, method, temperature=0.0):
    """Token ids of one method: ar, model, layerskip, ngram, eagle (a hidden-state head), tree
    (the model drafter over a token tree) or auto (it with gamma "auto")."""
    kw = dict(max_new_tokens=NEW, temperature=temperature, seed=5)
    if method == "ar":
        return jaxspec.generate(target, PROMPTS, **kw).token_ids
    if method == "auto":
        return jaxspec.speculative_generate(target, jaxspec.model_drafter(drafter), PROMPTS,
                                            gamma="auto", gamma_max=3,
                                            costs=(1.0, 1.05, 1.1, 1.15), **kw).token_ids
    if method == "tree":
        return jaxspec.speculative_generate(target, jaxspec.model_drafter(drafter), PROMPTS,
                                            tree=[(0,), (1,), (0, 0), (1, 0)], **kw).token_ids
    d = {"model": lambda: jaxspec.model_drafter(drafter),
         "layerskip": lambda: jaxspec.layer_skip_drafter(target, [1]),
         "ngram": lambda: jaxspec.ngram_drafter(2),
         "eagle": lambda: hidden.hidden_drafter(target, "eagle", hidden.head_params(
             "eagle", target.config, 4, jax.random.key(8), target.params))}[method]()
    return jaxspec.speculative_generate(target, d, PROMPTS, gamma=3, **kw).token_ids


def mesh_of(dims):
    return sharding.make_mesh(*dims, devices=jax.devices()[:int(np.prod(dims))])


def runs(cases, on_mesh=None, rules=None):
    """{name: token ids} of `cases` [(model name, method, temperature)]; with `on_mesh`, both
    models are first split over it."""
    out = {}
    for name, method, temp in cases:
        target, drafter = models(*{"llama": (LLAMA, 0), "gemma": (GEMMA, 10)}[name])
        if on_mesh is not None:
            target, drafter = shard(target, on_mesh, rules), shard(drafter, on_mesh, rules)
        out[f"{name}/{method}/{temp}"] = decode(target, drafter, method, temp)
    return out


def spec_str(x) -> str:
    return str(tuple(x.sharding.spec))


def shardings_report(dims) -> dict:
    """Specs and per-device shard shapes of params and of the final decode state's caches."""
    mesh = mesh_of(dims)
    target, drafter = (shard(m, mesh) for m in models(LLAMA, 0))
    d = jaxspec.model_drafter(drafter)
    B, T = 8, 64
    tokens = np.zeros((B, T), np.int32)
    tokens[:, :3] = [[4, 8, 15]]
    rows = lambda a: sharding.global_array(a, sharding.batch_sharding(mesh, a.ndim))  # noqa
    with sharding.decoding_on(mesh):
        run = jax.jit(speculative.run, static_argnames="settings")
        state = run(target.params, d, rows(tokens), rows(np.full(B, 3, np.int32)),
                    rows(np.full(B, 6, np.int32)), jax.random.key(0),
                    settings=speculative.Settings(LLAMA, trees.chain(3)))
    arrays = {"wq": target.params["layers"][0]["wq"], "wk": target.params["layers"][0]["wk"],
              "w_down": target.params["layers"][0]["w_down"], "embed": target.params["embed"],
              "cache": state.target_cache.keys[0], "drafter_cache": state.drafter_state.keys[0],
              "tokens": state.tokens_BxT}
    return {k: {"spec": spec_str(x), "shape": list(x.shape),
                "shard": list(x.addressable_shards[0].data.shape)} for k, x in arrays.items()}


def errors() -> dict:
    """The messages of bad meshes and rules."""
    out = {}
    target, _ = models(GEMMA, 10)
    for key, fn in {
        "kv_heads": lambda: shard(target, mesh_of((1, 1, 8))),
        "axis": lambda: shard(target, mesh_of((8, 1, 1)), {**sharding.RULES, "mlp": "model"}),
        "load_axis": lambda: jaxspec.load(Path(sys.argv[1]).parent / "ckpt", mesh=mesh_of(
            (8, 1, 1)), rules={**sharding.RULES, "heads": "tp"}),
    }.items():
        try:
            fn()
            out[key] = None
        except UserError as e:
            out[key] = str(e)
    return out


def loaded(dims) -> dict:
    """A checkpoint loaded onto a mesh: its params' specs, and greedy tokens."""
    from jaxspec.checkpoints import store

    target, _ = models(LLAMA, 0)
    ckpt = Path(sys.argv[1]).parent / "ckpt"
    store.save(ckpt, target.params, LLAMA)
    model = jaxspec.load(ckpt, mesh=mesh_of(dims))
    return {"wq": spec_str(model.params["layers"][0]["wq"]),
            "wq_shard": list(model.params["layers"][0]["wq"].addressable_shards[0].data.shape),
            "tokens": decode(model, None, "ar")}


def distilled(dims) -> dict:
    """{shard file: text} of a distillation (greedy and sampled) on one device, and over a mesh
    of the local devices (`dims`)."""
    from jaxspec.training import distill

    out = {}
    for name, mesh in (("one", None), ("mesh", mesh_of(dims))):
        target, _ = models(LLAMA, 0)
        target = target if mesh is None else shard(target, mesh)
        d = Path(sys.argv[1]).parent / f"distill-{name}"
        distill.distill(target, PROMPTS * 3, d, temperatures=(1.0,), max_new_tokens=6,
                        block_size=4, batch_size=8, seed=1)
        out[name] = {f.name: f.read_text() for f in sorted(d.glob("*.jsonl"))}
    return out


# Greedy cases (each compiles its own function): every method on the mixed mesh, plain decoding
# and a drafter with a cache of its own on the data-only and tensor-only meshes.
METHODS = ("ar", "model", "layerskip", "ngram")
LLAMA_CASES = {(2, 1, 4): METHODS, (8, 1, 1): ("ar", "model"), (1, 1, 8): ("ar", "model")}


def main():
    out_path, mode = Path(sys.argv[1]), sys.argv[2]
    result = {}
    if mode == "meshes":
        sampled = [("llama", "model", 1.0)]
        later = [("llama", "eagle", 0.0), ("llama", "tree", 0.0),  # hidden state, token tree,
                 ("llama", "auto", 0.0)]  # gamma "auto" (its acceptance prior replicated)
        gemma = [("gemma", m, 0.0) for m in METHODS]
        result["ref"] = runs([("llama", m, 0.0) for m in METHODS] + sampled + gemma + later)
        result["mesh"] = {str(dims): runs([("llama", m, 0.0) for m in ms], mesh_of(dims))
                          for dims, ms in LLAMA_CASES.items()}
        result["mesh"]["(2, 1, 4) sampled"] = runs(sampled, mesh_of((2, 1, 4)))
        result["mesh"]["(2, 1, 4) eagle, tree, auto"] = runs(later, mesh_of((2, 1, 4)))
        result["mesh"]["gemma (2, 1, 4)"] = runs(gemma, mesh_of((2, 1, 4)))
        result["mesh"]["gemma (8, 1, 1)"] = runs(gemma[:1] + gemma[2:3], mesh_of((8, 1, 1)))
        result["mesh"]["gemma (1, 1, 8) kv replicated"] = runs(
            [("gemma", "layerskip", 0.0)], mesh_of((1, 1, 8)), {**sharding.RULES, "kv_heads": None})
        result["shardings"] = shardings_report((2, 1, 4))
        result["loaded"] = loaded((1, 1, 8))
        result["errors"] = errors()
        result["distill"] = distilled((8, 1, 1))
    elif mode == "pair":
        port, num, pid = sys.argv[3].split(",")
        sharding.init_distributed({"coordinator_address": f"localhost:{port}",
                                   "num_processes": int(num), "process_id": int(pid)})
        cases = [("llama", "ar", 0.0), ("llama", "model", 1.0)]
        result = {"devices": jax.device_count(), "local": jax.local_device_count(),
                  "tokens": runs(cases, mesh_of((2, 1, 4)))}
        out_path = out_path.with_name(f"{out_path.stem}-p{pid}.json")
    else:
        raise SystemExit(f"unknown mode {mode}")
    out_path.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
