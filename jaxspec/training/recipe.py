"""Recipe entry points over a plain config dict (`jaxspec.config.load_yaml` + overrides).

Keys (see configs/*.yaml):
  seed, target (a model name/path, or {random: {ModelConfig fields}, seed}: a random model with
  the byte tokenizer), dtype (float32 | bfloat16: the target's weights), languages [source,
  target], chat (auto | true | false),
  template (wraps each translation prompt: "...{prompt}...", e.g. one-shot for base models),
  distributed (null | auto | {coordinator_address, num_processes, process_id}),
  data: {prompts, pretrain, eval}: source specs for `data.load_source` (eval also takes `num`),
  distill: {out_dir, temperatures, max_new_tokens, block_size, batch_size, top_k, top_p, stop,
           partial (train on the shards finished so far), also (out_dirs of earlier
           distillations, e.g. with another prompt seed, trained on beside out_dir's)},
  drafter: {init: target | random, num_layers, config: {ModelConfig overrides}, head_vocab_size}
           for a model drafter, or {kind: medusa | hydra | eagle, depth, head_vocab_size, gamma,
           reg_weight, unroll, generic} for a hidden-state head (`run_train_head`; `unroll`
           (default 4): how many drafts deep the align stage runs EAGLE on its own predictions;
           `generic`: a saved head or a shipped drafter's name to start from instead of a
           pretrain stage, e.g. another pair's `drafter-generic` or `gemma3-270m-deen-drafter`),
  train: {workdir, ...TrainSettings shared by the stages, pretrain: {...}, finetune: {...},
          align: {...} (EAGLE only: after finetuning, the same rows unrolled)}.
A stage runs when its `steps` > 0. The drafter is saved to `<workdir>/drafter`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import loading, sharding
from jaxspec.checkpoints import heads as ckpt_heads
from jaxspec.config import ModelConfig
from jaxspec.drafters import hidden
from jaxspec.drafters.base import Drafter
from jaxspec.errors import UserError
from jaxspec.files import write_atomic
from jaxspec.training import data, distill, drafter_init, heads, trainer

DISTILL_KEYS = ("temperatures", "max_new_tokens", "block_size", "batch_size", "top_k", "top_p",
                "stop")
TOP_KEYS = {"seed", "target", "dtype", "languages", "chat", "template", "distributed", "data",
            "distill", "drafter", "train"}
SOURCE_TYPES = {"tfds", "specbench", "sharegpt", "text", "manpages", "selfgen"}
STAGES = ("pretrain", "finetune", "align")


def check_config(cfg: dict) -> None:
    """Raise a UserError naming the first unknown or invalid key, before anything runs."""
    def unknown(where, keys, known):
        extra = set(keys) - set(known)
        if extra:
            raise UserError(f"{where}: unknown keys {sorted(extra)}; known: {sorted(known)}")

    unknown("recipe", cfg, TOP_KEYS)
    for key in ("target", "data", "distill", "train"):
        if key not in cfg:
            raise UserError(f"recipe: missing {key!r}")
    for name, spec in cfg["data"].items():
        unknown("data", [name], ("prompts", "pretrain", "eval"))
        if spec.get("type") not in SOURCE_TYPES:
            raise UserError(f"data.{name}: type must be one of {sorted(SOURCE_TYPES)}")
    unknown("distill", cfg["distill"], ("out_dir", "partial", "also", *DISTILL_KEYS))
    if not isinstance(cfg["distill"].get("also", []), list):
        raise UserError("distill.also must be a list of distillation out_dirs")
    drafter = cfg.get("drafter", {})
    unknown("drafter", drafter, ("init", "num_layers", "config", "head_vocab_size", "kind",
                                 "depth", "gamma", "reg_weight", "unroll", "generic", "top"))
    if drafter.get("kind", "model") not in ("model", *hidden.KINDS):
        raise UserError(f"drafter.kind must be 'model' or one of {hidden.KINDS}")
    unknown("drafter.config", drafter.get("config", {}), ModelConfig.__dataclass_fields__)
    if "prompts" not in cfg["data"]:
        raise UserError("recipe: data.prompts (the distillation prompts) is missing")
    if stage_settings(cfg, "pretrain") and "pretrain" not in cfg["data"]:
        raise UserError("recipe: train.pretrain has steps but data.pretrain is missing")
    if stage_settings(cfg, "align") and drafter.get("kind") != "eagle":
        raise UserError("recipe: train.align unrolls an EAGLE head on its own drafts; "
                        f"drafter.kind is {drafter.get('kind', 'model')!r}")
    if "unroll" in drafter and not stage_settings(cfg, "align"):
        raise UserError("recipe: drafter.unroll is the align stage's depth, but train.align "
                        "has no steps")
    if drafter.get("generic") and stage_settings(cfg, "pretrain"):
        raise UserError("recipe: drafter.generic is the pretrained head; set train.pretrain "
                        "steps to 0")
    for stage in STAGES:
        s = stage_settings(cfg, stage)
        if s is not None and drafter.get("kind", "model") != "model" and s.loss != "ce":
            raise UserError(f"train.{stage}: loss {s.loss!r}, but a {drafter['kind']} head "
                            f"trains with its own loss (cross-entropy of its drafts; eagle adds "
                            f"feature regression); set loss: ce")


def load_target(spec, dtype: str = "float32"):
    """A registered name or path through `jaxspec.load` (weights in `dtype`), or {random: {...},
    seed}: a random model with the byte tokenizer (tests, notebooks)."""
    from jaxspec.loading import load
    from jaxspec.models.model import Model

    if isinstance(spec, str):
        return load(spec, dtype=dtype)
    if not isinstance(spec, dict) or "random" not in spec:
        raise UserError(f"target must be a model name/path or {{random: {{...}}}}, got {spec!r}")
    config = ModelConfig.from_dict(spec["random"])
    params = jax.device_get(drafter_init.random_init(config, spec.get("seed", 0)))
    return Model(config, params, data.byte_tokenizer(), "random")


def _chat(cfg: dict, target) -> bool:
    chat = cfg.get("chat", "auto")
    if chat == "auto":
        return bool(getattr(target.tokenizer, "chat_template", None))
    return bool(chat)


def _languages(cfg: dict) -> tuple[str | None, str]:
    langs = cfg.get("languages") or [None, "en"]
    return langs[0], langs[1]


def _prompts(cfg: dict, key: str, target, generate_fn) -> list[str]:
    spec = dict(cfg["data"][key])
    num = spec.pop("num", None)
    if spec.get("type") == "selfgen":
        spec.setdefault("chat", _chat(cfg, target))
    prompts = data.to_prompts(data.load_source(spec, target, generate_fn), *_languages(cfg))
    prompts = [cfg.get("template", "{prompt}").format(prompt=p) for p in prompts]
    return prompts[:num] if num is not None else prompts


def _cached_source(cfg: dict, name: str, path: Path, make: Callable[[], list]) -> list:
    """`make()` for the source `data.<name>`, kept in `path` so a killed job does not write its
    text again (reused only for the same source spec, template and seed)."""
    key = {"source": cfg["data"][name], "template": cfg.get("template", "{prompt}"),
           "seed": cfg.get("seed", 0)}
    if path.exists():
        cached = json.loads(path.read_text(encoding="utf-8"))
        if cached["key"] == key:
            return cached["items"]
    items = make()
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"key": key, "items": items}, ensure_ascii=False))
    return items


def _cached_prompts(cfg: dict, target, generate_fn) -> list[str]:
    """The distillation prompts, kept in `<distill.out_dir>/prompts.json`."""
    return _cached_source(cfg, "prompts", Path(cfg["distill"]["out_dir"]) / "prompts.json",
                          lambda: _prompts(cfg, "prompts", target, generate_fn))


def run_distill(cfg: dict, generate_fn: Callable | None = None) -> Path:
    """Self-distillation of the `data.prompts` source by the target; returns the output dir."""
    check_config(cfg)
    sharding.init_distributed(cfg.get("distributed"))
    target = load_target(cfg["target"], cfg.get("dtype", "float32"))
    if jax.local_device_count() > 1 and generate_fn is None:
        # Each process decodes its shards with its own devices, rows split over them.
        from jaxspec.loading import shard

        target = shard(target, sharding.make_mesh(devices=jax.local_devices()))
    dcfg = cfg["distill"]
    prompts = _cached_prompts(cfg, target, generate_fn)
    return distill.distill(target, prompts, dcfg["out_dir"], seed=cfg.get("seed", 0),
                           chat=_chat(cfg, target), generate_fn=generate_fn,
                           process_index=jax.process_index(), process_count=jax.process_count(),
                           **{k: dcfg[k] for k in DISTILL_KEYS if k in dcfg})


def distilled(cfg: dict) -> list[dict]:
    """The distilled records of every source (`distilled_sources`), one list."""
    return [r for records, _ in distilled_sources(cfg) for r in records]


def distilled_sources(cfg: dict) -> list[tuple[list[dict], Path]]:
    """The records of `distill.out_dir` (with `distill.partial: true`, those of the shards
    finished so far, counted on stderr: training may start before a long distillation ends)
    and of each `distill.also` directory (complete), each with where the target's features over
    it are cached."""
    dcfg = cfg["distill"]
    records = distill.read_distilled(dcfg["out_dir"], require_complete=not dcfg.get("partial"))
    if dcfg.get("partial"):
        print(f"jaxspec: training on {len(records)} distilled records (distill.partial)",
              file=sys.stderr)
    return [(records, features_dir(dcfg["out_dir"]))] + [
        (distill.read_distilled(d), features_dir(d)) for d in dcfg.get("also", [])]


def init_drafter(cfg: dict, target, token_ids) -> tuple[ModelConfig, dict, np.ndarray | None]:
    """Drafter config, host params and head vocab ids (None for a full head)."""
    dcfg = cfg.get("drafter", {})
    init = dcfg.get("init", "target")
    if init == "target":
        config, params = drafter_init.from_target(target.config, target.params,
                                                  int(dcfg.get("num_layers", 1)))
        config = config.replace(**dcfg.get("config", {}))
    elif init == "random":
        config = target.config.replace(**dcfg.get("config", {}))
        params = drafter_init.random_init(config, cfg.get("seed", 0))
    else:
        raise UserError(f"drafter.init must be 'target' or 'random', got {init!r}")
    vocab_ids = None
    if dcfg.get("head_vocab_size"):
        eos = target.config.eos_token_ids or (target.tokenizer.eos_token_id,)
        vocab_ids = drafter_init.frequent_vocab(token_ids, int(dcfg["head_vocab_size"]),
                                                target.config.vocab_size, always=eos)
        config, params = drafter_init.reduce_head(config, params, vocab_ids)
    return config, jax.device_get(params), vocab_ids


def stage_settings(cfg: dict, stage: str) -> trainer.TrainSettings | None:
    tcfg = cfg["train"]
    shared = {k: v for k, v in tcfg.items() if k not in ("workdir", *STAGES)}
    merged = {"seed": cfg.get("seed", 0), **shared, **(tcfg.get(stage) or {})}
    if not merged.get("steps"):
        return None
    return trainer.TrainSettings.from_dict(merged)


def finetune_batches(records: list[dict], s: trainer.TrainSettings, pad_id: int) -> data.Batches:
    """The finetuning stage's batches: distilled records packed, loss on responses only."""
    return data.Batches(*data.pack(data.distilled_examples(records), s.seq_len, pad_id),
                        s.batch_size, s.seed)


def run_train(cfg: dict, speculative_fn: Callable | None = None,
              generate_fn: Callable | None = None) -> Path:
    """Pretrain (next-token on `data.pretrain`) then finetune (on the distilled data) the
    drafter; each stage resumes from its own checkpoints. Returns the saved drafter's path."""
    check_config(cfg)
    sharding.init_distributed(cfg.get("distributed"))
    target = load_target(cfg["target"], cfg.get("dtype", "float32"))
    workdir = Path(cfg["train"]["workdir"])
    if cfg.get("drafter", {}).get("kind", "model") != "model":
        return run_train_head(cfg, target, workdir, speculative_fn, generate_fn)
    records = distilled(cfg)
    config, params, vocab_ids = init_drafter(
        cfg, target, [r["prompt_ids"] + r["response_ids"] for r in records])
    pad, chat = target.config.pad_token_id, _chat(cfg, target)
    eval_prompts = (_cached_source(cfg, "eval", workdir / "eval_prompts.json",
                                   lambda: _prompts(cfg, "eval", target, generate_fn))
                    if "eval" in cfg["data"] else [])
    common = dict(vocab_ids=vocab_ids, eval_prompts=eval_prompts, speculative_fn=speculative_fn,
                  tokenizer=target.tokenizer, chat=chat, teacher=target)
    eos = (target.config.eos_token_ids or (target.tokenizer.eos_token_id,))[0]

    s = stage_settings(cfg, "pretrain")
    if s is not None:
        texts = _cached_source(cfg, "pretrain", workdir / "pretrain_texts.json",
                               lambda: data.to_texts(data.load_source(
                                   cfg["data"]["pretrain"], target, generate_fn)))
        tokens, mask = data.pack(data.text_examples(target.tokenizer, texts, eos), s.seq_len, pad)
        params = trainer.host_params(trainer.train(
            s, config, params, data.Batches(tokens, mask, s.batch_size, s.seed),
            workdir / "pretrain", **common))
    s = stage_settings(cfg, "finetune")
    if s is not None:
        params = trainer.host_params(trainer.train(
            s, config, params, finetune_batches(records, s, pad), workdir / "finetune", **common))
    return drafter_init.save_drafter(workdir / "drafter", config, params, target.tokenizer,
                                     vocab_ids, extra={"target": str(cfg["target"])},
                                     embed_from=embed_source(cfg))


def embed_source(cfg: dict) -> str | None:
    """The named target whose embedding the recipe's drafter keeps frozen (saved as a reference
    to it), or None when the drafter's embedding is its own."""
    stages = [st for st in (stage_settings(cfg, "pretrain"), stage_settings(cfg, "finetune"))
              if st is not None]
    frozen = all("embed" in st.freeze for st in stages)
    return (cfg["target"] if frozen and isinstance(cfg["target"], str)
            and cfg.get("drafter", {}).get("init", "target") == "target" else None)


def features_dir(out_dir: str | Path) -> Path:
    """Where the target's features over a distillation's rows are cached: next to them, so
    heads of every kind trained on the same rows share them."""
    return Path(out_dir).parent / "features"


def _rows_and_features(target, sources, seq_len: int, pad: int, labels: bool,
                       feature_layer: int | None) -> tuple[np.ndarray, np.ndarray, dict]:
    """Training rows of every (examples, features dir) source and the target's features over
    them (and its greedy labels with `labels`), cached per source, so a source added to a
    recipe costs only its own rows."""
    tokens, mask, extra = [], [], []
    for examples, fdir in sources:
        t, m = heads.example_rows(examples, seq_len, pad)
        out = heads.target_features(target, t, fdir, heads.row_lengths(m), labels=labels,
                                    feature_layer=feature_layer)
        tokens.append(t)
        mask.append(m)
        extra.append(dict(zip(("features", "labels"), out if labels else (out,))))
    cat = lambda xs: xs[0] if len(xs) == 1 else np.concatenate(xs)  # noqa: E731 (one: no copy)
    return cat(tokens), cat(mask), {k: cat([e[k] for e in extra]) for k in extra[0]}


def _generic_head(path, kind: str, depth: int, target, fresh: dict) -> dict:
    """The head saved at `path` (or a shipped drafter's name), checked to be a `kind` head of
    `depth` for `target` with the shapes of a `fresh` one."""
    meta, head = ckpt_heads.load(loading.resolve(path))
    ckpt_heads.check_target(meta, target, path)
    if (meta["kind"], meta["depth"]) != (kind, depth):
        raise UserError(f"drafter.generic {path} is a {meta['kind']} head of depth "
                        f"{meta['depth']}; this recipe trains {kind} of depth {depth}")
    if jax.tree.structure(head) != jax.tree.structure(fresh) or any(
            a.shape != b.shape for a, b in zip(jax.tree.leaves(head), jax.tree.leaves(fresh))):
        raise UserError(f"drafter.generic {path} has other weights than a {kind} head")
    return head


def run_train_head(cfg: dict, target, workdir: Path, speculative_fn: Callable | None,
                   generate_fn: Callable | None) -> Path:
    """A hidden-state head (drafter.kind): pretrained on `data.pretrain` text to draft the
    target's greedy tokens (the generic head, saved to `<workdir>/drafter-generic`), then
    finetuned on the distilled responses (saved to `<workdir>/drafter`, returned), both one
    draft ahead of the target's features; then (EAGLE, `train.align`) trained on the same
    responses `drafter.unroll` drafts deep on its own predicted features, as drafting feeds it
    (EAGLE-3's training-time test; HASS's alignment). Each stage's
    head covers the `head_vocab_size` most frequent ids of its own training text (the head rows
    are the target's, so they can change between stages); the target's features of every row
    are cached (`features_dir`)."""
    dcfg = cfg["drafter"]
    kind, depth, seed = dcfg["kind"], int(dcfg.get("depth", 4)), cfg.get("seed", 0)
    V, pad, chat = target.config.vocab_size, target.config.pad_token_id, _chat(cfg, target)
    eos = target.config.eos_token_ids or (target.tokenizer.eos_token_id,)
    options = {"top": int(dcfg["top"])} if "top" in dcfg else None  # streams' layers
    spec = hidden.hidden_spec(kind, target.config, depth, options=options)
    head = jax.device_get(hidden.head_params(kind, target.config, depth, jax.random.key(seed),
                                             target.params))
    if dcfg.get("generic"):
        head = _generic_head(dcfg["generic"], kind, depth, target, head)
    eval_prompts = (_cached_source(cfg, "eval", workdir / "eval_prompts.json",
                                   lambda: _prompts(cfg, "eval", target, generate_fn))
                    if "eval" in cfg["data"] else [])
    path = None
    for stage in STAGES:
        s = stage_settings(cfg, stage)
        if s is None:
            continue
        if stage == "pretrain":
            texts = _cached_source(cfg, "pretrain", workdir / "pretrain_texts.json",
                                   lambda: data.to_texts(data.load_source(
                                       cfg["data"]["pretrain"], target, generate_fn)))
            sources = [(data.text_examples(target.tokenizer, texts, eos[0]),
                        features_dir(cfg["distill"]["out_dir"]))]
        else:
            sources = [(data.distilled_examples(records), fdir)
                       for records, fdir in distilled_sources(cfg)]
        vocab_ids = np.arange(V, dtype=np.int32)
        if dcfg.get("head_vocab_size"):
            vocab_ids = drafter_init.frequent_vocab(
                [[t for t, m in zip(ids, mask) if m] for examples, _ in sources
                 for ids, mask in examples], int(dcfg["head_vocab_size"]), V, always=eos)
        shared = spec.shared(target.params, vocab_ids)
        ids = jnp.asarray(vocab_ids)
        # Pretraining text is any text: the target's own greedy tokens, from the same forward
        # as its features, are the labels (no generation).
        tokens, mask, extra = _rows_and_features(target, sources, s.seq_len, pad,
                                                 stage == "pretrain", spec.feature_layer)
        mesh = sharding.make_mesh(*s.mesh)
        head = trainer.host_params(trainer.train(
            s, target.config, head, data.Batches(tokens, mask, s.batch_size, s.seed, **extra),
            workdir / stage, teacher=target, eval_prompts=eval_prompts,
            speculative_fn=speculative_fn, tokenizer=target.tokenizer, chat=chat, mesh=mesh,
            loss=heads.head_loss(spec, trainer.head_index(vocab_ids, V),
                                 dcfg.get("reg_weight", 1.0), s.bf16,
                                 int(dcfg.get("unroll", 4)) if stage == "align" else 1),
            frozen=shared, param_shardings=jax.tree.map(lambda _: sharding.replicated(mesh), head),
            drafter_fn=lambda h, shared=shared, ids=ids: Drafter(
                {"shared": shared, "head": h, "vocab_ids": ids}, spec, kind)))
        path = ckpt_heads.save(workdir / ("drafter-generic" if stage == "pretrain" else "drafter"),
                               kind, head, vocab_ids, target, depth, dcfg.get("gamma"),
                               extra={"languages": cfg.get("languages"), "stage": stage,
                                      "options": spec.options})
    if path is None:
        raise UserError("recipe: train.pretrain and train.finetune both have no steps")
    return path
