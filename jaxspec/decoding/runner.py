"""Host side of decoding: prompts -> padded buckets -> one compiled call -> results (`DECODER`);
the public functions over it are in `api`."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sharding
from jaxspec.decoding import executables, image_prompts, speculative, stops, trees, xla_cache
from jaxspec.decoding.plan import AcceptanceMemory, start_counts
from jaxspec.decoding.sampling import Sampling
from jaxspec.drafters.model import as_drafter, same_tokens
from jaxspec.drafters.text_view import text_view
from jaxspec.errors import UserError
from jaxspec.loading import check_token_ids

_CACHE_MIN = 256


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[list[int]]  # new tokens per row
    texts: list[str]
    accept_lengths: list[list[int]]  # per row, tokens gained at each verification step
    tau: float  # mean tokens gained per verification step
    acceptance_rate: float | None  # accepted drafts / proposed drafts; None without a drafter
    wall_time_s: float  # prefill + decode, compile excluded
    compile_time_s: float
    gamma: int = 0  # the draft length, or its maximum with gamma="auto"
    draft_lengths: list[list[int]] = dataclasses.field(default_factory=list)  # per row and step

    @property
    def num_new_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0


def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def encode_prompts(model, prompts, chat: bool) -> list[list[int]]:
    """Strings (through the model's tokenizer, optionally its chat template) or token id lists."""
    if isinstance(prompts, (str, np.ndarray)) or (
            prompts and isinstance(prompts[0], (int, np.integer))):
        prompts = [prompts]
    if not prompts:
        raise UserError("no prompts given")
    out = []
    for p in prompts:
        if isinstance(p, str):
            tok = model.tokenizer
            if tok is None:
                raise UserError("string prompts need a model with a tokenizer; pass token ids")
            if chat:
                if not getattr(tok, "chat_template", None):
                    raise UserError("chat=True, but the tokenizer has no chat template")
                ids = tok.apply_chat_template([{"role": "user", "content": p}],
                                              add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tok(p).input_ids
        else:
            arr = np.asarray(p)
            if arr.size and not np.issubdtype(arr.dtype, np.integer):
                raise UserError(f"token id prompts must be integers, got {arr.dtype}")
            ids = [int(t) for t in arr.reshape(-1)]
        if not ids:
            raise UserError("empty prompt")
        out.append(list(ids))
    return out


def stop_ids(model, stop) -> tuple[int, ...]:
    """The ids that end a row alone, sorted: the model's end-of-sequence ids, the ids in `stop`
    and every token whose text holds one of its strings (a string spelled by several tokens is
    not among them: the loop's automata stop it, `stops.cut` cuts it)."""
    return tuple(np.flatnonzero(stops.tables(model, stop)[0].ends_V).tolist())


def _check_tokenizers(target, drafter_model) -> None:
    """A drafter model with its own tokenizer must share the target's vocabulary, or its first
    ids (`same_tokens`)."""
    t, d = target.tokenizer, getattr(drafter_model, "tokenizer", None)
    if t is None or d is None:
        return
    if not same_tokens(t, d):
        raise UserError(f"the drafter's tokenizer ({len(d)} tokens) differs from the target's "
                        f"({len(t)} tokens): its drafts would mean other tokens")


def _check_gamma(gamma, drafter) -> None:
    if not isinstance(gamma, (int, np.integer)) or isinstance(gamma, bool):
        raise UserError(f"gamma must be an int or 'auto', got {gamma!r}")
    if gamma < 0 or (drafter is not None and gamma < 1):
        raise UserError(f"gamma must be >= 1 with a drafter, got {gamma}")


def _check_tree(tree, drafter):
    """(the tree, None for a chain; its node count) for `tree` (choices paths, a Tree or a
    DynamicTree)."""
    tree = trees.make_tree(tree)
    spec = as_drafter(drafter).spec if drafter is not None else None
    if isinstance(tree, trees.DynamicTree):
        if spec is not None and not spec.drafts_dynamic_trees:
            raise UserError(f"dynamic trees are drafted by EAGLE heads, not by "
                            f"{type(spec).__name__}; give this drafter a static tree")
        return tree, tree.size
    if not tree.is_chain and spec is not None and not spec.drafts_trees:
        raise UserError(f"drafter {type(spec).__name__} cannot draft trees; use a chain (gamma)")
    return (None if tree.is_chain else tree), tree.size


def _with_branch(drafter, tree, gamma: int, auto: bool):
    """(tree, node count) a drafter with a shape of its own verifies (`extend`): a head's chain of
    gamma or `tree` with an n-gram branch (`hybrid.HybridSpec`), Lookahead's tree."""
    spec = as_drafter(drafter).spec if drafter is not None else None
    if spec is None or not spec.fixed_shape:
        return tree, gamma
    if auto:
        check_auto(drafter)
    tree = spec.extend(trees.chain(gamma) if tree is None else tree)
    return tree, tree.size


def check_auto(drafter) -> None:
    """Refuse gamma="auto" for a drafter whose shape is fixed (a head with an n-gram branch,
    Lookahead)."""
    spec = as_drafter(drafter).spec if drafter is not None else None
    if spec is not None and spec.fixed_shape:
        raise UserError(f"{type(spec).__name__} drafts a fixed shape: give it gamma or a static "
                        f"tree (or neither), not 'auto'")


def _check_costs(costs, gamma_max: int) -> tuple[float, ...]:
    """Step cost of each draft length 0..gamma_max relative to a plain step (`api` measures them
    when the caller gives none)."""
    if costs is None:
        raise UserError("gamma='auto' needs the step costs of each draft length "
                        "(jaxspec.speculative_generate measures them)")
    costs = tuple(float(c) for c in costs)
    if len(costs) != gamma_max + 1 or min(costs) <= 0:
        raise UserError(f"costs must be {gamma_max + 1} positive step costs (draft lengths "
                        f"0..{gamma_max}), got {costs}")
    return costs


def _never_drafts(costs_G1, tuned_accept) -> bool:
    """Whether gamma="auto" would never draft: every row starts at the prior acceptance, which
    only drafting moves, so when the prior picks no draft the drafter never runs (its prefill
    alone would cost time); such a call decodes without it."""
    from jaxspec.decoding.plan import choose_gamma

    G = len(costs_G1) - 1
    accepted_1xG, tried_1xG = start_counts(None, tuned_accept, G)[:, None]
    return int(choose_gamma(accepted_1xG, tried_1xG, np.asarray(costs_G1))[0]) == 0


def _budgets(max_new_tokens, B: int) -> np.ndarray:
    """max_new_tokens (one int, or one per prompt) as an int array [B]."""
    max_new = np.asarray(max_new_tokens)
    if not np.issubdtype(max_new.dtype, np.integer):
        raise UserError(f"max_new_tokens must be ints, got {max_new_tokens!r}")
    if max_new.ndim > 1 or (max_new.ndim == 1 and len(max_new) != B):
        raise UserError(f"max_new_tokens has {max_new.size} entries for {B} prompts")
    if (max_new < 1).any():
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return np.broadcast_to(max_new, (B,))


def cache_len(lengths, max_new, gamma: int, max_position: int, label: str = "gamma") -> int:
    """Cache slots for these prompts and budgets: a power of two, at least _CACHE_MIN, so most
    calls share one compiled shape (attention over unused slots is cheap next to the weights).
    A step writes gamma + 1 slots from the last token on (a tree: its nodes + 1)."""
    need = int((lengths + max_new).max()) + gamma + 1
    if need > max_position:
        raise UserError(f"prompt ({lengths.max()} tokens) + max_new_tokens ({max_new.max()}) "
                        f"+ {label} + 1 = {need} exceeds the model's {max_position} positions")
    return min(_bucket(need, _CACHE_MIN), max_position)


def _pad_batch(ids, max_new, T: int, pad_id: int, multiple: int = 1):
    """Rows padded to a power-of-two batch, a multiple of `multiple` (the mesh's row shards):
    tokens [Bp, T], lengths [Bp], budgets [Bp] (padded rows have budget 0, so they start
    done)."""
    B = len(ids)
    Bp = -(-_bucket(B, 1) // multiple) * multiple
    tokens = np.full((Bp, T), pad_id, np.int32)
    for b, row in enumerate(ids):
        tokens[b, :len(row)] = row
    lengths = np.array([len(r) for r in ids] + [1] * (Bp - B), np.int32)
    budgets = np.concatenate([max_new, np.zeros(Bp - B, np.int64)]).astype(np.int32)
    return tokens, lengths, budgets


def _compile(fn, statics: dict, args, donate, mesh, rules, fresh: bool):
    """`fn` lowered and compiled, through JAX's persistent cache unless `fresh` (an executable
    to be kept by `executables`: one read back from JAX's cache and serialized again missed
    functions) or over a CPU mesh (one with collectives read back deadlocks in a collective,
    jax 0.10, simulated devices)."""
    xla_cache.use()
    traced = fn
    if mesh is not None:
        def traced(*a, **kw):  # a fresh function: no trace cached without the mesh is reused
            with sharding.decoding_on(mesh, rules):
                return fn(*a, **kw)
    jitted = jax.jit(traced, static_argnames=tuple(statics), donate_argnums=donate)
    cached = jax.config.jax_enable_compilation_cache
    if fresh or mesh is not None and mesh.devices.flat[0].platform == "cpu":
        jax.config.update("jax_enable_compilation_cache", False)
    try:
        with xla_cache.reading():
            return jitted.lower(*args, **statics).compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)


class Decoder:
    """Compiles one function per static setting and shape bucket; keeps the `max_size` most
    recently used. `compiles` counts executables built (or read from the persistent cache)."""

    def __init__(self, max_size: int = 32):
        self._compiled: collections.OrderedDict = collections.OrderedDict()
        self.max_size = max_size
        self.compiles = 0
        self.acceptance = AcceptanceMemory()  # gamma="auto"'s per-drafter history

    def hlo_texts(self) -> list[str]:
        """The optimised HLO of the compiled functions held (for `bench.op_profile`)."""
        return [ex.as_text() for ex in self._compiled.values()]

    def clear(self) -> None:
        """Free the compiled functions (each holds memory and a few memory mappings)."""
        self._compiled.clear()

    def _executable(self, statics: dict, args, fn=speculative.run, donate: tuple[int, ...] = (),
                    model=None, check=None):
        """`fn` (speculative.run by default) compiled for these statics and argument shapes;
        `donate`: positions of arguments whose buffers the call may reuse. Over `model`'s mesh
        (if any) the decode state is pinned to it (`sharding.constrain`). `check()` runs
        before compiling (the memory plan)."""
        mesh, rules = (model.mesh, model.rules) if model is not None else (None, None)
        key = (fn.__name__, donate, tuple(sorted(statics.items(), key=lambda kv: kv[0])),
               jax.tree.structure(args), tuple((a.shape, a.dtype) for a in jax.tree.leaves(args)),
               mesh, tuple(sorted((rules or {}).items())))
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        if check is not None:
            check()
        path = None if mesh is not None else executables.entry(fn, statics, args, donate)
        build = functools.partial(_compile, fn, statics, args, donate, mesh, rules)
        compiled = executables.load(path)
        if compiled is not None:
            compiled = executables.Checked(compiled, path, lambda: build(fresh=False))
        else:
            t0 = time.perf_counter()
            compiled = build(fresh=path is not None)
            executables.save(path, compiled, time.perf_counter() - t0)
        self._compiled[key] = compiled
        self.compiles += 1
        if len(self._compiled) > self.max_size:
            self._compiled.popitem(last=False)
        return self._compiled[key]

    def __call__(self, target, drafter, prompts, *, gamma, max_new_tokens, sampling, seed, stop,
                 chat, gamma_max=4, costs=None, tree=None, remember=True, images=None,
                 image_placeholder=None) -> GenerationResult:
        auto = isinstance(gamma, str)
        if auto and gamma != "auto":
            raise UserError(f"gamma must be an int or 'auto', got {gamma!r}")
        if tree is not None:
            tree, gamma = _check_tree(tree, drafter)
            if isinstance(tree, trees.DynamicTree) and not sampling.greedy:
                raise UserError("dynamic trees are greedy only (temperature 0); sample with a "
                                "static tree or a chain")
        gamma = gamma_max if auto else gamma
        _check_gamma(gamma, drafter)
        tree, gamma = _with_branch(drafter, tree, gamma, auto)
        ids = encode_prompts(target, prompts, chat)
        image_rows = None
        if images is not None:
            if target.vision is None:
                raise UserError(f"images were given, but {target.name or 'the target'} is a "
                                f"text-only model")
            image_rows = image_prompts.per_row(images, len(ids))
            if not any(image_rows):
                image_rows = None
            else:
                ids = [image_prompts.expand(target, row, len(ims))
                       for row, ims in zip(ids, image_rows)]
        for row in ids:
            check_token_ids([row], target.config.vocab_size)
        max_new = _budgets(max_new_tokens, len(ids))
        lengths = np.array([len(r) for r in ids])
        reserve = gamma  # a dynamic tree's drafter also writes its expanded nodes
        if isinstance(tree, trees.DynamicTree):
            reserve = max(gamma, tree.expanded)
        T = cache_len(lengths, max_new, reserve, target.config.max_position,
                      f"{reserve} tree nodes" if tree is not None else "gamma")
        tokens, lengths_p, max_new_p = _pad_batch(ids, max_new, T, target.config.pad_token_id,
                                                  sharding.batch_shards(target.mesh, target.rules))
        if drafter is not None:
            _check_tokenizers(target, drafter)
            drafter = as_drafter(drafter, target)
            drafter.spec.validate(drafter.params, target)
            if image_rows is not None:
                drafter = text_view(drafter, target.vision.config,
                                    image_prompts.placeholder_ids(target, image_placeholder))
        stop_data, stop_strings = stops.tables(target, stop)
        shape = speculative.Auto(gamma) if auto else (trees.chain(gamma) if tree is None
                                                      else tree)
        costs_G1 = _check_costs(costs, gamma) if auto else None
        if auto and _never_drafts(costs_G1, drafter.tuned_accept):
            drafter, costs_G1, shape = None, None, trees.chain(0)
        statics = dict(settings=speculative.Settings(
            target.config, shape, sampling,
            target.vision.config.image_token_id if image_rows is not None else None))
        args = (target.params, drafter and drafter.bare,
                *_rows(target, tokens, lengths_p, max_new_p), _key(target, seed))
        memory_key = prior = None
        if costs_G1 is not None:
            memory_key = (target.name, drafter.name, drafter.spec, sampling, gamma)
            remembered = self.acceptance.prior(memory_key, gamma) if remember else None
            prior = _replicated(target, start_counts(remembered, drafter.tuned_accept, gamma))
            costs_G1 = _replicated(target, np.asarray(costs_G1, np.float32))
        args += (prior, jax.tree.map(lambda a: _replicated(target, a), stop_data), costs_G1)
        images_s = images_compile_s = 0.0  # a request's images are prepared and encoded in it
        if image_rows is not None:
            t0 = time.perf_counter()
            vis, pix = target.vision, image_prompts.pixels(target, image_rows)
            images_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            encode = self._executable(dict(config=vis.config), (vis.params, pix),
                                      image_prompts.encode, model=target)
            images_compile_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            args += _rows(target, image_prompts.arrange(encode(vis.params, pix), image_rows,
                                                        len(tokens)))
            images_s += time.perf_counter() - t0
        def check():
            from jaxspec.decoding import memory  # also a `python -m` entry: import when used

            memory.check_decode(target, drafter, len(tokens), T, gamma)
        t0 = time.perf_counter()
        run = self._executable(statics, args, model=target, check=check)
        compile_s = time.perf_counter() - t0 + images_compile_s
        t0 = time.perf_counter()
        state = jax.block_until_ready(run(*args))
        wall = time.perf_counter() - t0 + images_s
        result = _result(target, state, len(ids), gamma, wall, compile_s, stop_strings)
        if memory_key is not None and remember:
            self.acceptance.update(memory_key, result.accept_lengths, result.draft_lengths, gamma)
        return result

    def stream(self, target, prompts, seeds=None, *, batch_size: int, max_new_tokens: int,
               sampling: Sampling, stop, refill_size: int | None = None, max_steps: int = 64,
               cache_slots: int | None = None):
        """Continuous batching of plain decoding: yields (prompt index, new token ids) as rows
        finish, in finishing order. `batch_size` slots decode together; whenever
        `refill_size` rows (default batch_size // 8) are done, or after `max_steps` steps, the
        finished rows are taken out and their slots refilled with the next prompts, prefilled
        `refill_size` at a time; the tokens all prompts begin with (a shared template) are
        computed once and each refilled row starts from their keys and values. Every call has
        fixed shapes: three compiled functions serve the whole stream. Prompt i samples with its
        own key, `jax.random.key(seeds[i])` (seeds are uint32; default 0), so its output depends
        neither on its slot nor on its neighbours.
        `cache_slots`: the cache length (default: the power-of-two bucket the prompts need).
        `self.stream_stats` counts the prefill and decode calls of the last stream."""
        ids = encode_prompts(target, prompts, False)
        for row in ids:
            check_token_ids([row], target.config.vocab_size)
        seeds = np.zeros(len(ids), np.uint32) if seeds is None else np.asarray(seeds, np.uint32)
        if seeds.shape != (len(ids),):
            raise UserError(f"{seeds.size} seeds for {len(ids)} prompts")
        max_new = int(_budgets(max_new_tokens, 1)[0])
        if batch_size < 1 or max_steps < 1:
            raise UserError(f"batch_size and max_steps must be >= 1, got {batch_size}, "
                            f"{max_steps}")
        shards = sharding.batch_shards(target.mesh, target.rules)
        B = -(-int(batch_size) // shards) * shards  # rows split evenly over the mesh
        R = min(B, int(refill_size or max(1, B // 8)))
        lengths = np.array([len(r) for r in ids])
        T = cache_len(lengths, np.array([max_new]), 0, target.config.max_position)
        if cache_slots is not None:
            if cache_slots < T:
                raise UserError(f"cache_slots={cache_slots}, but the prompts need {T}")
            T = int(cache_slots)
        pad = target.config.pad_token_id
        config = target.config
        decode_statics = dict(settings=speculative.Settings(config, trees.chain(0), sampling))
        stop_data, stop_strings = stops.tables(target, stop)
        stats = self.stream_stats = {"prefill_calls": 0, "decode_calls": 0}
        slot_prompt = np.full(B, -1)  # the prompt each slot holds; -1: empty
        pending = collections.deque(range(len(ids)))
        state = speculative.idle_state(config, B, T, speculative.cache_dtype(target.params),
                                       stop_data.next_ZxVxL.shape[0])
        stop_data = jax.tree.map(lambda a: _replicated(target, a), stop_data)
        if target.mesh is not None:
            state = jax.device_put(state, sharding.state_shardings(state, B, target.mesh,
                                                                   target.rules))
        shared = _shared_prefix(ids)
        shared_len = _replicated(target, np.int32(shared))
        prefix_args = (target.params, _replicated(target, _pad_row(ids[0][:shared], T, pad)),
                       shared_len)
        shared_cache = self._executable(dict(config=config), prefix_args,
                                        speculative.shared_prefix, model=target)(*prefix_args)
        refill_fn = decode_fn = None
        while True:
            free = np.flatnonzero(slot_prompt < 0)
            while len(free) and pending:
                take = min(R, len(free), len(pending))
                tokens = np.full((R, T), pad, np.int32)
                lens, budgets = np.ones(R, np.int32), np.zeros(R, np.int32)
                row_seeds, slots = np.zeros(R, np.uint32), np.full(R, B, np.int32)
                for r in range(take):
                    i = pending.popleft()
                    tokens[r, :len(ids[i])] = ids[i]
                    lens[r], budgets[r], row_seeds[r], slots[r] = len(ids[i]), max_new, seeds[i], \
                        free[r]
                    slot_prompt[free[r]] = i
                free = free[take:]
                args = (target.params, state, *map(jnp.asarray, (tokens, lens, budgets,
                                                                 row_seeds, slots)),
                        shared_cache, shared_len)
                refill_fn = refill_fn or self._executable(dict(config=config), args,
                                                          speculative.refill, donate=(1,),
                                                          model=target)
                state = refill_fn(*args)
                stats["prefill_calls"] += 1
            if (slot_prompt < 0).all():
                return
            # While prompts wait, stop once R rows are done (all slots are full); then drain.
            args = (target.params, None, state, jnp.int32(max_steps),
                    jnp.int32(R if pending else B), stop_data)
            decode_fn = decode_fn or self._executable(decode_statics, args, speculative.resume,
                                                      donate=(2,), model=target)
            state = decode_fn(*args)
            stats["decode_calls"] += 1
            done, tokens, lengths_B, prompt_B = sharding.to_host(
                (state.done_B, state.tokens_BxT, state.lengths_B, state.prompt_lengths_B))
            for s in np.flatnonzero(done & (slot_prompt >= 0)):
                i, slot_prompt[s] = int(slot_prompt[s]), -1
                new = tokens[s, prompt_B[s]:lengths_B[s]].tolist()
                yield i, stops.cut(target.tokenizer, new, stop_strings)[0] if stop_strings else new


def _shared_prefix(ids) -> int:
    """The number of leading tokens every prompt shares, leaving each at least one of its own."""
    n = min(len(row) for row in ids) - 1
    for row in ids[1:]:
        n = next((i for i, (a, b) in enumerate(zip(ids[0][:n], row[:n])) if a != b), n)
    return max(n, 0)


def _pad_row(row, T: int, pad: int):
    """One prompt as a [1, T] int32 array, padded with `pad`."""
    out = np.full((1, T), pad, np.int32)
    out[0, :len(row)] = row
    return out


def _rows(model, *host_arrays):
    """Per-row inputs as device arrays: split over the model's mesh by rows if it has one (every
    process passes the whole batch)."""
    if model.mesh is None:
        return tuple(jnp.asarray(a) for a in host_arrays)
    return tuple(sharding.global_array(a, sharding.batch_sharding(
        model.mesh, a.ndim, rules=model.rules)) for a in host_arrays)


def _key(model, seed: int):
    """The batch's PRNG key, replicated over the model's mesh if it has one."""
    key = jax.random.key(seed)
    if model.mesh is None:
        return key
    return jax.random.wrap_key_data(_replicated(model, np.asarray(jax.random.key_data(key))))


def _replicated(model, host_array):
    """A host array on the device, replicated over the model's mesh if it has one."""
    if model.mesh is None:
        return jnp.asarray(host_array)
    return sharding.global_array(host_array, sharding.replicated(model.mesh))


def _result(target, state, B, gamma, wall, compile_s, stop_strings=()) -> GenerationResult:
    """The host's view of a finished state: each row's text ends before its first stop string,
    its ids with the token that completed it (`stops.cut`)."""
    tokens, lengths, prompt_lengths, steps, gained, drafted = sharding.to_host(
        (state.tokens_BxT, state.lengths_B, state.prompt_lengths_B, state.steps_B,
         state.gained_BxI, state.gamma_BxI))
    token_ids = [tokens[b, prompt_lengths[b]:lengths[b]].tolist() for b in range(B)]
    if stop_strings:
        token_ids, texts = map(list, zip(*(stops.cut(target.tokenizer, t, stop_strings)
                                           for t in token_ids)))
    else:
        texts = [decode_text(target, t) for t in token_ids]
    accept = [gained[b, :steps[b]].tolist() for b in range(B)]
    draft_lengths = [drafted[b, :steps[b]].tolist() for b in range(B)]
    flat = [a for row in accept for a in row]
    tau = float(np.mean(flat)) if flat else 0.0
    rate = None
    if gamma:
        n_drafted = sum(map(sum, draft_lengths))
        rate = float(sum(a - 1 for a in flat) / n_drafted) if n_drafted else 0.0
    return GenerationResult(token_ids, texts, accept, tau, rate, wall, compile_s, gamma,
                            draft_lengths)


def decode_text(model, token_ids, stop_strings: tuple[str, ...] = ()) -> str:
    """The text of generated ids, special tokens skipped ("" without a tokenizer), up to just
    before the first of `stop_strings` in it (`stops.strings`)."""
    tok = model.tokenizer
    if tok is None:
        return ""
    if stop_strings:
        return stops.cut(tok, token_ids, stop_strings)[1]
    return tok.decode(token_ids, skip_special_tokens=True)


DECODER = Decoder()
