"""The cache of converted GGUF files: float32 params as one `.npy` per array (memory-mapped when
read back), the config and the tokenizer, in one folder per source file. A folder is written to
a temporary sibling and renamed, so a killed conversion leaves nothing half-written; one that
cannot be read is converted again."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxspec.config import ModelConfig
from jaxspec.files import cache_dir, warn_rebuild
from jaxspec.models.params import check_params

FORMAT = 2  # bump when conversion changes its output
_META = "converted.json"


def entry(source: Path) -> Path:
    """The cache folder of `source`, keyed by its path, size and modification time."""
    st = source.stat()
    key = hashlib.sha256(f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return cache_dir("converted", FORMAT) / f"{source.stem}-{key.hexdigest()[:12]}"


def _file(folder: Path, name: str) -> Path:
    """The .npy file of the param at path `name` ("layers/3/wq")."""
    return folder / f"{name.replace('/', '.')}.npy"


def _unflatten(flat: dict) -> dict:
    """Nested params from "a/b/0/c" keys; integer keys under "layers" become a list."""
    tree = unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()})
    layers = tree.get("layers")
    if layers is not None:
        tree["layers"] = [layers[str(i)] for i in range(len(layers))]
    return tree


def save(folder: Path, config: ModelConfig, params: dict, tokenizer) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tree = {**params, "layers": {str(i): p for i, p in enumerate(params.get("layers", []))}}
    names = []
    for path, w in flatten_dict(tree).items():
        name = "/".join(map(str, path))
        np.save(_file(tmp, name), np.asarray(w, np.float32))
        names.append(name)
    tokenizer.save_pretrained(str(tmp / "tokenizer"))
    (tmp / _META).write_text(json.dumps({"config": config.to_dict(), "params": names}))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def load(folder: Path, put=lambda w: w):
    """(config, params, tokenizer) from the cache, or None when absent; a corrupt or truncated
    entry is removed with a one-line warning (and None returned). `put(array)` takes each
    memory-mapped array as it is read (say, onto a device): only one is mapped at a time."""
    if not (folder / _META).is_file():
        return None
    try:
        from transformers import PreTrainedTokenizerFast

        meta = json.loads((folder / _META).read_text())
        config = ModelConfig.from_dict(meta["config"])
        params = _unflatten({name: put(np.load(_file(folder, name), mmap_mode="r"))
                             for name in meta["params"]})
        check_params(params, config)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder / "tokenizer"))
    except Exception as err:  # any damage: convert again
        warn_rebuild("the converted model", folder, err)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return config, params, tokenizer
