"""Hidden-state drafter checkpoints: the trained head weights in bfloat16 and what they serve.

Layout: `<dir>/head.json` (kind, depth, tuned gamma or tree, the target's name, the config fields the
head depends on, a fingerprint of its tokenizer, the head's vocabulary ids) and
`<dir>/weights.npz` (each weight as the raw bits of bfloat16, ~2 bytes per parameter). Nothing
of the target is stored: its embedding, final norm and head rows are read from the target when
the drafter is built. Written to a temporary sibling and renamed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from jaxspec.errors import UserError
from jaxspec.models.params import layer_from_in_major

MARKER = "head.json"
FORMAT = 2  # 1: matrices stored [in, out], read and turned to [out, in]
_TARGET_FIELDS = ("arch", "hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "num_layers")


def is_head(path: str | os.PathLike) -> bool:
    return (Path(path) / MARKER).is_file()


def tokenizer_fingerprint(tokenizer) -> str | None:
    """A hash of the tokenizer's vocabulary (None without one)."""
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def save(path: str | os.PathLike, kind: str, head: dict, vocab_ids, target, depth: int,
         tuned_gamma: int | None = None, extra: dict | None = None) -> Path:
    """Write the head `head` (a param pytree) of a `kind` drafter for `target` (a Model)."""
    path = Path(path).absolute()
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    flat = {jax.tree_util.keystr(p): np.asarray(v, np.float32).astype(ml_dtypes.bfloat16)
            for p, v in jax.tree.flatten_with_path(head)[0]}
    np.savez(tmp / "weights.npz", **{k: v.view(np.uint16) for k, v in flat.items()})
    meta = {"format": FORMAT, "kind": kind, "depth": depth, "tuned_gamma": tuned_gamma,
            "target": target.name, "target_config": {f: getattr(target.config, f)
                                                     for f in _TARGET_FIELDS},
            "tokenizer": tokenizer_fingerprint(target.tokenizer),
            "vocab_ids": [int(i) for i in np.asarray(vocab_ids)], **(extra or {})}
    (tmp / MARKER).write_text(json.dumps(meta))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def read_meta(path: str | os.PathLike) -> dict:
    try:
        meta = json.loads((Path(path) / MARKER).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}/{MARKER} is unreadable: {e}") from None
    if meta.get("format") not in (1, FORMAT):
        raise UserError(f"{path}: head format {meta.get('format')}, this jaxspec reads {FORMAT}")
    return meta


def set_tuned(path: str | os.PathLike, tree, note: str) -> None:
    """Record in the head at `path` the token tree (Medusa/EAGLE choices) it was tuned for and
    how (`note`); decoding with the head and no gamma or tree then uses that tree."""
    _update(path, tuned_tree=[list(p) for p in tree], tuned_on=note)


def set_branch(path: str | os.PathLike, length: int, note: str) -> None:
    """Record in the head at `path` that its tuned shape adds n-gram lookup's continuation as a
    branch of `length` tokens (`hybrid_drafter`), and how that was chosen (`note`); decoding
    with the head and no gamma or tree then drafts with the branch. 0 removes it."""
    if length < 0:
        raise UserError(f"an n-gram branch has length >= 0, got {length}")
    _update(path, tuned_branch=int(length) or None, tuned_branch_on=note if length else None)


def set_accept(path: str | os.PathLike, accept_G, note: str, gamma: int = 0) -> None:
    """Record in the head at `path` its per-position acceptance and where it was measured
    (`note`): gamma="auto" starts each row from it (`Drafter.tuned_accept`). A `gamma` >= 1
    (the draft length the cost model picks) becomes the length it drafts by default."""
    tuned = {"tuned_gamma": gamma, "tuned_on": f"best gamma of {note}"} if gamma else {}
    _update(path, tuned_accept=[round(float(a), 4) for a in accept_G], tuned_accept_on=note,
            **tuned)


def _update(path: str | os.PathLike, **fields) -> None:
    path = Path(path)
    meta = {**read_meta(path), **fields}
    tmp = path / (MARKER + ".tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, path / MARKER)


def check_target(meta: dict, target, path) -> None:
    """Refuse a head trained for a target with another shape or tokenizer, naming the field."""
    for field, want in meta["target_config"].items():
        have = getattr(target.config, field)
        if have != want:
            raise UserError(f"{path} was trained for a target with {field} {want} "
                            f"({meta['target']}); this target has {have}")
    fp = tokenizer_fingerprint(target.tokenizer)
    if meta["tokenizer"] is not None and fp is not None and fp != meta["tokenizer"]:
        raise UserError(f"{path} was trained with the tokenizer of {meta['target']}; this "
                        f"target's tokenizer differs")


def load(path: str | os.PathLike) -> tuple[dict, dict]:
    """(meta, head params as float32 numpy, nested like the saved pytree)."""
    path = Path(path)
    meta = read_meta(path)
    try:
        with np.load(path / "weights.npz") as z:
            flat = {k: z[k].view(ml_dtypes.bfloat16).astype(np.float32) for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:  # a truncated file: the
        # last two (np.load of an empty file; a zip without its central directory)
        raise UserError(f"{path}/weights.npz is unreadable: {e}") from None
    head: dict = {}
    for key, value in flat.items():  # keys like "['layer']['wq']"
        parts = [p.strip("'\"") for p in key.strip("[]").split("][")]
        node = head
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    if meta["format"] == 1:
        head = _from_in_major(head)
    return meta, head


def _from_in_major(head: dict) -> dict:
    """A format-1 head's weights, saved [in, out], in today's [out, in] layout."""
    head = dict(head)
    if "fc" in head:
        head["fc"] = head["fc"].T
    if "w" in head:  # medusa, hydra: [depth, in, out]
        head["w"] = np.swapaxes(head["w"], 1, 2)
    if "layer" in head:
        head["layer"] = layer_from_in_major(head["layer"])
    return head
