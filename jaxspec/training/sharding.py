"""Device mesh, logical-axis rules, and multi-host start-up.

Params carry logical axis names (`models.params.param_axes`); one rule table maps each name to
mesh axes of a ("data", "fsdp", "tensor") mesh, as MaxText does.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
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
}


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
    def one(path, names, shape):
        spec = logical_spec(names, rules)
        check_divisible(f"param {jax.tree_util.keystr(path)}", shape, spec, mesh)
        return NamedSharding(mesh, spec)

    is_leaf = lambda x: isinstance(x, tuple)  # noqa: E731
    return jax.tree.map_with_path(one, param_axes(config), param_shapes(config), is_leaf=is_leaf)


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
