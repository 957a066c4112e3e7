"""The serving engine: requests enter and leave the slots of one live decoding state between calls to a
program that runs a few cycles (continuous batching; `speculation/slots.py` is its device side).

One scheduling round (`Engine.step`): cancelled requests free their slots; queued requests are prefilled
into free slots (a group at a time, shapes bucketed); `run_cycles` runs up to `cycles_per_call` cycles of
every live row; each request gets the tokens its row emitted, and finished rows free their slots. `start`
runs rounds on a thread of its own; `run_until_done` runs them on the caller's (scripts, tests).

A request's tokens depend on its prompt and `SamplingParams` only (its seed, for sampling): not on its
slot, on the other requests, or on when it arrived, given the spec (greedy: token-identical to `generate`
of the prompt alone, float32).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.core.checks import next_power_of_two, positive_int
from jaxspec.core.config import ModelConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.model.network import check_params
from jaxspec.model.sampling import Sampling
from jaxspec.speculation import slots as slots_lib
from jaxspec.speculation.drafter import Draft, DraftSet
from jaxspec.speculation.generate import choose_draft, speculator
from jaxspec.speculation.inputs import MAX_STOP_IDS, SamplingParams, length_bucket, stop_array

# on_update(new tokens, finish reason or None): called on the engine's thread after every round that gave
# the request tokens, and once with its finish reason ("stop", "length" or "cancelled").
OnUpdate = Callable[[list[int], "str | None"], Any]
STOP_WIDTH = MAX_STOP_IDS + 1  # a row's stop ids: the model's eos and the request's own


class QueueFull(Exception):
    """The engine's queue holds `max_queue` requests already (HTTP 429)."""


@dataclasses.dataclass
class Request:
    """One request, as the engine tracks it."""

    id: int
    prompt: list[int]
    params: SamplingParams
    on_update: OnUpdate | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    cycles: int = 0  # cycles its row ran (tau = tokens / cycles)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    slot: int | None = None
    seed: int = 0  # the seed its draws use (the params' own, or one the engine drew)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass
class Counters:
    """What /metrics reports: totals since the engine started."""

    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    row_cycles: int = 0  # sum over rounds of the cycles each live row ran
    cycle_tokens: int = 0  # tokens those cycles emitted (tau = cycle_tokens / row_cycles)
    calls: int = 0
    busy_seconds: float = 0.0


class Engine:
    """Continuous batching of exact speculative cycles over `num_slots` rows.

    params / cfg: the target (`load_checkpoint(...)`); draft / spec / tuning / calibration / accept: as
    `speculative_generate`'s, spec="auto" taking the tuning's choice for `num_slots` rows, spec None or "none"
    autoregressive decoding. max_len: the cache length of every slot (prompt + max_tokens + a cycle's
    overshoot must fit). cycles_per_call: cycles per device call (one host round trip each; a request that
    finishes mid-call waits for the call's end). max_queue: requests waiting beyond it are refused (QueueFull).
    """

    def __init__(self, params: Any, cfg: ModelConfig, *, draft: Draft | DraftSet | None = None,
                 spec: SpecConfig | str | None = "auto", tuning: Any = None, calibration: Any = None,
                 accept: str | None = None, num_slots: int = 8, max_len: int = 2048, cycles_per_call: int = 4,
                 max_queue: int = 256, eos_id: int | None = None):
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        check_params(params, cfg)
        self.num_slots = positive_int("num_slots", num_slots)
        self.cycles_per_call = positive_int("cycles_per_call", cycles_per_call)
        self.max_queue = positive_int("max_queue", max_queue)
        positive_int("max_len", max_len)
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len={max_len} exceeds the model's max length {cfg.max_position_embeddings}")
        self.cfg, self.max_len = cfg, int(max_len)
        self.eos_id = cfg.eos_id if eos_id is None else eos_id
        if isinstance(spec, str) and spec in ("none", "ar"):
            spec = None
        chosen = None
        if spec is not None:
            chosen_draft, chosen = choose_draft(params, cfg, spec, draft, tuning, self.num_slots)
        if chosen is None:
            self.stepper: Any = slots_lib.Plain(cfg)
            self.models: Any = params
            self.spec_name = "ar"
        else:
            # Sampled requests need the sampled rule; greedy rows walk the argmax inside it (the same tree,
            # token-identical to `generate`), so one program serves every request.
            sp, self.models = speculator(params, cfg, chosen, chosen_draft, calibration, accept, 1.0)
            self.stepper = slots_lib.Speculative(sp)
            self.spec_name = sp.spec.name
        # committed to the device, as the programs' outputs are: jit keys its executables on committedness, and
        # fresh slots would otherwise compile each program twice (once for them, once for what it returns)
        self.slots = jax.device_put(slots_lib.empty_slots(self.stepper, self.num_slots, self.max_len, STOP_WIDTH),
                                    jax.devices()[0])
        self.counters = Counters()
        self._ids = itertools.count(1)
        self._queue: collections.deque[Request] = collections.deque()
        self._cancel: set[int] = set()
        self._live: dict[int, Request] = {}  # slot -> request
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self.started = time.time()

    # ---- requests ------------------------------------------------------------------------------

    def check(self, prompt: Any, params: SamplingParams) -> list[int]:
        """ValueError (naming the field) unless the request fits: token ids in the vocabulary, prompt +
        max_tokens + a cycle's overshoot within max_len; -> the prompt as a list of ints."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt: must be a non-empty list of token ids")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            raise ValueError("prompt: token ids must be ints")
        if min(prompt) < 0 or max(prompt) >= self.cfg.vocab_size:
            raise ValueError(f"prompt: token ids must be in [0, {self.cfg.vocab_size})")
        params.check_vocab(self.cfg.vocab_size)
        room = self.max_len - self.stepper.width
        if len(prompt) >= room:
            raise ValueError(f"prompt: {len(prompt)} tokens; this server holds at most {room - 1} prompt tokens")
        if len(prompt) + params.max_tokens > room:
            raise ValueError(f"max_tokens: {params.max_tokens} new tokens after a {len(prompt)}-token prompt exceed "
                             f"the context ({room} tokens with a cycle's overshoot); at most {room - len(prompt)}")
        return [int(t) for t in prompt]

    def submit(self, prompt: Any, params: SamplingParams, on_update: OnUpdate | None = None) -> Request:
        """Queue a request -> its `Request` (wait on `.done`); ValueError for a bad one, QueueFull."""
        prompt = self.check(prompt, params)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"the engine stopped on an error: {self._error!r}")
            if len(self._queue) >= self.max_queue:
                self.counters.rejected += 1
                raise QueueFull(f"{len(self._queue)} requests are waiting (max_queue={self.max_queue})")
            request = Request(next(self._ids), prompt, params, on_update, seed=seed)
            self._queue.append(request)
            self.counters.requests += 1
            self._wake.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request (its client went away): queued, it is dropped; live, its slot is freed next round."""
        with self._lock:
            if request.finish_reason is not None:
                return
            if request in self._queue:
                self._queue.remove(request)
                self._finish(request, "cancelled")
            else:
                self._cancel.add(request.id)
                self._wake.notify()

    # ---- scheduling ----------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def live(self) -> int:
        return len(self._live)

    def step(self) -> bool:
        """One round: cancellations, admissions, one device call -> whether there was anything to do."""
        self._release_cancelled()
        self._admit()
        if not self._live:
            return False
        start = time.perf_counter()
        self.slots, tokens, counts, cycles = slots_lib.run_cycles(self.stepper, self.models, self.slots,
                                                                  self.cycles_per_call)
        tokens, counts, cycles, done = (np.asarray(x) for x in (tokens, counts, cycles, self.slots.done))
        self.counters.calls += 1
        self.counters.cycle_tokens += int(counts.sum())
        self.counters.busy_seconds += time.perf_counter() - start
        for slot, request in list(self._live.items()):
            new = tokens[slot, : counts[slot]].tolist()
            request.cycles += int(cycles[slot])
            self.counters.row_cycles += int(cycles[slot])
            self._deliver(request, new)
            if done[slot]:
                del self._live[slot]
                with self._lock:
                    self._finish(request, self._reason(request))
        return True

    def warm_up(self, max_prompt: int | None = None) -> int:
        """Compile every program a request up to `max_prompt` tokens (default: the longest that fits) can need
        (insert for each prompt width, run_cycles) before any request arrives, so none waits on a compile
        -> programs compiled now. Call before `start`."""
        before = slots_lib.compile_count()
        longest = self.max_len - self.stepper.width - 1 if max_prompt is None else max_prompt
        widths = sorted({length_bucket(n, self.max_len, minimum=64) for n in range(1, longest + 1)})
        for width in widths:  # a padding row (slot index num_slots): the slots are left as they are
            dummy = Request(0, [0] * width, SamplingParams(max_tokens=1), None)
            rows, tokens, lengths, options = self._row(dummy, self.num_slots)
            self.slots, _ = slots_lib.insert(self.stepper, self.models, self.slots, rows, tokens, lengths, options)
        self.slots, *_ = slots_lib.run_cycles(self.stepper, self.models, self.slots, self.cycles_per_call)
        return slots_lib.compile_count() - before

    def run_until_done(self) -> None:
        """Run rounds on this thread until no request is queued or live."""
        while self.step() or self._queue:
            pass

    def start(self) -> None:
        """Run rounds on a background thread until `shutdown`."""
        if self._thread is not None:
            raise RuntimeError("the engine is running already")
        self._thread = threading.Thread(target=self._loop, name="jaxspec-engine", daemon=True)
        self._thread.start()

    def shutdown(self, drain_seconds: float = 30.0) -> None:
        """Stop taking work, let live and queued requests finish for up to `drain_seconds`, cancel the rest."""
        deadline = time.perf_counter() + drain_seconds
        while (self._live or self._queue) and time.perf_counter() < deadline and self._thread is not None \
                and self._thread.is_alive():
            time.sleep(0.01)
        with self._lock:
            self._stopping = True
            for request in list(self._queue):
                self._finish(request, "cancelled")
            self._queue.clear()
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        for request in self._live.values():
            self._finish(request, "cancelled")
        self._live.clear()

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self._queue and not self._live and not self._cancel:
                        self._wake.wait()
                    if self._stopping:
                        return
                self.step()
        except BaseException as error:  # a failed device call: every waiting request learns of it
            with self._lock:
                self._error = error
                for request in [*self._queue, *self._live.values()]:
                    self._finish(request, "error")
                self._queue.clear()
                self._live.clear()
            raise

    def _release_cancelled(self) -> None:
        with self._lock:
            ids, self._cancel = self._cancel, set()
        rows = [slot for slot, r in self._live.items() if r.id in ids]
        if not rows:
            return
        self.slots = slots_lib.release(self.slots, jnp.asarray(_pad_rows(rows, self.num_slots)))
        for slot in rows:
            request = self._live.pop(slot)
            with self._lock:
                self._finish(request, "cancelled")

    def _admit(self) -> None:
        """Prefill queued requests into free slots, one request per `insert` call: a program per prompt width
        only (grouping them would multiply the programs by the group sizes, past the program cache)."""
        free = [s for s in range(self.num_slots) if s not in self._live]
        with self._lock:
            group = [self._queue.popleft() for _ in range(min(len(free), len(self._queue)))]
        for request, slot in zip(group, free, strict=False):
            request.slot = slot
            self.slots, first = slots_lib.insert(self.stepper, self.models, self.slots, *self._row(request, slot))
            self.counters.prompt_tokens += len(request.prompt)
            self._deliver(request, [int(first[0])])
            if bool(self.slots.done[slot]):
                with self._lock:
                    self._finish(request, self._reason(request))
            else:
                self._live[slot] = request

    def _row(self, request: Request, slot: int) -> tuple[Any, ...]:
        """insert's arguments for one request: (rows, tokens, lengths, options), prompt width bucketed."""
        p = request.params
        # prompt widths from 64 up: fewer programs; the prefill loops over the chunks the prompt fills
        tokens = np.zeros((1, length_bucket(len(request.prompt), self.max_len, minimum=64)), np.int32)
        tokens[0, : len(request.prompt)] = request.prompt
        ids = (() if self.eos_id is None else (self.eos_id,)) + p.stop_token_ids
        stop = stop_array(ids, STOP_WIDTH)[None, :]
        seeds = np.asarray([[request.seed & 0xFFFFFFFF], [request.seed >> 32]], np.uint32)
        sampling = Sampling(jnp.asarray([p.temperature], jnp.float32), jnp.asarray([p.top_k or 0], jnp.int32),
                            jnp.asarray([p.top_p or 1.0], jnp.float32),
                            slots_lib.request_keys(jnp.asarray(seeds[0]), jnp.asarray(seeds[1])))
        options = slots_lib.RowOptions(sampling, jnp.asarray(stop), jnp.asarray([p.max_tokens], jnp.int32))
        return (jnp.asarray([slot], jnp.int32), jnp.asarray(tokens), jnp.asarray([len(request.prompt)], jnp.int32),
                options)

    def _deliver(self, request: Request, new: list[int]) -> None:
        if not new:
            return
        if request.first_token is None:
            request.first_token = time.perf_counter()
        request.tokens.extend(new)
        self.counters.generated_tokens += len(new)
        if request.on_update is not None:
            request.on_update(new, None)

    def _reason(self, request: Request) -> str:
        stops = set(request.params.stop_token_ids) | ({self.eos_id} if self.eos_id is not None else set())
        return "stop" if request.tokens and request.tokens[-1] in stops else "length"

    def _finish(self, request: Request, reason: str) -> None:  # under the lock
        if request.finish_reason is not None:
            return
        request.finish_reason, request.finished = reason, time.perf_counter()
        if reason == "cancelled":
            self.counters.cancelled += 1
        else:
            self.counters.finished += 1
        if request.on_update is not None:
            request.on_update([], reason)
        request.done.set()

    # ---- reporting -----------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        c = self.counters
        return {
            "requests_total": c.requests, "requests_finished_total": c.finished,
            "requests_cancelled_total": c.cancelled, "requests_rejected_total": c.rejected,
            "prompt_tokens_total": c.prompt_tokens, "generated_tokens_total": c.generated_tokens,
            "row_cycles_total": c.row_cycles, "device_calls_total": c.calls, "busy_seconds_total": c.busy_seconds,
            "tokens_per_busy_second": c.generated_tokens / c.busy_seconds if c.busy_seconds else 0.0,
            "tau": c.cycle_tokens / c.row_cycles if c.row_cycles else 0.0,
            "queue_depth": len(self._queue), "slots_live": len(self._live), "slots_total": self.num_slots,
        }


def _pad_rows(rows: list[int], num_slots: int) -> np.ndarray:
    out = np.full((next_power_of_two(len(rows)),), num_slots, np.int32)
    out[: len(rows)] = rows
    return out


def generate_all(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[Request]:
    """Submit every prompt and run the engine on this thread until all are done -> their requests."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    requests = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.run_until_done()
    return requests

