"""A bounded set of live compiled programs, so a long notebook or sweep process never runs out of
memory maps.

Every XLA:CPU executable keeps its machine code in memory maps of the process (a speculative loop
of a small model holds one to two thousand), and Linux refuses new maps past `vm.max_map_count`
(default 65,530): a process compiling loops one after another dies ("LLVM compilation error:
Cannot allocate memory"; the counts measured are in docs/results.md, "Compiled programs"). So the
jitted loops, the sharded programs, prefill_logits and tune's stage programs live in one
process-wide LRU holding at most `cache_size()` executables (default 20): when a call compiles one
more, the least recently used programs are freed (`clear_cache()`; tests/test_programs.py).

Each entry is its own `jax.jit` of a fresh wrapper of the function, keyed by the static arguments
(one executable per argument shape it was called with). Why not one `jax.jit` per function: its
`clear_cache()` also evicts jax's trace cache of the wrapped function object, so every entry
sharing that object would be recompiled after one eviction (measured: docs/results.md).
`jax.clear_caches()` frees everything, every other jit of the process too.

`compile_count(owner)` counts executables compiled so far, freed ones included, so it only grows:
tests and the CLI compare counts before and after a call.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import sys
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from jaxspec.core.checks import positive_int

ENV_VAR = "JAXSPEC_MAX_PROGRAMS"
# A sweep process (one batch size) cycles through AR + up to 16 specs + the rank-acceptance spec:
# 18 programs, so 20 keeps its working set warm across datasets (tune uses each stage program
# back to back, so it needs far fewer). The maps they may hold: 20 live programs x MAPS_PER_PROGRAM
# (above the largest speculative loop measured, docs/results.md "Compiled programs"), plus those of a
# process that has imported jax and built a model, stay well under the default vm.max_map_count of 65,530.
DEFAULT_MAX_PROGRAMS = 20
MAPS_PER_PROGRAM = 2_000  # the estimate behind the vm.max_map_count warning (XLA:CPU, see above)
MAP_COUNT_FILE = "/proc/sys/vm/max_map_count"


def _size_from_env() -> int:
    text = os.environ.get(ENV_VAR)
    if text is None or not text.strip():
        return DEFAULT_MAX_PROGRAMS
    try:
        return _check_size(int(text))
    except ValueError:
        raise ValueError(f"{ENV_VAR} must be an int >= 1, got {text!r}") from None


def _check_size(n: Any) -> int:
    return positive_int("the program cache size", n)


@dataclasses.dataclass
class _Entry:
    jitted: Any  # a jax.jit function: its executables (one per argument shape) are what the entry holds
    value: Any  # what `program` returns (the jitted function, or (jitted, post) for the runner)
    owner: Hashable  # whose compile count this entry's executables add to
    held: int = 0  # executables it held when last looked at (after its last call)


def _executables(jitted: Any) -> int:
    """Executables a jax.jit function holds (1 where jax does not say: its compile is counted once)."""
    size = getattr(jitted, "_cache_size", None)
    return int(size()) if callable(size) else 1


class ProgramCache:
    """An LRU of jax.jit functions holding at most `size` compiled executables in all.

    An entry is one jax.jit function: one key (static arguments), one executable per argument
    shape it was called with. `called(key)` after each call counts a new executable and frees
    least recently used entries, the called one last, until the total fits again.
    """

    def __init__(self, size: int):
        self.size = _check_size(size)
        self._entries: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()  # least recent first
        self._retired: collections.Counter[Hashable] = collections.Counter()  # freed executables per owner

    def program(self, key: Hashable, build: Callable[[], tuple[Any, Any]], owner: Hashable) -> Any:
        """The entry for `key` (now the most recently used), else `build()` -> (jax.jit function,
        value) stored as a new entry; -> value. `build` must jit a function object of its own, not
        one shared with other keys (see the module docstring), e.g. `fresh(fn)`."""
        entry = self._entries.get(key)
        if entry is None:
            jitted, value = build()
            entry = self._entries[key] = _Entry(jitted, value, owner)
        else:
            self._entries.move_to_end(key)
        return entry.value

    def called(self, key: Hashable) -> None:
        """After a call of `key`'s program: if it compiled, free programs until `size` remain."""
        entry = self._entries.get(key)
        if entry is None:
            return
        held = _executables(entry.jitted)
        if held != entry.held:
            entry.held = held
            self._evict(self.size, last=key)

    def _evict(self, keep: int, last: Hashable = None) -> None:
        """Free least recently used entries (`last` only if it alone holds more) until at most
        `keep` executables remain."""
        order = [k for k in self._entries if k != last] + ([last] if last in self._entries else [])
        for key in order:
            if self.live() <= keep:
                return
            entry = self._entries.pop(key)
            self._retired[entry.owner] += _executables(entry.jitted)
            clear = getattr(entry.jitted, "clear_cache", None)
            if callable(clear):
                clear()

    def compile_count(self, owner: Hashable) -> int:
        """Executables compiled so far for `owner`, freed ones included (never decreases)."""
        live = sum(_executables(e.jitted) for e in self._entries.values() if e.owner == owner)
        return self._retired[owner] + live

    def live(self) -> int:
        """Executables held now (as of each entry's last call): at most `size` between calls."""
        return sum(e.held for e in self._entries.values())

    def resize(self, size: int) -> None:
        self.size = _check_size(size)
        self._evict(self.size)

    def clear(self) -> None:
        self._evict(0)


CACHE = ProgramCache(_size_from_env())  # the process-wide one: every jaxspec program lives here


def program(key: Hashable, build: Callable[[], tuple[Any, Any]], owner: Hashable) -> Any:
    """`CACHE.program`, and the vm.max_map_count check at the first program of the process."""
    value = CACHE.program(key, build, owner)
    if not _WARNING["checked"]:
        _WARNING["checked"] = True
        _warn_if_map_limit_is_low()
    return value


def called(key: Hashable) -> None:
    CACHE.called(key)


def fresh(fn: Callable) -> Callable:
    """A new function object calling `fn` (same name, signature and docstring for jax.jit)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    return call


def compile_count(owner: Hashable) -> int:
    return CACHE.compile_count(owner)


def live_programs() -> int:
    return CACHE.live()


def cache_size() -> int:
    return CACHE.size


def set_cache_size(n: int) -> None:
    """At most `n` (>= 1) live compiled programs from now on; the least recently used beyond that
    are freed at once. Default `DEFAULT_MAX_PROGRAMS`, or `$JAXSPEC_MAX_PROGRAMS` at import."""
    CACHE.resize(n)
    if _WARNING["checked"]:
        _warn_if_map_limit_is_low()


def clear() -> None:
    """Free every live compiled program (each compiles again at its next call)."""
    CACHE.clear()


# ---- vm.max_map_count --------------------------------------------------------------------------


def process_map_count() -> int | None:
    """Memory maps of this process now (None where /proc is absent)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


_WARNING = {"checked": False, "warned": False}


def _warn_if_map_limit_is_low() -> None:
    """Warn once if the cache, full, could pass vm.max_map_count (Linux, XLA:CPU only: a GPU
    executable's code lives on the device, not in host memory maps)."""
    if _WARNING["warned"] or jax.default_backend() != "cpu":
        return
    try:
        with open(MAP_COUNT_FILE) as f:
            limit = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return
    now = process_map_count() or 0
    need = now + CACHE.size * MAPS_PER_PROGRAM
    if need > limit:
        _WARNING["warned"] = True
        warnings.warn(
            f"vm.max_map_count is {limit}, but {CACHE.size} live compiled programs at ~{MAPS_PER_PROGRAM} "
            f"memory maps each, plus the {now} this process holds, may need {need}: past the limit XLA's "
            f"compiler crashes. Raise it (`sudo sysctl -w vm.max_map_count=262144`) or keep fewer programs "
            f"(jaxspec.core.programs.set_cache_size, ${ENV_VAR}).",
            RuntimeWarning,
            stacklevel=_caller_level(),
        )


def _caller_level() -> int:
    """The warnings stacklevel of the first frame outside jaxspec (the user's call)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1  # level 1 = the function calling warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


# ---- compiler options ----------------------------------------------------------------------------

# XLA:CPU hands dots, reductions and elementwise chains to YNNPACK "fusions" by default; at this
# engine's sizes (a few rows per matmul, small pooling windows) each such call costs more setup than
# the plain emitters take. Off, decode steps and tree cycles are faster and prefill no slower
# (docs/results.md, "YNN fusions off", has the numbers). An XLA_FLAGS setting of the same option wins. The option is
# read by XLA's CPU compiler only; other backends ignore it.
YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"


@functools.cache
def compiler_options() -> dict[str, str]:
    """The options every program of this module compiles with ({} where this XLA lacks the option
    or XLA_FLAGS sets it)."""
    if YNN_OPTION in os.environ.get("XLA_FLAGS", ""):
        return {}
    options = {YNN_OPTION: ""}
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(1.0).compile()
    except Exception:  # an XLA without the option: its default programs
        return {}
    return options


# ---- a bounded jax.jit ---------------------------------------------------------------------------


class BoundedJit:
    """`jax.jit(fn, static_argnums, donate_argnums)` whose compiled programs live in the shared LRU:
    one entry per value of the static arguments (its executables: one per argument shape).
    Positional arguments only. `cache` (tests): a ProgramCache of its own, not the process-wide one."""

    def __init__(self, fn: Callable, static_argnums: Sequence[int] = (), donate_argnums: Sequence[int] = (),
                 cache: ProgramCache | None = None):
        functools.update_wrapper(self, fn)  # also __wrapped__: the sharded runner jits the raw function
        self.static_argnums = tuple(static_argnums)
        self.donate_argnums = tuple(donate_argnums)
        self.cache = cache

    def _key(self, args: tuple[Any, ...]) -> Hashable:
        # Static arguments only: hashing them costs microseconds, where flattening the params to
        # key on shapes cost milliseconds per call (a third of a `tiny` decode step).
        return (self, tuple(args[i] for i in self.static_argnums if i < len(args)))

    def _jitted(self, key: Hashable) -> Any:
        def build():
            jitted = jax.jit(fresh(self.__wrapped__), static_argnums=self.static_argnums,
                             donate_argnums=self.donate_argnums, compiler_options=compiler_options())
            return jitted, jitted

        if self.cache is not None:
            return self.cache.program(key, build, owner=self)
        return program(key, build, owner=self)

    def __call__(self, *args: Any) -> Any:
        key = self._key(args)
        try:
            out = self._jitted(key)(*args)
        except ValueError as e:
            if "compiler_options" not in str(e):
                raise
            # Called inside another trace (jit, eval_shape): jax takes compiler options from the
            # top-level jit only, so this call is traced inline, as an inner jax.jit would be.
            return self.__wrapped__(*args)
        (self.cache or CACHE).called(key)
        return out

    def lower(self, *args: Any) -> Any:
        return self._jitted(self._key(args)).lower(*args)

    def compile_count(self) -> int:
        """Programs of this function compiled so far, freed ones included."""
        return (self.cache or CACHE).compile_count(self)

    def __repr__(self) -> str:
        return f"BoundedJit({self.__wrapped__.__qualname__}, static_argnums={self.static_argnums})"


def bounded_jit(fn: Callable, static_argnums: Sequence[int] = (), donate_argnums: Sequence[int] = (),
                cache: ProgramCache | None = None) -> BoundedJit:
    """Use as `functools.partial(bounded_jit, static_argnums=(1,))` where `jax.jit` would go."""
    return BoundedJit(fn, static_argnums, donate_argnums, cache)
