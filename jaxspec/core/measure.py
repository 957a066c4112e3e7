"""How every speed figure is taken: one process, one pinned core, single-threaded XLA, the methods
compared timed round-robin, the spread over repeats reported, and a verdict on the machine.

A CPU speed ratio is only worth printing when nothing else competed for the core's memory system:
a tree verify reads every expert, about twice an AR step's bytes, so a memory-heavy neighbour slows
it far more than AR and turns a 1.3x into a 0.9x (docs/results.md, "Measuring speed"). The figures
of `bench/`, `jaxspec tune` and `jaxspec sweep` therefore all go through this module:

* `pin()` before the first computation: restrict the process to one core and XLA:CPU to one
  thread (the flags only take effect before the backend starts);
* `round_robin()` times every method once per round, `repeats` rounds, so a change in load hits
  them alike; the median is the figure, the spread (max - min) / median goes beside it;
* `Watch` brackets the timed work: a memory-bandwidth probe before and after, the load average and
  the busy share of the other cores over the interval (/proc/stat). `Watch.verdict` says "clean" or
  lists why not: the reference method (AR) varied by more than `MAX_SPREAD` across repeats, the
  bandwidth moved by more than `MAX_BANDWIDTH_DRIFT`, another core was busy more than `MAX_OTHER_BUSY`
  of the time, or XLA ran multi-threaded or unpinned. A benchmark prints the verdict beside its
  ratios and records it in its JSON; `jaxspec tune` refuses to write a choice from a loaded run.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SINGLE_THREAD_FLAG = "--xla_cpu_multi_thread_eigen=false"
MAX_SPREAD = 0.10  # (max - min) / median of the reference method across repeats
MAX_BANDWIDTH_DRIFT = 0.10  # |after - before| / before of the bandwidth probe
MAX_OTHER_BUSY = 0.25  # busy share of the cores this process is not pinned to, over the run
PROBE_MB = 64  # the probe's working set: about a checkpoint's weights, which stream from the shared L3 too


# ---- pinning -------------------------------------------------------------------------------------


def pin(core: int | None = None) -> dict[str, Any]:
    """Restrict this process to one core (`core`, default the last one it may use) and, when XLA's
    CPU backend has not started yet, to one XLA thread. -> what was done, for the record.

    Call it before the first jax computation: XLA reads XLA_FLAGS when its backend starts."""
    done: dict[str, Any] = {}
    if hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        target = allowed[-1] if core is None else core
        if target not in allowed:
            raise ValueError(f"core {target} is not one this process may use ({allowed})")
        os.sched_setaffinity(0, {target})
        done["core"] = target
    flags = os.environ.get("XLA_FLAGS", "")
    if SINGLE_THREAD_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {SINGLE_THREAD_FLAG}".strip()
        done["xla_flags_set"] = True
    return done


def pin_unless_gpu(core: int | None = None) -> dict[str, Any]:
    """`pin(core)` unless this process may drive a GPU (JAX_PLATFORMS names one, or a CUDA / ROCm
    plugin is installed): a GPU's speed is not the host core's, and a GPU driver wants its threads.
    -> what was done ({} when nothing)."""
    import importlib.util

    platforms = os.environ.get("JAX_PLATFORMS", "")
    if any(p in platforms for p in ("cuda", "gpu", "rocm", "tpu")):
        return {}
    if not platforms and any(importlib.util.find_spec(m) is not None
                             for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "libtpu")):
        return {}
    return pin(core)


def pinned_core() -> int | None:
    """The one core this process runs on, or None when it may run on several."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = os.sched_getaffinity(0)
    return next(iter(cores)) if len(cores) == 1 else None


def single_threaded() -> bool:
    return SINGLE_THREAD_FLAG in os.environ.get("XLA_FLAGS", "")


# ---- the machine ---------------------------------------------------------------------------------


def _cpu_times() -> dict[int, tuple[int, int]] | None:
    """Per core: (busy, total) jiffies from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            values = [int(v) for v in fields]
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            out[int(name[3:])] = (sum(values) - idle, sum(values))
    return out


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


@jax.jit
def _read(x: jax.Array) -> jax.Array:  # x: [n] fp32
    return jnp.sum(x)


@jax.jit
def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:  # a: [m, k], b: [k, n]
    return a @ b


def _best_seconds(fn: Callable[[], Any], calls: int) -> float:
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def bandwidth_gbs(megabytes: int = PROBE_MB, calls: int = 9) -> float:
    """Read bandwidth of this core, GB/s: the best of `calls` jitted sums over `megabytes` of fp32."""
    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    return megabytes * 2**20 / _best_seconds(lambda: _read(x), calls) / 1e9


def matmul_gflops(rows: int, size: int = 1024, calls: int = 9) -> float:
    """fp32 matmul rate of this core at `rows` x size x size, GFLOP/s (best of `calls`)."""
    a = jnp.ones((rows, size), jnp.float32)
    b = jnp.ones((size, size), jnp.float32)
    return 2 * rows * size * size / _best_seconds(lambda: _matmul(a, b), calls) / 1e9


@dataclasses.dataclass(frozen=True)
class MachineRates:
    """What this core was measured to do: the roofline's denominators."""

    bandwidth_gbs: float  # fp32 read, PROBE_MB working set
    matmul_gflops_8: float  # 8 rows
    matmul_gflops_512: float  # 512 rows

    def matmul_gflops(self, rows: int) -> float:
        """The rate at `rows` rows, interpolated in log(rows) between the two measured points."""
        t = min(max((np.log2(max(rows, 1)) - 3) / (9 - 3), 0.0), 1.0)
        return float(self.matmul_gflops_8 + t * (self.matmul_gflops_512 - self.matmul_gflops_8))


def machine_rates() -> MachineRates:
    return MachineRates(bandwidth_gbs(), matmul_gflops(8), matmul_gflops(512))


# ---- round-robin timing --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Timing:
    seconds: tuple[float, ...]  # one per round

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """(max - min) / median over the rounds, the slowest one left out when there are 5 or more
        (one preempted round says little; two do)."""
        kept = sorted(self.seconds)[:-1] if len(self.seconds) >= 5 else self.seconds
        return (max(kept) - min(kept)) / self.median


def round_robin(calls: Mapping[str, Callable[[], Any]], repeats: int,
                progress: Callable[[str], None] | None = None) -> dict[str, Timing]:
    """Each call once per round (block_until_ready on its result), `repeats` rounds; warm them up first
    (compile) yourself. -> name -> Timing."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(repeats):
        for name, call in calls.items():
            if progress is not None:
                progress(f"round {r + 1}/{repeats}: {name}")
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
    return {name: Timing(tuple(t)) for name, t in times.items()}


# ---- the verdict ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Watch:
    """Brackets timed work: `with Watch() as w: ...`, then `w.verdict(reference_timing)`."""

    probe: bool = True  # the bandwidth probe before and after (~0.2 s each)
    bandwidth_before: float | None = None
    bandwidth_after: float | None = None
    load_before: float | None = None
    load_after: float | None = None
    other_busy: float | None = None  # busy share of the cores this process is not pinned to
    seconds: float = 0.0
    _cpu: dict[int, tuple[int, int]] | None = None
    _start: float = 0.0

    def __enter__(self) -> Watch:
        self.load_before = load_average()
        if self.probe:
            self.bandwidth_before = bandwidth_gbs()
        self._cpu = _cpu_times()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._start
        after = _cpu_times()
        if self._cpu is not None and after is not None:
            mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
            others = [c for c in after if c in self._cpu and c not in mine]
            busy = sum(after[c][0] - self._cpu[c][0] for c in others)
            total = sum(after[c][1] - self._cpu[c][1] for c in others)
            self.other_busy = busy / total if total > 0 else None
        if self.probe:
            self.bandwidth_after = bandwidth_gbs()
        self.load_after = load_average()

    def verdict(self, reference: Timing | None = None, reference_name: str = "AR") -> dict[str, Any]:
        """{"clean": bool, "reasons": [...], and every number behind it}."""
        reasons = []
        if reference is not None and len(reference.seconds) > 1 and reference.spread > MAX_SPREAD:
            reasons.append(f"{reference_name} varied {100 * reference.spread:.0f}% across repeats "
                           f"(> {100 * MAX_SPREAD:.0f}%)")
        drift = None
        if self.bandwidth_before and self.bandwidth_after:
            drift = abs(self.bandwidth_after - self.bandwidth_before) / self.bandwidth_before
            if drift > MAX_BANDWIDTH_DRIFT:
                reasons.append(f"memory bandwidth moved {self.bandwidth_before:.1f} -> {self.bandwidth_after:.1f} GB/s")
        if self.other_busy is not None and self.other_busy > MAX_OTHER_BUSY:
            reasons.append(f"other cores busy {100 * self.other_busy:.0f}% of the run (> {100 * MAX_OTHER_BUSY:.0f}%)")
        if pinned_core() is None:
            reasons.append("not pinned to one core")
        if not single_threaded():
            reasons.append("XLA:CPU multi-threaded (XLA_FLAGS lacks --xla_cpu_multi_thread_eigen=false)")
        return {
            "clean": not reasons, "reasons": reasons,
            "reference_spread": None if reference is None else reference.spread,
            "bandwidth_gbs": [self.bandwidth_before, self.bandwidth_after], "bandwidth_drift": drift,
            "load_average": [self.load_before, self.load_after], "other_cores_busy": self.other_busy,
            "core": pinned_core(), "single_threaded": single_threaded(), "seconds": self.seconds,
        }


def verdict_line(verdict: Mapping[str, Any]) -> str:
    """One line of rich markup: a green "clean" or a red "LOADED" with the reasons."""
    bw = verdict.get("bandwidth_gbs") or [None, None]
    facts = ", ".join(x for x in (
        f"core {verdict['core']}" if verdict.get("core") is not None else None,
        f"bandwidth {bw[0]:.1f} -> {bw[1]:.1f} GB/s" if bw[0] and bw[1] else None,
        f"other cores {100 * verdict['other_cores_busy']:.0f}% busy" if verdict.get("other_cores_busy") is not None
        else None,
        f"reference spread {100 * verdict['reference_spread']:.0f}%" if verdict.get("reference_spread") is not None
        else None,
    ) if x)
    if verdict["clean"]:
        return f"[green]measurement: clean[/] ({facts})"
    return (f"[bold red]measurement: LOADED[/] ({'; '.join(verdict['reasons'])}): the ratios below are not a clean "
            f"figure; rerun on a quiet machine ({facts})")


def spreads(timings: Mapping[str, Timing]) -> dict[str, float]:
    return {name: t.spread for name, t in timings.items()}


def require_clean(verdict: Mapping[str, Any], what: str) -> None:
    """ValueError naming the reasons unless the verdict is clean."""
    if not verdict["clean"]:
        raise ValueError(f"{what}: the machine was loaded ({'; '.join(verdict['reasons'])}); measure on a quiet "
                         "machine or pass the flag that accepts a loaded run")


__all__: Sequence[str] = (
    "MachineRates", "Timing", "Watch", "bandwidth_gbs", "load_average", "machine_rates", "matmul_gflops",
    "pin", "pin_unless_gpu", "pinned_core", "require_clean", "round_robin", "single_threaded", "spreads",
    "verdict_line",
)
