"""Autoregressive generation as one jitted program: a ragged prefill, then a `lax.while_loop` of
1-token decode steps until every sequence hit eos or max_new_tokens.

Shapes are bucketed (batch to a power of two, prompt length and cache length to powers of two),
so a steady workload compiles once; `compile_count()` lets tests check that.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.core.checks import is_int, next_power_of_two, positive_int
from jaxspec.core.config import ModelConfig, SpecConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.model import state as state_lib
from jaxspec.model.network import ModelParams, check_params, cpu_layout, extend
from jaxspec.model.prefill import chunked_prefill, prefill_for_speculation
from jaxspec.model.runner import on_mesh, pad_batch
from jaxspec.model.sampling import Sampling, sample_tokens, validate_sampling
from jaxspec.sharding.active import constrain_state
from jaxspec.sharding.rules import check_mesh
from jaxspec.speculation.auto import NO_SPECULATION, auto_spec, registered_tuning
from jaxspec.speculation.commit import commit_accepted_path
from jaxspec.speculation.rules import choose_rule, draft_and_prune, verify_tree
from jaxspec.speculation.values import CONTEXT_CAP, Calibration, context_bins, draft_fingerprint, resolve_scores
from jaxspec.speculation.widths import accepted_path, verify_in_width

MAX_BATCH_BUCKET = 64


@dataclasses.dataclass
class GenerateOutput:
    tokens: np.ndarray  # [B, max_new_tokens] int32, pad_id after a sequence ends
    lengths: np.ndarray  # [B] generated tokens per sequence (eos included)
    stats: dict[str, Any]


def batch_bucket(batch: int) -> int:
    if batch <= MAX_BATCH_BUCKET:
        return next_power_of_two(batch)
    return -(-batch // MAX_BATCH_BUCKET) * MAX_BATCH_BUCKET


def length_bucket(length: int, limit: int, minimum: int = 16) -> int:
    return min(max(next_power_of_two(length), minimum), limit)


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    tokens: np.ndarray  # [Bb, Sb] int32, left-aligned, zero padded
    lengths: np.ndarray  # [Bb] int32 (bucket padding rows have length 1)
    batch: int  # real batch size B


def prepare_prompts(
    cfg: ModelConfig, prompts: Any, max_new_tokens: int, prompt_lengths: Any = None
) -> PromptBatch:
    """Validate prompts (ragged lists, or an int array with optional lengths) and bucket them.

    The width bucket comes from the longest list prompt, or from an array's width: a caller that
    pads its prompts to one width gets one compiled program for every batch of them.
    """
    _check_max_new_tokens(max_new_tokens)
    if isinstance(prompts, (np.ndarray, jax.Array)):
        array = np.asarray(prompts)
        if array.ndim != 2:
            raise ValueError(f"a prompt array must be [B, S], got shape {array.shape}")
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"prompt tokens must be integers, got dtype {array.dtype}")
        if prompt_lengths is None:
            lengths = np.full((array.shape[0],), array.shape[1], np.int64)
        else:
            lengths = np.asarray(prompt_lengths)
            if lengths.shape != (array.shape[0],) or not np.issubdtype(lengths.dtype, np.integer):
                raise ValueError(f"prompt_lengths must be [B={array.shape[0]}] ints, got {lengths!r}")
            if np.any(lengths > array.shape[1]):
                raise ValueError(f"prompt_lengths exceed the array width {array.shape[1]}: {lengths.tolist()}")
        rows = [array[i, : int(lengths[i])] for i in range(array.shape[0])]
        width = array.shape[1]
    elif isinstance(prompts, (list, tuple)):
        if prompt_lengths is not None:
            raise ValueError("prompt_lengths is only for array prompts; lists carry their own lengths")
        rows = []
        for i, p in enumerate(prompts):
            if not isinstance(p, (list, tuple, np.ndarray)):
                raise ValueError(f"prompt {i} must be a list of token ids, got {type(p).__name__}")
            arr = np.asarray(p)
            if arr.size and not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"prompt {i} must hold integer token ids, got dtype {arr.dtype}")
            rows.append(arr.astype(np.int64).reshape(-1))
        width = max((r.size for r in rows), default=0)
    else:
        kind = type(prompts).__name__
        raise ValueError(f"prompts must be a list of token-id lists or a [B, S] int array, got {kind}")
    if not rows:
        raise ValueError("prompts is empty: need at least one prompt")
    for i, r in enumerate(rows):
        if r.size == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if r.min() < 0 or r.max() >= cfg.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={cfg.vocab_size})")
        if r.size + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i}: {r.size} prompt tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                f"max length {cfg.max_position_embeddings}"
            )
    batch = len(rows)
    bb = batch_bucket(batch)
    sb = length_bucket(width, cfg.max_position_embeddings)
    tokens = np.zeros((bb, sb), np.int32)
    lengths = np.ones((bb,), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : r.size] = r
        lengths[i] = r.size
    return PromptBatch(tokens=tokens, lengths=lengths, batch=batch)


def _check_max_new_tokens(max_new_tokens: Any) -> None:
    positive_int("max_new_tokens", max_new_tokens)


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """The decoding arguments `generate` and `speculative_generate` share, checked in one place."""

    max_new_tokens: int
    sampling: Sampling  # temperature (0 = greedy), top_k (0 = off), top_p (1 = off), base key
    eos_id: int  # -1 = none
    mesh: jax.sharding.Mesh | None

    @classmethod
    def create(
        cls,
        cfg: ModelConfig,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        rng: jax.Array | None = None,
        mesh: Any = None,
    ) -> DecodeOptions:
        """ValueError naming the argument, the value and what is allowed, for anything wrong."""
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        if mesh is not None:
            check_mesh(mesh)
        _check_max_new_tokens(max_new_tokens)
        temperature, top_k, top_p = validate_sampling(temperature, top_k, top_p)
        if eos_id is None:
            eos = -1
        elif not is_int(eos_id) or not 0 <= eos_id < cfg.vocab_size:
            raise ValueError(f"eos_id must be None or an int in [0, {cfg.vocab_size}), got {eos_id!r}")
        else:
            eos = int(eos_id)
        if rng is None:
            if temperature > 0:
                raise ValueError("sampling (temperature > 0) needs an explicit rng=jax.random.key(...)")
            rng = jax.random.key(0)
        elif not (isinstance(rng, jax.Array) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)):
            raise ValueError("rng must be a typed key from jax.random.key(seed)")
        sampling = Sampling(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p), rng)
        return cls(max_new_tokens=int(max_new_tokens), sampling=sampling, eos_id=eos, mesh=mesh)


def generate(
    params: ModelParams,
    cfg: ModelConfig,
    prompts: Any,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    rng: jax.Array | None = None,
    mesh: Any = None,
    prompt_lengths: Any = None,
) -> GenerateOutput:
    """Plain autoregressive decoding; the reference every speculative path must match."""
    opts = DecodeOptions.create(cfg, max_new_tokens, temperature, top_k, top_p, eos_id, rng, mesh)
    check_params(params, cfg)
    batch = pad_batch(prepare_prompts(cfg, prompts, opts.max_new_tokens, prompt_lengths), opts.mesh)
    max_len = length_bucket(batch.tokens.shape[1] + opts.max_new_tokens, cfg.max_position_embeddings, minimum=64)
    if opts.mesh is None:
        params = cpu_layout(params, cfg)
    tokens, lengths, steps = on_mesh(_generate_loop, opts.mesh, len(batch.lengths))(
        params, cfg, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), opts.max_new_tokens, max_len,
        jnp.int32(opts.eos_id), opts.sampling,
    )
    tokens, lengths = np.asarray(tokens)[: batch.batch], np.asarray(lengths)[: batch.batch]
    return GenerateOutput(tokens=tokens, lengths=lengths, stats={"decode_steps": int(steps)})


def compile_count() -> int:
    """Generation programs compiled so far, freed ones included (static-shape check for tests)."""
    return _generate_loop.compile_count()


# Its compiled programs live in `jaxspec.core.programs`' bounded LRU (like `_speculative_loop`'s).
@functools.partial(bounded_jit, static_argnums=(1, 4, 5))
def _generate_loop(
    params: ModelParams,
    cfg: ModelConfig,
    prompt_tokens: jax.Array,  # [Bb, Sb] int32
    prompt_lengths: jax.Array,  # [Bb] int32
    max_new_tokens: int,
    max_len: int,
    eos_id: jax.Array,  # -1 = none
    sampling: Sampling,
):
    bb = prompt_tokens.shape[0]
    key, temperature, top_k, top_p = sampling.key, sampling.temperature, sampling.top_k, sampling.top_p
    pad_id = jnp.maximum(eos_id, 0)
    state = constrain_state(state_lib.init_state(cfg, bb, max_len))
    prefilled, state = chunked_prefill(params, cfg, state, prompt_tokens, prompt_lengths)
    first = sample_tokens(prefilled.last_logits, jax.random.fold_in(key, 0), temperature, top_k, top_p)
    tokens = jnp.full((bb, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    num_generated = jnp.ones((bb,), jnp.int32)
    done = (first == eos_id) | (num_generated >= max_new_tokens)

    def cond(carry):
        _, _, _, _, done, step = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        state, last, tokens, num_generated, done, step = carry
        active = ~done
        out, state = extend(params, cfg, state, last[:, None], active[:, None])
        nxt = sample_tokens(out.logits[:, 0], jax.random.fold_in(key, step), temperature, top_k, top_p)
        nxt = jnp.where(active, nxt, pad_id)
        column = jnp.where(active, num_generated, max_new_tokens)  # finished rows: dropped write
        tokens = tokens.at[jnp.arange(bb), column].set(nxt, mode="drop")
        num_generated = num_generated + active.astype(jnp.int32)
        done = done | (nxt == eos_id) | (num_generated >= max_new_tokens)
        return state, jnp.where(active, nxt, last), tokens, num_generated, done, step + 1

    carry = (state, first, tokens, num_generated, done, jnp.int32(1))
    _, _, tokens, num_generated, _, step = jax.lax.while_loop(cond, body, carry)
    return tokens, num_generated, step


# ---------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------


def _check_spec(cfg: ModelConfig, spec: Any) -> SpecConfig:
    spec = SpecConfig.parse(spec) if isinstance(spec, str) else spec
    if not isinstance(spec, SpecConfig):
        raise ValueError(f"spec must be a SpecConfig or a name like 's3_k2_d6', got {spec!r}")
    spec.validate_for(cfg)
    return spec


def speculative_generate(
    params: ModelParams,
    cfg: ModelConfig,
    prompts: Any,
    spec: SpecConfig | str,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    rng: jax.Array | None = None,
    mesh: Any = None,
    prompt_lengths: Any = None,
    tuning: Any = None,
    accept: str | None = None,
    calibration: Any = None,
) -> GenerateOutput:
    """Tree speculative decoding; greedy output is token-identical to `generate`, and with
    temperature > 0 every token is an exact draw from the distribution `generate` samples from
    (same temperature / top-k / top-p processing; lossless tree acceptance). accept: "residual" (sampled
    drafts, the default at temperature > 0) or "target" (top-K drafts), `jaxspec.speculation.rules`.

    spec="auto" takes the spec `jaxspec tune` chose for this batch size from `tuning` (a `Tuning`,
    its JSON file or the checkpoint folder holding it; default: the tune.json `load_checkpoint`
    found beside these params); where it chose no speculation this is `generate`, and
    stats["spec"] says which ran. `spec.scores` and `calibration`: `resolve_scores`.
    """
    opts = DecodeOptions.create(cfg, max_new_tokens, temperature, top_k, top_p, eos_id, rng, mesh)
    check_params(params, cfg)
    rule = choose_rule(accept, float(opts.sampling.temperature))
    if isinstance(spec, str) and spec == "auto":
        if tuning is None and params.mtp is not None:
            tuning = registered_tuning(draft_fingerprint(params, cfg))  # load_checkpoint's tune.json
        if tuning is None:
            raise ValueError('spec="auto" needs tuning= (a Tuning, or the folder `jaxspec tune` wrote tune.json to), '
                             "or params from load_checkpoint of a folder holding tune.json")
        num_prompts = len(prompts) if isinstance(prompts, (list, tuple)) else int(np.shape(prompts)[0])
        spec = auto_spec(tuning, max(num_prompts, 1))
        if spec is None:
            out = generate(params, cfg, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, eos_id=eos_id, rng=rng, mesh=mesh, prompt_lengths=prompt_lengths)
            return dataclasses.replace(out, stats={**out.stats, "spec": NO_SPECULATION})
    elif tuning is not None:
        raise ValueError('tuning= is only used with spec="auto"')
    spec = _check_spec(cfg, spec)
    spec, values = resolve_scores(params, cfg, spec, calibration)  # also: no MTP block is an error
    extra = spec.num_steps + 1  # a cycle may overshoot max_new_tokens by up to S + 1 slots
    batch = pad_batch(prepare_prompts(cfg, prompts, opts.max_new_tokens + extra, prompt_lengths), opts.mesh)
    max_len = length_bucket(batch.tokens.shape[1] + opts.max_new_tokens + extra, cfg.max_position_embeddings,
                            minimum=64)
    if opts.mesh is None:
        params = cpu_layout(params, cfg)
    tokens, lengths, stats = on_mesh(_speculative_loop, opts.mesh, len(batch.lengths))(
        params, cfg, spec, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), opts.max_new_tokens, max_len,
        jnp.int32(opts.eos_id), opts.sampling, rule, values,
    )
    n = batch.batch
    tokens, lengths = np.asarray(tokens)[:n], np.asarray(lengths)[:n]
    stats = {k: np.asarray(v)[:n] for k, v in stats.items()}
    return GenerateOutput(tokens=tokens, lengths=lengths, stats={**summarize_stats(stats, spec), "scores": spec.scores})


def summarize_stats(per_sequence: dict[str, np.ndarray], spec: SpecConfig) -> dict[str, Any]:
    """Aggregate per-sequence counters (cycles, accepted, depth_hits, rank_hist) into tau, per-depth
    acceptance and the rank histogram; `stats["per_sequence"]` of an output feeds back in."""
    keys = ("cycles", "accepted", "depth_hits", "rank_hist", *(("verified",) if "verified" in per_sequence else ()))
    per_sequence = {k: np.asarray(per_sequence[k]) for k in keys}
    cycles = per_sequence["cycles"]
    total_cycles = int(cycles.sum())
    accepted = per_sequence["accepted"]
    denom = max(total_cycles, 1)
    verified = per_sequence.get("verified")
    return {
        "spec": spec.name,
        "cycles": total_cycles,
        "mean_accepted_length": float((accepted.sum() + total_cycles) / denom),
        "mean_verified": float(verified.sum() / denom) if verified is not None else float(spec.num_draft_tokens),
        "per_depth_acceptance": (per_sequence["depth_hits"].sum(0) / denom).tolist(),
        "rank_histogram": per_sequence["rank_hist"].sum(0).tolist(),
        "per_sequence": {
            "cycles": cycles.tolist(),
            "accepted": accepted.tolist(),
            "mean_accepted_length": ((accepted + cycles) / np.maximum(cycles, 1)).tolist(),
            "depth_hits": per_sequence["depth_hits"].tolist(),
            "rank_hist": per_sequence["rank_hist"].tolist(),
            **({"verified": verified.tolist()} if verified is not None else {}),
        },
    }


def draft_and_verify(
    params: ModelParams,
    cfg: ModelConfig,
    spec: SpecConfig,
    state: state_lib.DecodeState,
    root: jax.Array,  # [B] bonus token of the last cycle, at position P (not yet committed)
    last_hidden: jax.Array,  # [B, hc, d] target streams at position P-1
    sampling: Sampling | None = None,
    cycle: jax.Array | None = None,  # [B] int32 per-sequence cycle counter (folds sampling.key)
    accept: str = "target",  # "target" | "residual" (jaxspec.speculation.rules)
    values: Calibration | None = None,  # node values to rank by; None = raw draft log-probs
    context: jax.Array | None = None,  # [B] int32 context bin of each sequence (`loop_context`), None = pooled
):
    """draft -> prune -> plan -> verify -> accept, nothing committed yet; -> (tree, verify_out, acceptance).
    The verify scratch (`verify_out.rows`) holds every node's rows; the commit keeps the accepted path's."""
    tree = draft_and_prune(params, cfg, spec, state, root, last_hidden, accept, sampling, cycle, values=values,
                           context=context)
    return tree, *verify_tree(params, cfg, spec, state, tree, sampling, cycle)


def speculative_cycle(
    params: ModelParams,
    cfg: ModelConfig,
    spec: SpecConfig,
    state: state_lib.DecodeState,
    root: jax.Array,  # [B] bonus token of the last cycle, at position P (not yet committed)
    last_hidden: jax.Array,  # [B, hc, d] target streams at position P-1
    active: jax.Array,  # [B] bool
    sampling: Sampling | None = None,
    cycle: jax.Array | None = None,  # [B] int32 per-sequence cycle counter (folds sampling.key)
    accept: str = "target",  # "target" | "residual" (jaxspec.speculation.rules)
    values: Calibration | None = None,  # node values to rank by; None = raw draft log-probs
    context: jax.Array | None = None,  # [B] int32 context bin of each sequence (`loop_context`), None = pooled
):
    """draft -> prune -> plan -> verify -> accept -> commit; -> (state, last_hidden, tree, acceptance)."""
    tree, verify_out, acc = draft_and_verify(params, cfg, spec, state, root, last_hidden, sampling, cycle, accept,
                                             values, context)
    state, last_hidden = commit_accepted_path(
        params, cfg, state, tree.tokens, verify_out, acc, last_hidden, active
    )
    return state, last_hidden, tree, acc


def loop_context(
    spec: SpecConfig,
    values: Calibration | None,
    stats: dict[str, jax.Array],  # the loop's per-sequence stats so far
) -> jax.Array | None:
    """-> [B] int32 context bin of each sequence from its own cycles so far (speculation/values.py), or None
    (pooled values) when there are no context maps or the tree is too shallow to count min(accepted, 8)."""
    if spec.num_steps < CONTEXT_CAP or values is None or not values.greedy_by_context:
        return None
    capped = jnp.sum(stats["depth_hits"][:, :CONTEXT_CAP], axis=1)  # sum of min(accepted, 8) per cycle
    return context_bins(capped, stats["cycles"])


def speculative_compile_count() -> int:
    """Speculative loops compiled so far, freed ones included."""
    return _speculative_loop.compile_count()


@functools.partial(bounded_jit, static_argnums=(1, 2, 5, 6, 9, 10))
def _speculative_loop(
    params: ModelParams,
    cfg: ModelConfig,
    spec: SpecConfig,
    prompt_tokens: jax.Array,  # [Bb, Sb] int32
    prompt_lengths: jax.Array,  # [Bb] int32
    max_new_tokens: int,
    max_len: int,
    eos_id: jax.Array,  # -1 = none
    sampling: Sampling,
    accept: str = "target",
    values: Calibration | None = None,
):
    s_steps, k = spec.num_steps, spec.topk
    bb = prompt_tokens.shape[0]
    batch_index = jnp.arange(bb)
    pad_id = jnp.maximum(eos_id, 0)
    state, root, last_hidden = prefill_for_speculation(params, cfg, prompt_tokens, prompt_lengths, max_len, sampling)

    width = max_new_tokens + s_steps + 1
    tokens = jnp.full((bb, width), pad_id, jnp.int32).at[:, 0].set(root)
    num_generated = jnp.ones((bb,), jnp.int32)
    done = (root == eos_id) | (num_generated >= max_new_tokens)
    stats = {
        "cycles": jnp.zeros((bb,), jnp.int32),
        "accepted": jnp.zeros((bb,), jnp.int32),
        "verified": jnp.zeros((bb,), jnp.int32),  # nodes verified (the cycle's width, summed)
        "depth_hits": jnp.zeros((bb, s_steps), jnp.int32),
        "rank_hist": jnp.zeros((bb, k), jnp.int32),
    }

    def cond(carry):
        return ~jnp.all(carry[5])

    def body(carry):
        state, root, last_hidden, tokens, num_generated, done, stats = carry
        active = ~done
        context = loop_context(spec, values, stats)
        if spec.widths:  # width chosen per cycle (speculation/widths.py)
            tree = draft_and_prune(params, cfg, spec, state, root, last_hidden, accept, sampling, stats["cycles"],
                                   values=values, context=context)
            state, last_hidden, path_tokens, ranks, num_accepted, bonus, verified = verify_in_width(
                params, cfg, spec, state, last_hidden, active, tree, sampling, stats["cycles"])
        else:
            state, last_hidden, tree, acc = speculative_cycle(
                params, cfg, spec, state, root, last_hidden, active, sampling=sampling, cycle=stats["cycles"],
                accept=accept, values=values, context=context,
            )
            (path_tokens, ranks), num_accepted, bonus = accepted_path(tree, acc), acc.num_accepted, acc.bonus
            verified = jnp.int32(spec.num_draft_tokens)
        # Emitted this cycle: the accepted drafts, then the bonus token.
        slot = jnp.arange(s_steps + 1)[None, :]
        a = num_accepted[:, None]
        drafted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((bb, 1), jnp.int32)], axis=1)
        emitted = jnp.where(slot < a, drafted, jnp.where(slot == a, bonus[:, None], pad_id))
        is_eos = (emitted == eos_id) & (slot <= a)
        count = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, num_accepted + 1)
        count = jnp.minimum(count, max_new_tokens - num_generated)
        count = jnp.where(active, count, 0)
        column = jnp.where(slot < count[:, None], num_generated[:, None] + slot, width)
        tokens = tokens.at[batch_index[:, None], column].set(emitted, mode="drop")
        num_generated = num_generated + count
        done = done | jnp.any(is_eos & (slot < count[:, None]), axis=1) | (num_generated >= max_new_tokens)
        on = active.astype(jnp.int32)
        hit = (jnp.arange(s_steps)[None, :] < a) & active[:, None]
        stats = {
            "cycles": stats["cycles"] + on,
            "accepted": stats["accepted"] + num_accepted * on,
            "verified": stats["verified"] + verified * on,
            "depth_hits": stats["depth_hits"] + hit.astype(jnp.int32),
            "rank_hist": stats["rank_hist"]
            + jnp.sum(jax.nn.one_hot(ranks, k, dtype=jnp.int32) * hit[..., None].astype(jnp.int32), axis=1),
        }
        root = jnp.where(active, bonus, root)
        return state, root, last_hidden, tokens, num_generated, done, stats

    carry = (state, root, last_hidden, tokens, num_generated, done, stats)
    _, _, _, tokens, num_generated, _, stats = jax.lax.while_loop(cond, body, carry)
    return tokens[:, :max_new_tokens], num_generated, stats
