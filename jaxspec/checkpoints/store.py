"""jaxspec checkpoint directories: orbax params + config.json + tokenizer files.

Layout: `<dir>/jaxspec.json` (config and format version), `<dir>/params/` (orbax),
`<dir>/tokenizer/` (save_pretrained files, optional). Written to a temporary sibling and renamed,
so a killed save never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax

from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.models.params import check_params

FORMAT = 3  # 2: matrices [in, out], read and turned to [out, in]; 1: layers stacked
MARKER = "jaxspec.json"


def is_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / MARKER).is_file()


def save(path: str | os.PathLike, params: dict, config: ModelConfig, tokenizer=None,
         extra: dict | None = None) -> Path:
    """Write a checkpoint directory. With several processes every one must call this (orbax
    saves collectively); process 0 alone touches the directory itself."""
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils

    from jaxspec.models.quant import Int8

    int8 = isinstance(params.get("embed"), Int8)
    dtypes = {"int8"} if int8 else {str(x.dtype) for x in jax.tree.leaves(params)}
    if len(dtypes) != 1:
        raise UserError(f"params mix dtypes {sorted(dtypes)}")
    path = Path(path).absolute()
    tmp = path.with_name(path.name + ".tmp")
    lead = jax.process_index() == 0
    if lead:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    multihost_utils.sync_global_devices(f"jaxspec-save-start:{path}")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp / "params", params)
        ckptr.wait_until_finished()
    if lead:
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "tokenizer"))
        meta = {"format": FORMAT, "config": config.to_dict(), "dtype": dtypes.pop(),
                **(extra or {})}
        (tmp / MARKER).write_text(json.dumps(meta, indent=2))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    multihost_utils.sync_global_devices(f"jaxspec-save-done:{path}")
    return path


def read_meta(path: str | os.PathLike) -> dict:
    marker = Path(path) / MARKER
    try:
        meta = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not a readable jaxspec checkpoint: {e}") from e
    if meta.get("format") not in (2, FORMAT):
        raise UserError(f"{path}: checkpoint format {meta.get('format')} is not {FORMAT}")
    return meta


def restore(path: str | os.PathLike, dtype=None, shardings=None):
    """(config, params, meta). `shardings`: a pytree of `jax.sharding.Sharding` to restore onto
    (each process reads only its shards), or a function of the config returning one.

    A drafter saved with `meta["embed_from"]` (a frozen copy of its target's embedding) comes
    back without `params["embed"]`: `jaxspec.load` takes it from that target."""
    import orbax.checkpoint as ocp

    from jaxspec.models.params import from_in_major, param_shapes
    from jaxspec.models.quant import from_restored

    path = Path(path).absolute()
    meta = read_meta(path)
    config = ModelConfig.from_dict(meta["config"])
    dtype_saved = meta.get("dtype", "float32")
    shapes = param_shapes(config)
    if callable(shardings):
        shardings = shardings(config)
    if meta.get("embed_from"):
        del shapes["embed"]
        shardings = shardings and {k: v for k, v in shardings.items() if k != "embed"}
    abstract = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype_saved),
                            shapes, is_leaf=lambda x: isinstance(x, tuple))
    if shardings is not None:
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                abstract, shardings)
    with ocp.StandardCheckpointer() as ckptr:
        try:
            if meta["format"] == 2:  # as saved, then into today's layout and onto its devices
                params = from_in_major(ckptr.restore(path / "params"))
                params = jax.device_put(params, shardings) if shardings else params
            elif dtype_saved == "int8":
                params = from_restored(ckptr.restore(path / "params"))
            else:
                params = ckptr.restore(path / "params", abstract)
        except Exception as e:
            raise UserError(f"{path}: cannot restore params: {e}") from e
    if not meta.get("embed_from"):
        check_params(params, config)
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    return config, params, meta


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    tok_dir = Path(path) / "tokenizer"
    return AutoTokenizer.from_pretrained(str(tok_dir)) if tok_dir.is_dir() else None
