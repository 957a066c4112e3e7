"""The two decoding entry points, each one jitted `lax.while_loop`: `generate` (plain autoregressive
decoding, the reference) and `speculative_generate` (a cycle per iteration, `speculation/cycle.py`).

Both emit tokens through the same `emit`, stop at eos or max_new_tokens, and report the same stats
keys. Shapes are bucketed (batch to a power of two, prompt and cache length to powers of two), so a
steady workload compiles once; `compile_count()` / `speculative_compile_count()` let tests check it.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.core import stream as stream_lib
from jaxspec.core.config import ModelConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.core.spec import SpecConfig
from jaxspec.model import state as state_lib
from jaxspec.model.network import ModelParams, Models, check_params, extend, without_mtp
from jaxspec.model.prefill import chunked_prefill
from jaxspec.model.runner import on_mesh, pad_batch
from jaxspec.model.sampling import Sampling, sample_tokens
from jaxspec.sharding.active import constrain_state
from jaxspec.speculation.auto import DRAFT_SEP, NO_SPECULATION, as_tuning, auto_spec, split_choice
from jaxspec.speculation.cycle import SpecState, Speculator, prefill, speculative_cycle
from jaxspec.speculation.drafter import Draft, DraftSet, Unreadable
from jaxspec.speculation.inputs import DecodeOptions, SamplingParams, length_bucket, prepare_prompts
from jaxspec.speculation.mtp import MTPDrafter
from jaxspec.speculation.policy import Policy
from jaxspec.speculation.values import Calibration, load_calibration, resolve_scores

# A stream function: (tokens [B, n] int32 emitted this step / cycle, counts [B] int32 valid per row).
Stream = Callable[[np.ndarray, np.ndarray], Any]


@dataclasses.dataclass
class GenerateOutput:
    tokens: np.ndarray  # [B, max_new_tokens] int32, pad_id after a sequence ends
    lengths: np.ndarray  # [B] generated tokens per sequence (eos included)
    stats: dict[str, Any]  # the same keys for both loops (`summarize_stats`)


@dataclasses.dataclass(frozen=True)
class LoopShape:
    """The static sizes of a loop: tokens to generate, the cache length, whether it streams."""

    max_new_tokens: int
    max_len: int
    stream: bool = False


@struct.dataclass
class Emitted:
    """The tokens a loop has emitted so far, per sequence."""

    tokens: jax.Array  # [B, W] int32, pad_id past each row's count
    count: jax.Array  # [B] int32 tokens generated
    done: jax.Array  # [B] bool: hit a stop id or max_new_tokens

    @classmethod
    def first(cls, token: jax.Array, width: int, max_new_tokens: Any, stop: jax.Array) -> Emitted:
        """The first generated token (drawn from the prefill) of every row; token [B]; stop as `emit`'s."""
        pad = jnp.maximum(stop_rows(stop, token.shape[0])[:, 0], 0)  # a row's first stop id, else 0
        tokens = jnp.broadcast_to(pad[:, None], (token.shape[0], width)).at[:, 0].set(token)
        count = jnp.ones(token.shape, jnp.int32)
        return cls(tokens, count, is_stop(token[:, None], stop)[:, 0] | (count >= max_new_tokens))


def stop_rows(stop: jax.Array, batch: int) -> jax.Array:
    """stop ids [], [M] (every row's) or [B, M] (per row), -1 = none -> [B, M]."""
    stop = stop.reshape(1, -1) if stop.ndim < 2 else stop
    return jnp.broadcast_to(stop, (batch, stop.shape[1]))


def is_stop(new: jax.Array, stop: jax.Array) -> jax.Array:
    """new [B, n] tokens -> [B, n] bool: which are stop ids of their row."""
    return jnp.any(new[:, :, None] == stop_rows(stop, new.shape[0])[:, None, :], axis=-1)


def take_count(new: jax.Array, num_new: jax.Array, count: jax.Array, done: jax.Array, stop: jax.Array,
               max_new_tokens: Any) -> tuple[jax.Array, jax.Array]:
    """How many of the `num_new` [B] tokens `new` [B, n] each row takes (up to and with its first stop id, up
    to max_new_tokens ([] or [B]) in all; finished rows take none) -> (taken [B], done after [B])."""
    slot = jnp.arange(new.shape[1])[None, :]
    hit = is_stop(new, stop) & (slot < num_new[:, None])
    taken = jnp.where(jnp.any(hit, axis=1), jnp.argmax(hit, axis=1) + 1, num_new)
    taken = jnp.where(done, 0, jnp.minimum(taken, max_new_tokens - count))
    stopped = jnp.any(hit & (slot < taken[:, None]), axis=1)
    return taken, done | stopped | (count + taken >= max_new_tokens)


def emit(out: Emitted, new: jax.Array, num_new: jax.Array, stop: jax.Array, max_new_tokens: Any,
         channel: jax.Array | None) -> Emitted:
    """Append the first `num_new` [B] of `new` [B, n] to each row, cut after a stop id and at max_new_tokens
    (finished rows take nothing); with a stream channel, send what was appended to the host."""
    b, n = new.shape
    count, done = take_count(new, num_new, out.count, out.done, stop, max_new_tokens)
    slot = jnp.arange(n)[None, :]
    column = jnp.where(slot < count[:, None], out.count[:, None] + slot, out.tokens.shape[1])
    tokens = out.tokens.at[jnp.arange(b)[:, None], column].set(new, mode="drop")
    if channel is not None:
        stream_lib.send(channel, new, count)
    return Emitted(tokens, out.count + count, done)


# ---- plain decoding -------------------------------------------------------------------------------


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
    *,
    sampling: SamplingParams | None = None,
    stream: Stream | None = None,
) -> GenerateOutput:
    """Plain autoregressive decoding; the reference every speculative path must match. `sampling`: the
    decoding options as one SamplingParams, in place of max_new_tokens / temperature / top_k / top_p / rng.
    `stream(tokens, counts)` is called on the host after every step with the tokens it emitted (rows of the
    real batch)."""
    opts = DecodeOptions.create(cfg, max_new_tokens, temperature, top_k, top_p, eos_id, rng, mesh, sampling)
    check_params(params, cfg)
    batch = pad_batch(prepare_prompts(cfg, prompts, opts.max_new_tokens, prompt_lengths), opts.mesh)
    max_len = length_bucket(batch.tokens.shape[1] + opts.max_new_tokens, cfg.max_position_embeddings, minimum=64)
    shape = LoopShape(opts.max_new_tokens, max_len, stream is not None)
    with _streaming(stream, batch.batch, opts.mesh) as channel:
        tokens, lengths, steps = on_mesh(_generate_loop, opts.mesh, len(batch.lengths))(
            params, cfg, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), shape, jnp.asarray(opts.stop),
            opts.sampling, channel,
        )
    tokens, lengths = np.asarray(tokens)[: batch.batch], np.asarray(lengths)[: batch.batch]
    cycles = np.maximum(lengths - 1, 0)  # one decode step per token after the first
    zeros = np.zeros_like(cycles)
    per_sequence = {"cycles": cycles, "accepted": zeros, "verified": cycles, "depth_hits": zeros[:, None][:, :0],
                    "rank_hist": zeros[:, None][:, :0]}
    return GenerateOutput(tokens=tokens, lengths=lengths,
                          stats=summarize_stats(per_sequence, NO_SPECULATION, int(steps), scores=None))


def compile_count() -> int:
    """Generation programs compiled so far, freed ones included (static-shape check for tests)."""
    return _generate_loop.compile_count()


# Its compiled programs live in `jaxspec.core.programs`' bounded LRU (like `_speculative_loop`'s).
@functools.partial(bounded_jit, static_argnums=(1, 4))
def _generate_loop(
    params: ModelParams,
    cfg: ModelConfig,
    prompt_tokens: jax.Array,  # [Bb, Sb] int32
    prompt_lengths: jax.Array,  # [Bb] int32
    shape: LoopShape,
    stop: jax.Array,  # [M] int32 stop ids, -1 = none
    sampling: Sampling,
    channel: jax.Array,  # [] int32 stream channel (used when shape.stream)
):
    bb = prompt_tokens.shape[0]
    key, temperature, top_k, top_p = sampling.key, sampling.temperature, sampling.top_k, sampling.top_p
    channel = channel if shape.stream else None
    state = constrain_state(state_lib.init_state(cfg, bb, shape.max_len))
    prefilled, state = chunked_prefill(params, cfg, state, prompt_tokens, prompt_lengths)
    first = sample_tokens(prefilled.last_logits, jax.random.fold_in(key, 0), temperature, top_k, top_p)
    out = Emitted.first(first, shape.max_new_tokens, shape.max_new_tokens, stop)
    if channel is not None:
        stream_lib.send(channel, first[:, None], jnp.ones_like(first))

    def body(carry):
        state, last, out, step = carry
        active = ~out.done
        logits, state = extend(params, cfg, state, last[:, None], active[:, None])
        nxt = sample_tokens(logits.logits[:, 0], jax.random.fold_in(key, step), temperature, top_k, top_p)
        out = emit(out, nxt[:, None], active.astype(jnp.int32), stop, shape.max_new_tokens, channel)
        return state, jnp.where(active, nxt, last), out, step + 1

    def cond(carry):
        return (carry[3] < shape.max_new_tokens) & ~jnp.all(carry[2].done)

    _, _, out, step = jax.lax.while_loop(cond, body, (state, first, out, jnp.int32(1)))
    return out.tokens, out.count, step


# ---- speculative decoding -----------------------------------------------------------------------


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
    *,
    draft: Draft | DraftSet | None = None,
    calibration: Any = None,
    tuning: Any = None,
    accept: str | None = None,
    sampling: SamplingParams | None = None,
    stream: Stream | None = None,
) -> GenerateOutput:
    """Tree speculative decoding; greedy output is token-identical to `generate` (float32; see the README
    for bfloat16), and with temperature > 0 every token is an exact draw from the distribution `generate`
    samples from (same temperature / top-k / top-p processing; lossless tree acceptance).

    draft: the draft model (`load_checkpoint(...).draft`: drafter, parameters, calibration, tuning); None =
    the MTP block in `params`, uncalibrated; a `DraftSet` (`load_checkpoint(path, draft="all").draft`):
    every draft of the checkpoint, the spec naming the one to run ("dspark/s5_k1_d6"). calibration: node
    values to rank by (a `Calibration`, or its file / checkpoint folder), overriding the draft's own.
    spec="auto": the spec `jaxspec tune` chose for this batch size (`tuning`: a `Tuning`, its file or
    folder; default the draft's own), with a DraftSet the draft and spec chosen among all of them; where
    it chose no speculation this is `generate`. accept: "block" (sampled drafts verified sequence by
    sequence, the default at temperature > 0), "residual" (the same drafts token by token) or "target" (top-K
    drafts), `speculation/policy.py`. sampling, stream: as `generate`'s (stream once per cycle).
    """
    opts = DecodeOptions.create(cfg, max_new_tokens, temperature, top_k, top_p, eos_id, rng, mesh, sampling)
    check_params(params, cfg)
    num_prompts = len(prompts) if isinstance(prompts, (list, tuple)) else int(np.shape(prompts)[0])
    no_draft = draft is None and calibration is None
    draft, spec = choose_draft(params, cfg, spec, draft, tuning, max(num_prompts, 1))
    if spec is None:  # spec="auto" where the tuning chose no speculation
        return generate(params, cfg, prompts, max_new_tokens, temperature, top_k, top_p, eos_id, rng, mesh,
                        prompt_lengths, sampling=sampling, stream=stream)
    sp, models = speculator(params, cfg, spec, draft, calibration, accept, float(opts.sampling.temperature),
                            warn=no_draft)
    spec = sp.spec
    extra = spec.num_steps + 1  # a cycle may overshoot max_new_tokens by up to S + 1 slots
    batch = pad_batch(prepare_prompts(cfg, prompts, opts.max_new_tokens, prompt_lengths, overshoot=extra), opts.mesh)
    max_len = length_bucket(batch.tokens.shape[1] + opts.max_new_tokens + extra, cfg.max_position_embeddings,
                            minimum=64)
    shape = LoopShape(opts.max_new_tokens, max_len, stream is not None)
    with _streaming(stream, batch.batch, opts.mesh) as channel:
        tokens, lengths, stats, steps = on_mesh(_speculative_loop, opts.mesh, len(batch.lengths))(
            models, sp, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), shape, jnp.asarray(opts.stop),
            opts.sampling, channel,
        )
    n = batch.batch
    tokens, lengths = np.asarray(tokens)[:n], np.asarray(lengths)[:n]
    per_sequence = {k: np.asarray(v)[:n] for k, v in dataclasses.asdict(stats).items()}
    return GenerateOutput(tokens=tokens, lengths=lengths,
                          stats=summarize_stats(per_sequence, spec.name, int(steps), scores=spec.scores))


def speculator(params: ModelParams, cfg: ModelConfig, spec: Any, draft: Draft, calibration: Any, accept: str | None,
               temperature: float, warn: bool = False) -> tuple[Speculator, Models]:
    """The static cycle (spec checked, node values resolved from the draft's calibration or `calibration`,
    the policy for `accept` at `temperature`) and the models it runs; `warn`: no draft was named."""
    spec = _check_spec(cfg, spec, draft)
    spec, values = resolve_scores(spec, calibration_of(draft, calibration, spec, cfg))
    if warn and values is None and spec.topk > 1:
        _warn_uncalibrated(spec)
    sp = Speculator(cfg, spec, draft.drafter, Policy.choose(accept, temperature, values))
    # The draft travels as draft.params; a V4 target's own MTP block is left out of the target.
    models = Models(target=without_mtp(params), drafter=draft.params)
    return sp, models


def _warn_uncalibrated(spec: SpecConfig) -> None:
    """A tree ranked by raw draft probabilities is the trap of `cfg, params, tok = load_checkpoint(...)`:
    the checkpoint's calibration travels with its draft, which that unpacking drops (measured: a K = 2
    tree then accepts less than the chain). Python shows the warning once per calling line."""
    warnings.warn(
        f"{spec.name}: no draft= given, so this tree ranks its nodes by raw draft probabilities (uncalibrated); "
        "pass draft=ckpt.draft (ckpt = load_checkpoint(path)) to rank them by the checkpoint's calibration",
        UserWarning, stacklevel=4)


def choose_draft(params: ModelParams, cfg: ModelConfig, spec: Any, draft: Draft | DraftSet | None, tuning: Any,
                 batch_size: int) -> tuple[Draft, Any]:
    """The draft to run and its spec (None: spec="auto" chose no speculation for this batch size): from a
    DraftSet the one the spec names or the tuning chose, else `draft_of`."""
    if isinstance(draft, DraftSet):
        draft, spec = _from_set(draft, spec, tuning, batch_size)
    else:
        draft = draft_of(params, cfg, draft)
        if isinstance(spec, str) and spec == "auto":
            spec = auto_spec(_tuning_of(draft, tuning), batch_size) or _PLAIN
        elif tuning is not None:
            raise ValueError('tuning= is only used with spec="auto"')
    return draft, None if spec is _PLAIN else spec


def draft_of(params: ModelParams, cfg: ModelConfig, draft: Draft | None) -> Draft:
    """The draft to run: `draft` checked, else the MTP block of `params` (uncalibrated, untuned)."""
    if draft is None:
        if params.mtp is None or not cfg.has_mtp:
            raise ValueError("speculation needs a draft: these params have no MTP block; pass draft= "
                             "(e.g. load_checkpoint(path).draft)")
        return Draft("default", MTPDrafter(), params.mtp)
    if not isinstance(draft, Draft):
        raise ValueError(f"draft must be a jaxspec Draft (load_checkpoint(path).draft), got {type(draft).__name__}")
    return draft


_PLAIN = object()  # what spec="auto" becomes where the tuning chose no speculation


def _from_set(drafts: DraftSet, spec: Any, tuning: Any, batch_size: int) -> tuple[Draft, Any]:
    """The draft of `drafts` to run and its spec (_PLAIN: no speculation): spec="auto" takes the choice of the
    tuning across the drafts for this batch size; a spec names its draft ("dspark/s5_k1_d6")."""
    if isinstance(spec, str) and spec == "auto":
        chosen = drafts.tuning if tuning is None else as_tuning(tuning)
        if chosen is None:
            raise ValueError('spec="auto" over several drafts needs their tuning: `jaxspec tune --draft all` writes '
                             "drafts/tune.json beside the checkpoint; or pass tuning=")
        if isinstance(chosen, Unreadable):
            chosen.fail()
        name, spec = chosen.choice_for(batch_size)
        if spec is None:
            return drafts.drafts[0], _PLAIN
        if name is None:
            raise ValueError(f"this tuning chose {spec.name} for one draft, not among drafts "
                             f"({', '.join(drafts.names)}): pass that draft, or tune with --draft all")
        return drafts[name], spec
    if tuning is not None:
        raise ValueError('tuning= is only used with spec="auto"')
    if isinstance(spec, str) and DRAFT_SEP in spec:
        name, spec = split_choice(spec)
        return drafts[name], spec
    shown = spec.name if isinstance(spec, SpecConfig) else str(spec)
    raise ValueError(f"draft= holds drafts {', '.join(drafts.names)}: name the one to run in the spec "
                     f"('{drafts.names[-1]}{DRAFT_SEP}{shown}'), pass spec=\"auto\", or pass one draft (drafts[NAME])")


def _tuning_of(draft: Draft, tuning: Any) -> Any:
    if tuning is not None:
        return as_tuning(tuning)
    if draft.tuning is None:
        raise ValueError('spec="auto" needs tuning= (a Tuning, or the folder `jaxspec tune` wrote tune.json to), '
                         "or draft= a checkpoint's draft that has one (load_checkpoint(path).draft)")
    if isinstance(draft.tuning, Unreadable):
        draft.tuning.fail()
    return draft.tuning


def calibration_of(draft: Draft, calibration: Any, spec: SpecConfig, cfg: ModelConfig) -> Calibration | None:
    """`calibration=` (a Calibration, or its file checked against the draft), else the one the draft
    carries for the spec's value source (`Draft.calibration_for`)."""
    scores = spec.scores
    if calibration is None:
        calibration = draft.calibration_for(spec.values)
        if isinstance(calibration, Unreadable):
            if scores == "draft":
                return None
            calibration.fail()
        return calibration
    if scores == "draft":
        raise ValueError('calibration= is unused with scores="draft"; pass one or the other')
    if isinstance(calibration, (str, bytes)) or hasattr(calibration, "__fspath__"):
        return load_calibration(calibration, draft.params, cfg)  # a file is checked against the draft
    return calibration


def _check_spec(cfg: ModelConfig, spec: Any, draft: Draft) -> SpecConfig:
    spec = SpecConfig.parse(spec) if isinstance(spec, str) else spec
    if not isinstance(spec, SpecConfig):
        raise ValueError(f"spec must be a SpecConfig or a name like 's3_k2_d6', got {spec!r}")
    spec.validate_for(cfg)
    draft.drafter.check(cfg, spec)
    return spec


class _Rows:
    """The stream function of one call, seeing only the rows of the real batch."""

    def __init__(self, fn: Stream, batch: int):
        self.fn, self.batch = fn, batch

    def __call__(self, tokens: np.ndarray, counts: np.ndarray) -> None:
        self.fn(tokens[: self.batch], counts[: self.batch])


def _streaming(stream: Stream | None, batch: int, mesh: Any):
    if stream is None:
        return _NoChannel()
    if mesh is not None:
        raise ValueError("stream= is for single-device runs; drop mesh= or stream=")
    return stream_lib.channel(_Rows(stream, batch))


class _NoChannel:
    def __enter__(self) -> np.int32:
        return np.int32(0)

    def __exit__(self, *exc: Any) -> None:
        return None


def speculative_compile_count() -> int:
    """Speculative loops compiled so far, freed ones included."""
    return _speculative_loop.compile_count()


@functools.partial(bounded_jit, static_argnums=(1, 4))
def _speculative_loop(
    models: Models,
    sp: Speculator,
    prompt_tokens: jax.Array,  # [Bb, Sb] int32
    prompt_lengths: jax.Array,  # [Bb] int32
    shape: LoopShape,
    stop: jax.Array,  # [M] int32 stop ids, -1 = none
    sampling: Sampling,
    channel: jax.Array,  # [] int32 stream channel (used when shape.stream)
):
    channel = channel if shape.stream else None
    state = prefill(sp, models, prompt_tokens, prompt_lengths, shape.max_len, sampling)
    width = shape.max_new_tokens + sp.spec.num_steps + 1
    out = Emitted.first(state.root, width, shape.max_new_tokens, stop)
    if channel is not None:
        stream_lib.send(channel, state.root[:, None], jnp.ones_like(state.root))

    def body(carry: tuple[SpecState, Emitted, jax.Array]):
        state, out, step = carry
        active = ~out.done
        state, cycle = speculative_cycle(sp, models, state, sampling, active)
        drafted = cycle.path[:, 1:]  # the accepted drafts, then the bonus token
        a = cycle.num_accepted[:, None]
        slot = jnp.arange(sp.spec.num_steps + 1)[None, :]
        new = jnp.where(slot < a, jnp.pad(drafted, ((0, 0), (0, 1))), cycle.bonus[:, None])
        out = emit(out, new, jnp.where(active, cycle.num_accepted + 1, 0), stop, shape.max_new_tokens, channel)
        return state, out, step + 1

    state, out, steps = jax.lax.while_loop(lambda carry: ~jnp.all(carry[1].done), body, (state, out, jnp.int32(0)))
    return out.tokens[:, : shape.max_new_tokens], out.count, state.stats, steps


def summarize_stats(per_sequence: dict[str, np.ndarray], spec_name: str, steps: int, scores: str | None
                    ) -> dict[str, Any]:
    """Aggregate per-sequence counters (cycles, accepted, verified, depth_hits, rank_hist) into tau,
    per-depth acceptance and the rank histogram; the same keys for plain decoding (tau 1, one token
    verified per step) and speculation. `stats["per_sequence"]` of an output feeds back in."""
    per_sequence = {k: np.asarray(per_sequence[k]) for k in ("cycles", "accepted", "verified", "depth_hits",
                                                             "rank_hist")}
    cycles, accepted, verified = per_sequence["cycles"], per_sequence["accepted"], per_sequence["verified"]
    total_cycles = int(cycles.sum())
    denom = max(total_cycles, 1)
    return {
        "spec": spec_name,
        "scores": scores,
        "decode_steps": steps,
        "cycles": total_cycles,
        "mean_accepted_length": float((accepted.sum() + total_cycles) / denom) if total_cycles else 1.0,
        "mean_verified": float(verified.sum() / denom) if total_cycles else 1.0,
        "per_depth_acceptance": (per_sequence["depth_hits"].sum(0) / denom).tolist(),
        "rank_histogram": per_sequence["rank_hist"].sum(0).tolist(),
        "per_sequence": {
            **{k: v.tolist() for k, v in per_sequence.items()},
            "mean_accepted_length": ((accepted + cycles) / np.maximum(cycles, 1)).tolist(),
        },
    }
