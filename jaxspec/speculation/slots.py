"""Slots: the rows of one live decoding state, which requests enter and leave between calls (the device
side of `jaxspec serve`, docs/serving.md).

Two programs, both donating the slots:
- `insert` prefills a group of new requests (chunked, the drafter following) into fresh rows and writes
  them into the free slots they were given, with each row's own options (`RowOptions`: sampling
  settings and key, stop ids, max tokens); the first token of each comes back.
- `run_cycles` runs up to N cycles of every live row (a speculative cycle, or one plain decode step) and
  returns what each row emitted: one host round trip per N cycles, never per cycle.

A row's draws fold only its own key and its own counters (`Sampling` per row), so what a request gets does
not depend on its slot or on who shares the batch. The cycle is `Stepper`'s: `Speculative` (the speculative
cycle of `speculation/cycle.py`) or `Plain` (autoregressive decoding); the emission rule (stop ids, max
tokens) is `generate.take_count`, the same as the batch loops'.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.model import state as state_lib
from jaxspec.model.network import extend
from jaxspec.model.prefill import chunked_prefill
from jaxspec.model.sampling import Sampling, fold, sample_tokens
from jaxspec.model.state import DecodeState
from jaxspec.sharding.active import constrain_state
from jaxspec.speculation.cycle import SpecState, SpecStats, Speculator, prefill, speculative_cycle
from jaxspec.speculation.generate import is_stop, take_count


@struct.dataclass
class RowOptions:
    """Each row's decoding options on the device."""

    sampling: Sampling  # every field [B]: the row's temperature / top-k / top-p and its own key
    stop: jax.Array  # [B, M] int32 stop ids, -1 = none
    max_tokens: jax.Array  # [B] int32


@struct.dataclass
class PlainState:
    """Autoregressive decoding's state: the committed target and the last token, emitted, not yet committed."""

    target: DecodeState
    last: jax.Array  # [B] int32
    steps: jax.Array  # [B] int32 draws so far (the first token's is 0): the row's key counter


@struct.dataclass
class Slots:
    state: Any  # the stepper's state (SpecState or PlainState), one row per slot
    options: RowOptions
    count: jax.Array  # [B] int32 tokens the row's request has emitted
    done: jax.Array  # [B] bool: finished, cancelled, or never filled


class Stepper(Protocol):
    """What a slot engine runs: static (part of the compiled programs)."""

    cfg: ModelConfig

    @property
    def width(self) -> int: ...  # tokens a cycle may emit per row

    def empty(self, batch: int, max_len: int) -> Any: ...

    def prefill(self, models: Any, tokens: jax.Array, lengths: jax.Array, max_len: int,
                sampling: Sampling) -> tuple[Any, jax.Array]: ...

    def cycle(self, models: Any, state: Any, sampling: Sampling, active: jax.Array
              ) -> tuple[Any, jax.Array, jax.Array]: ...


@dataclasses.dataclass(frozen=True)
class Speculative:
    """Speculative cycles (`speculation/cycle.py`); models: `Models` (target, draft)."""

    sp: Speculator

    @property
    def cfg(self) -> ModelConfig:
        return self.sp.cfg

    @property
    def width(self) -> int:
        return self.sp.spec.num_steps + 1

    def empty(self, batch: int, max_len: int) -> SpecState:
        target = state_lib.init_state(self.cfg, batch, max_len)
        return SpecState(target=target, drafter=self.sp.drafter.init_state(self.cfg, batch, max_len),
                         root=jnp.zeros((batch,), jnp.int32), stats=SpecStats.zeros(self.sp.spec, batch))

    def prefill(self, models, tokens, lengths, max_len, sampling):
        state = prefill(self.sp, models, tokens, lengths, max_len, sampling)
        return state, state.root

    def cycle(self, models, state, sampling, active):
        state, out = speculative_cycle(self.sp, models, state, sampling, active)
        slot = jnp.arange(self.width)[None, :]
        drafted = jnp.pad(out.path[:, 1:], ((0, 0), (0, 1)))  # the accepted drafts, then the bonus token
        new = jnp.where(slot < out.num_accepted[:, None], drafted, out.bonus[:, None])
        return state, new, jnp.where(active, out.num_accepted + 1, 0)


@dataclasses.dataclass(frozen=True)
class Plain:
    """Autoregressive decoding, one token per cycle (what `generate` does); models: the target's params."""

    cfg: ModelConfig

    @property
    def width(self) -> int:
        return 1

    def empty(self, batch: int, max_len: int) -> PlainState:
        zeros = jnp.zeros((batch,), jnp.int32)
        return PlainState(state_lib.init_state(self.cfg, batch, max_len), zeros, zeros)

    def prefill(self, models, tokens, lengths, max_len, sampling):
        state = constrain_state(state_lib.init_state(self.cfg, tokens.shape[0], max_len))
        out, state = chunked_prefill(models, self.cfg, state, tokens, lengths)
        first = _draw(out.last_logits, sampling, 0)
        return PlainState(state, first, jnp.ones_like(first)), first

    def cycle(self, models, state, sampling, active):
        logits, target = extend(models, self.cfg, state.target, state.last[:, None], active[:, None])
        nxt = _draw(logits.logits[:, 0], sampling, state.steps)
        on = active.astype(jnp.int32)
        return PlainState(target, jnp.where(active, nxt, state.last), state.steps + on), nxt[:, None], on


def _draw(logits: jax.Array, sampling: Sampling, counter: Any) -> jax.Array:  # logits: [B, V]
    return sample_tokens(logits, fold(sampling.key, counter), sampling.temperature, sampling.top_k, sampling.top_p)


def request_keys(seed_low: jax.Array, seed_high: jax.Array) -> jax.Array:
    """[N] typed keys of requests from their seeds' two 32-bit halves (`SamplingParams.key`, batched)."""
    return jax.vmap(lambda lo, hi: jax.random.fold_in(jax.random.key(lo), hi))(seed_low, seed_high)


@functools.partial(bounded_jit, static_argnums=(0, 1, 2, 3))
def empty_slots(stepper: Stepper, num_slots: int, max_len: int, stop_width: int) -> Slots:
    """Every slot free (done); jitted, so that no two leaves share a buffer (the programs donate them)."""
    zeros = jnp.zeros((num_slots,), jnp.int32)
    sampling = Sampling(jnp.zeros((num_slots,), jnp.float32), zeros, jnp.ones((num_slots,), jnp.float32),
                        request_keys(zeros.astype(jnp.uint32), zeros.astype(jnp.uint32)))
    options = RowOptions(sampling, jnp.full((num_slots, stop_width), -1, jnp.int32), zeros)
    return Slots(stepper.empty(num_slots, max_len), options, zeros, jnp.ones((num_slots,), bool))


@functools.partial(bounded_jit, static_argnums=(0,), donate_argnums=(2,))
def insert(
    stepper: Stepper,
    models: Any,
    slots: Slots,
    rows: jax.Array,  # [N] int32 the free slots the new requests take; >= num_slots: a padding row
    tokens: jax.Array,  # [N, S] int32 prompts, left-aligned, zero padded
    lengths: jax.Array,  # [N] int32 >= 1
    options: RowOptions,  # [N] rows (their sampling keys from `request_keys`)
) -> tuple[Slots, jax.Array]:
    """Prefill new requests into fresh rows and write them into their slots -> (slots, first token [N])."""
    max_len = slots.state.target.max_len
    state, first = stepper.prefill(models, tokens, lengths, max_len, options.sampling)

    def put(big, new):
        return big.at[rows].set(new, mode="drop")

    count = jnp.ones_like(lengths)
    done = is_stop(first[:, None], options.stop)[:, 0] | (count >= options.max_tokens)
    slots = Slots(jax.tree.map(put, slots.state, state), jax.tree.map(put, slots.options, options),
                  put(slots.count, count), put(slots.done, done))
    return slots, first


@functools.partial(bounded_jit, static_argnums=(0, 3), donate_argnums=(2,))
def run_cycles(
    stepper: Stepper,
    models: Any,
    slots: Slots,
    num_cycles: int,
) -> tuple[Slots, jax.Array, jax.Array, jax.Array]:
    """Up to `num_cycles` cycles of the live rows (fewer once every row is done) -> (slots, tokens
    [B, num_cycles * width] each row emitted, in order, counts [B], cycles [B] each row ran)."""
    b = slots.done.shape[0]
    room = num_cycles * stepper.width
    rows = jnp.arange(b)[:, None]
    slot = jnp.arange(stepper.width)[None, :]

    def body(carry):
        slots, tokens, counts, cycles, i = carry
        active = ~slots.done
        state, new, num_new = stepper.cycle(models, slots.state, slots.options.sampling, active)
        taken, done = take_count(new, num_new, slots.count, slots.done, slots.options.stop, slots.options.max_tokens)
        column = jnp.where(slot < taken[:, None], counts[:, None] + slot, room)
        tokens = tokens.at[rows, column].set(new, mode="drop")
        slots = slots.replace(state=state, count=slots.count + taken, done=done)
        return slots, tokens, counts + taken, cycles + active.astype(jnp.int32), i + 1

    def cond(carry):
        return (carry[4] < num_cycles) & ~jnp.all(carry[0].done)

    zeros = jnp.zeros((b,), jnp.int32)
    carry = (slots, jnp.zeros((b, room), jnp.int32), zeros, zeros, jnp.int32(0))
    slots, tokens, counts, cycles, _ = jax.lax.while_loop(cond, body, carry)
    return slots, tokens, counts, cycles


@functools.partial(bounded_jit, donate_argnums=(0,))
def release(slots: Slots, rows: jax.Array) -> Slots:  # rows: [N] int32, >= num_slots ignored
    """Mark rows done (a cancelled request's slot is free for the next)."""
    return slots.replace(done=slots.done.at[rows].set(True, mode="drop"))


def compile_count() -> int:
    """Programs of the slot engine compiled so far (insert per group and prompt bucket; run_cycles once)."""
    return insert.compile_count() + run_cycles.compile_count() + release.compile_count()
