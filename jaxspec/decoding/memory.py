"""Memory planning: the bytes per device a decode needs (params, KV caches and decode state,
activations), from abstract shapes (`jax.eval_shape`), before anything is allocated.

    python -m jaxspec.decoding.memory gemma3-270m llama-7b --mesh 1,1,1 --mesh 1,1,8 \
        --batch 8 --cache-len 2048 --dtype bfloat16 [--drafter layerskip:8-15] \
        [--device-memory 16] [--rules kv_heads=none]

prints a table; `Decoder` checks the plan against the device's memory before compiling.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.decoding import speculative
from jaxspec.drafters.base import Drafter
from jaxspec.drafters.model import ModelSpec, layer_skip_drafter
from jaxspec.drafters.ngram import ngram_drafter
from jaxspec.errors import UserError
from jaxspec.models.params import param_shapes
from jaxspec.models.transformer import PREFILL_CHUNK
from jaxspec.sharding import (MESH_AXES, RULES, batch_shards, fitting_spec, param_shardings,
                              shard_bytes, state_shardings)

GiB = 1 << 30

# Configs by shape alone (random weights): Llama 2 7B's.
SHAPES = {
    "llama-7b": ModelConfig(arch="llama", vocab_size=32000, hidden_size=4096, num_layers=32,
                            num_heads=32, num_kv_heads=32, head_dim=128, intermediate_size=11008,
                            rms_eps=1e-5, max_position=4096),
}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device: params (target and a drafter's own), decode state (KV caches, token
    buffer, features), and the largest activations of one forward. `batch` is the global one."""

    params: int
    state: int
    activations: int
    batch: int

    @property
    def total(self) -> int:
        return self.params + self.state + self.activations

    def describe(self) -> str:
        return (f"{self.total / GiB:.2f} GiB per device (params {self.params / GiB:.2f}, KV "
                f"cache and decode state {self.state / GiB:.2f}, activations "
                f"{self.activations / GiB:.2f})")


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize if not jax.dtypes.issubdtype(
        dtype, jax.dtypes.prng_key) else 8


def _bytes(x, spec, mesh) -> int:
    return shard_bytes(tuple(x.shape), _itemsize(x.dtype), spec, mesh)


def _drafter_params(drafter, mesh) -> int:
    """A drafter's own params per device (`own_params`: none of the target's), each leaf's shard
    where it is split, the whole leaf elsewhere."""
    if drafter is None:
        return 0
    total = 0
    for x in jax.tree.leaves(drafter.spec.own_params(drafter.params)):
        sh = getattr(x, "sharding", None)
        spec = sh.spec if isinstance(sh, jax.sharding.NamedSharding) else ()
        total += _bytes(x, spec, mesh)
    return total


def _abstract_params(config: ModelConfig, dtype) -> dict:
    return jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype), param_shapes(config),
                        is_leaf=lambda x: isinstance(x, tuple))


def _activations(config: ModelConfig, B: int, S: int, T: int, mesh, rules) -> int:
    """The largest transient of one forward over S positions with a cache of T slots: attention
    scores and probabilities, the MLP's three hidden buffers, logits and probabilities (all
    float32), and a few hidden-state buffers. An estimate: XLA fuses some away."""
    c = config
    terms = [(2, (B, c.num_heads, S, T), ("batch", "heads", None, "length")),
             (3, (B, S, c.intermediate_size), ("batch", None, "mlp")),
             (2, (B, S, c.head_vocab_size or c.vocab_size), ("batch", None, "vocab")),
             (4, (B, S, c.hidden_size), ("batch", None, None))]
    return sum(n * shard_bytes(shape, 4, fitting_spec(names, shape, mesh, rules), mesh)
               for n, shape, names in terms)


def plan(config: ModelConfig, *, batch: int, cache_len: int, mesh, dtype="float32",
         drafter: Drafter | None = None, gamma: int = 4,
         rules: Mapping[str, Any] = RULES, chunk: int = PREFILL_CHUNK) -> MemoryPlan:
    """The memory plan of decoding `batch` rows (padded to the mesh's row shards) with a cache
    of `cache_len` slots over `mesh` (a Mesh or an AbstractMesh). Raises the UserError of
    `param_shardings` when the mesh cannot split the params."""
    p_sh = param_shardings(config, mesh, rules)
    abstract = _abstract_params(config, dtype)
    params = sum(_bytes(a, s.spec, mesh) for a, s in
                 zip(jax.tree.leaves(abstract), jax.tree.leaves(p_sh)))
    params += _drafter_params(drafter, mesh)
    shards = batch_shards(mesh, rules)
    B, T = -(-batch // shards) * shards, cache_len
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    state = jax.eval_shape(
        lambda p, d, t, n, m, k: speculative.prefill(p, config, d, t, n, m, k), abstract, drafter,
        i32(B, T), i32(B), i32(B), jax.eval_shape(lambda: jax.random.key(0)))
    state_bytes = sum(_bytes(x, s.spec, mesh) for x, s in zip(
        jax.tree.leaves(state), jax.tree.leaves(state_shardings(state, B, mesh, rules))))
    acts = max(_activations(config, B, S, T, mesh, rules) for S in (min(chunk, T), gamma + 1))
    return MemoryPlan(params, state_bytes, acts, B)


def check(p: MemoryPlan, device_bytes: int) -> None:
    """Raise a UserError naming what to change when `p` does not fit `device_bytes`."""
    if p.total <= device_bytes:
        return
    if p.params > device_bytes:
        hint = ("the params alone exceed it: split them over more devices (a larger tensor or "
                "fsdp mesh axis) or load bfloat16 weights")
    else:
        per_row = (p.state + p.activations) / p.batch
        fit = int((device_bytes - p.params) // per_row)
        hint = (f"decode at most {fit} rows per call (now {p.batch}), shorten the cache (fewer "
                f"max_new_tokens or a shorter prompt), or split rows over more devices (a "
                f"larger data mesh axis)")
    raise UserError(f"decoding needs {p.describe()}, but a device holds "
                    f"{device_bytes / GiB:.2f} GiB: {hint}")


def device_bytes() -> int | None:
    """The first local device's memory limit; None where it reports none (CPU)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def check_decode(target, drafter, batch: int, cache_len: int, gamma: int) -> None:
    """`check` the plan of this decode against the device's memory limit, if it has one."""
    limit = device_bytes()
    if limit is None:
        return
    mesh = target.mesh or jax.sharding.AbstractMesh((1, 1, 1), MESH_AXES)
    p = plan(target.config, batch=batch, cache_len=cache_len, mesh=mesh,
             dtype=target.params["embed"].dtype, drafter=drafter, gamma=gamma,
             rules=target.rules or RULES)
    check(p, int(limit))


def _config(name: str) -> ModelConfig:
    if name in SHAPES:
        return SHAPES[name]
    from jaxspec.loading import config_of

    return config_of(name)


def _abstract_drafter(spec: str | None, target: ModelConfig, dtype) -> Drafter | None:
    """"ngram", "layerskip:LAYERS", or a model name/path (its own params, replicated)."""
    if not spec or spec == "none":
        return None
    kind, _, arg = spec.partition(":")
    if kind == "ngram":
        return ngram_drafter(int(arg or 3))
    if kind == "layerskip":
        from jaxspec.loading import parse_layers
        from jaxspec.models.model import Model

        return layer_skip_drafter(Model(target, _abstract_params(target, dtype)),
                                  parse_layers(arg))
    cfg = _config(spec)
    return Drafter({"model": _abstract_params(cfg, dtype)}, ModelSpec(cfg), spec)


def _rules(items: list[str]) -> dict:
    rules = dict(RULES)
    for item in items:
        name, _, value = item.partition("=")
        axes = tuple(a for a in value.split(",") if a and a != "none")
        rules[name] = None if not axes else axes[0] if len(axes) == 1 else axes
    return rules


def table(models, meshes, *, batch: int, cache_len: int, dtype: str, drafter: str | None,
          gamma: int, rules: Mapping[str, Any], device_gib: float | None) -> str:
    """A markdown table of the plan of each model under each mesh (d,f,t)."""
    head = "| model | mesh (data,fsdp,tensor) | params | KV cache + state | activations | total |"
    lines = [head + (" fits |" if device_gib else ""), "|" + "---|" * (6 + bool(device_gib))]
    for name in models:
        config = _config(name)
        for dims in meshes:
            mesh = jax.sharding.AbstractMesh(tuple(dims), MESH_AXES)
            cells = [name, ",".join(map(str, dims))]
            try:
                p = plan(config, batch=batch, cache_len=cache_len, mesh=mesh, dtype=dtype,
                         drafter=_abstract_drafter(drafter, config, dtype), gamma=gamma,
                         rules=rules)
            except UserError as e:
                lines.append("| " + " | ".join(cells + [f"refused: {e}"]) + " |")
                continue
            cells += [f"{b / GiB:.3f} GiB" for b in (p.params, p.state, p.activations, p.total)]
            if device_gib:
                try:
                    check(p, int(device_gib * GiB))
                    cells.append("yes")
                except UserError as e:
                    cells.append(f"no: {e}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jaxspec.decoding.memory",
                                 description="per-device memory of decoding, from shapes alone")
    ap.add_argument("models", nargs="+", help=f"{', '.join(SHAPES)}, a registered name or path")
    ap.add_argument("--mesh", action="append", help="data,fsdp,tensor (repeat; default 1,1,1)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cache-len", type=int, default=2048, help="cache slots (prompt + new)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--drafter", help="ngram, layerskip:LAYERS, or a drafter model")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--rules", nargs="*", default=[], help="overrides, e.g. kv_heads=none")
    ap.add_argument("--device-memory", type=float, help="GiB per device: say what fits")
    a = ap.parse_args(argv)
    meshes = [tuple(int(x) for x in m.split(",")) for m in a.mesh or ["1,1,1"]]
    if any(len(m) != 3 or math.prod(m) < 1 for m in meshes):
        raise SystemExit("--mesh takes data,fsdp,tensor sizes, e.g. 1,1,8")
    print(table(a.models, meshes, batch=a.batch, cache_len=a.cache_len, dtype=a.dtype,
                drafter=a.drafter, gamma=a.gamma, rules=_rules(a.rules),
                device_gib=a.device_memory))


if __name__ == "__main__":
    main()
