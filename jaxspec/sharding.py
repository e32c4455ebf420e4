"""Device mesh, logical-axis rules, placement and multi-host start-up, shared by training and
decoding.

Params carry logical axis names (`models.params.param_axes`), the KV cache has `CACHE_AXES`; one
rule table maps each name to mesh axes of a ("data", "fsdp", "tensor") mesh, as MaxText does.
Decoding uses the same table: heads, kv heads and the MLP hidden dim over `tensor`, the output
head over the vocabulary, rows over `data` (and `fsdp`, which splits weights ZeRO-style: XLA
gathers each one where it is used).

A kv-heads count the `tensor` axis does not divide is refused with a UserError; the fallback is
explicit: `rules={**RULES, "kv_heads": None}` replicates the KV heads (and their cache) while the
query heads stay split.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.models.cache import CACHE_AXES, KVCache
from jaxspec.models.params import param_axes, param_shapes

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axis (or tuple of axes, or None for replicated).
RULES: dict[str, Any] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "head_vocab": "tensor",
    "head_dim": None,
    "length": None,  # cache slots
    "vision_embed": None,  # the image side (Gemma 3's SigLIP tower): small, run once per image
    "vision_heads": "tensor",
    "vision_mlp": "tensor",
}


def check_rules(rules: Mapping[str, Any], mesh) -> None:
    """Every mesh axis a rule names must exist in the mesh."""
    for name, axes in rules.items():
        for a in (axes,) if isinstance(axes, str) else (axes or ()):
            if a not in mesh.axis_names:
                raise UserError(f"rule {name!r} -> {axes!r}: the mesh has no axis {a!r} (its axes: "
                                f"{', '.join(mesh.axis_names)})")


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> jax.sharding.Mesh:
    """A ("data", "fsdp", "tensor") mesh over all devices; one size may be -1 (the rest)."""
    devices = jax.devices() if devices is None else devices
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise UserError(f"at most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise UserError(f"{len(devices)} devices do not divide into mesh "
                            f"{dict(zip(MESH_AXES, sizes))}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise UserError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                        f"{len(devices)} are available")
    return jax.make_mesh(tuple(sizes), MESH_AXES, devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def logical_spec(names: tuple[str | None, ...], rules: Mapping[str, Any] = RULES) -> P:
    """PartitionSpec of an array whose dims have these logical names."""
    return P(*(rules.get(n) if n is not None else None for n in names))


def _mesh_size(mesh, axes) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def check_divisible(name: str, shape: tuple[int, ...], spec: P, mesh) -> None:
    """Raise a UserError naming the array and dim a mesh axis does not divide."""
    for dim, (size, axes) in enumerate(zip(shape, spec)):
        parts = _mesh_size(mesh, axes)
        if size % parts:
            raise UserError(f"{name}: dim {dim} of shape {shape} has size {size}, which mesh "
                            f"axes {axes} (size {parts}) do not divide; change the mesh or the "
                            f"rule for this axis")


def param_shardings(config: ModelConfig, mesh, rules: Mapping[str, Any] = RULES) -> dict:
    """NamedSharding of every param, divisibility checked."""
    check_rules(rules, mesh)

    def one(path, names, shape):
        spec = logical_spec(names, rules)
        try:
            check_divisible(f"param {jax.tree_util.keystr(path)}", shape, spec, mesh)
        except UserError as e:
            if "kv_heads" not in names or shape[names.index("kv_heads")] % _mesh_size(
                    mesh, spec[names.index("kv_heads")]) == 0:
                raise
            raise UserError(f"{e}; num_kv_heads={config.num_kv_heads}: use a tensor axis that "
                            f"divides it, or replicate the KV heads with rules="
                            f"{{**jaxspec.sharding.RULES, 'kv_heads': None}}") from None
        return NamedSharding(mesh, spec)

    is_leaf = lambda x: isinstance(x, tuple)  # noqa: E731
    return jax.tree.map_with_path(one, param_axes(config), param_shapes(config), is_leaf=is_leaf)


def vision_shardings(vc, text_hidden: int, mesh, rules: Mapping[str, Any] = RULES) -> dict:
    """NamedSharding of every param of a vision-language model's image side; a dim the mesh
    does not divide stays whole."""
    from jaxspec.models import vision

    shapes = vision.param_shapes(vc, text_hidden)
    return jax.tree.map(lambda names, shape: NamedSharding(mesh, fitting_spec(
        names, shape, mesh, rules)), vision.param_axes(vc), shapes,
        is_leaf=lambda x: isinstance(x, tuple))


def batch_sharding(mesh, ndim: int = 2, leading: int = 0, rules: Mapping[str, Any] = RULES):
    """Sharding of a [..., batch, seq, ...] array: `leading` unsharded dims, then batch."""
    names = (None,) * leading + ("batch",) + (None,) * (ndim - leading - 1)
    return NamedSharding(mesh, logical_spec(names, rules))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def global_array(host_array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from one host array that every process holds in full."""
    check_divisible("batch", host_array.shape, sharding.spec, sharding.mesh)
    return jax.make_array_from_callback(host_array.shape, sharding, lambda idx: host_array[idx])


def init_distributed(spec: Any) -> None:
    """Start multi-host JAX: None/False does nothing; "auto" lets JAX read the cluster (SLURM,
    TPU pods); a dict gives coordinator_address, num_processes and process_id."""
    if not spec:
        return
    if spec == "auto":
        jax.distributed.initialize()
        return
    if not isinstance(spec, Mapping):
        raise UserError(f"distributed must be 'auto' or a mapping, got {spec!r}")
    unknown = set(spec) - {"coordinator_address", "num_processes", "process_id"}
    if unknown:
        raise UserError(f"unknown distributed keys {sorted(unknown)}")
    jax.distributed.initialize(spec["coordinator_address"], int(spec["num_processes"]),
                               int(spec["process_id"]))


def shard_bytes(shape: tuple[int, ...], itemsize: int, spec: P, mesh) -> int:
    """Bytes of one device's shard of an array of `shape` split by `spec`."""
    dims = [-(-size // _mesh_size(mesh, axes)) for size, axes in
            zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))]
    return math.prod(dims) * itemsize


def fitting_spec(names, shape, mesh, rules) -> P:
    """The logical spec of `names`, leaving unsplit the dims its mesh axes do not divide."""
    spec = logical_spec(names, rules)
    return P(*(a if size % _mesh_size(mesh, a) == 0 else None for size, a in zip(shape, spec)))


def state_shardings(state, batch: int, mesh, rules: Mapping[str, Any] = RULES):
    """NamedSharding of every array of a decode state (arrays or abstract shapes): the KV caches
    by `CACHE_AXES` (rows and kv heads), other arrays whose leading dim is the batch by rows,
    the rest (and empty arrays) replicated. A dim the mesh does not divide (a drafter's few kv
    heads, a refill group of few rows) stays whole."""
    def one(x):
        if isinstance(x, KVCache):
            return jax.tree.map(lambda a: NamedSharding(mesh, fitting_spec(
                CACHE_AXES, a.shape, mesh, rules)), x)
        if x.ndim and x.shape[0] == batch and math.prod(x.shape):
            names = ("batch",) + (None,) * (x.ndim - 1)
            return NamedSharding(mesh, fitting_spec(names, x.shape, mesh, rules))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, KVCache))


_DECODING: list[tuple[Any, Mapping[str, Any]]] = []  # the active (mesh, rules), innermost last


@contextlib.contextmanager
def decoding_on(mesh, rules: Mapping[str, Any] = RULES) -> Iterator[None]:
    """While tracing under this context, `constrain` pins decode states to `mesh` by `rules`."""
    _DECODING.append((mesh, rules))
    try:
        yield
    finally:
        _DECODING.pop()


def constrain(state, batch: int):
    """`state` with the shardings of `state_shardings` under the active `decoding_on` mesh;
    unchanged without one (one device)."""
    if not _DECODING:
        return state
    mesh, rules = _DECODING[-1]
    return jax.lax.with_sharding_constraint(state, state_shardings(state, batch, mesh, rules))


def batch_shards(mesh, rules: Mapping[str, Any] = RULES) -> int:
    """How many ways the rules split the batch over this mesh (1 without a mesh)."""
    return 1 if mesh is None else _mesh_size(mesh, rules.get("batch"))


def to_host(tree):
    """numpy copies of a pytree of arrays, gathered across processes where they are split."""
    from jax.experimental import multihost_utils

    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)
