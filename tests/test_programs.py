"""The bounded program cache (`jaxspec.core.programs`): LRU order, compile counts that never fall, memory
maps given back, the vm.max_map_count warning, and a long process compiling many speculative loops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.core import programs

HERE = os.path.dirname(os.path.abspath(__file__))
LINUX_MAPS = os.path.exists("/proc/self/maps")


def _scaled_sum(x, n):  # x: [8]
    return jnp.sin(x) * n + jnp.cumsum(x)


def test_lru_keeps_the_recent_programs_and_counts_never_fall():
    cache = programs.ProgramCache(3)
    f = programs.bounded_jit(_scaled_sum, static_argnums=(1,), cache=cache)
    x, y = jnp.arange(8.0), jnp.arange(4.0)
    for n in (1, 2, 3):
        np.testing.assert_allclose(f(x, n), _scaled_sum(x, n), rtol=1e-6)
    assert f.compile_count() == 3 and cache.live() == 3
    f(x, 1)  # 1 is now the most recent; 2 the least
    assert f.compile_count() == 3
    f(x, 4)  # frees 2
    assert cache.live() == 3 and f.compile_count() == 4
    f(x, 1), f(x, 3)
    assert f.compile_count() == 4  # still compiled
    f(x, 2)  # freed before: compiles again, frees 4
    assert f.compile_count() == 5 and cache.live() == 3
    f(y, 2)  # another shape: a second executable of n=2's entry; frees 1, the least recent
    assert f.compile_count() == 6 and cache.live() == 3
    f(y, 2), f(x, 3)
    assert f.compile_count() == 6
    f(x, 1)
    assert f.compile_count() == 7 and cache.live() <= 3
    cache.resize(1)
    assert cache.live() == 1 and f.compile_count() == 7
    f(y, 1)  # the only entry now holds two executables, more than fit: it is freed itself
    assert cache.live() == 0 and f.compile_count() == 8
    f(x, 1)
    assert cache.live() == 1 and f.compile_count() == 9
    cache.clear()
    assert cache.live() == 0 and f.compile_count() == 9


def test_bounded_jit_is_jit():
    cache = programs.ProgramCache(4)
    f = programs.bounded_jit(_scaled_sum, static_argnums=(1,), cache=cache)
    x = jnp.linspace(0.0, 1.0, 8)
    np.testing.assert_array_equal(f(x, 3), jax.jit(_scaled_sum, static_argnums=(1,))(x, 3))
    assert "sine" in f.lower(x, 3).as_text()
    assert f.__wrapped__ is _scaled_sum and f.__name__ == "_scaled_sum"
    donating = programs.bounded_jit(lambda a: a * 2, donate_argnums=(0,), cache=cache)
    np.testing.assert_array_equal(donating(jnp.ones(8)), 2 * np.ones(8))


@pytest.mark.skipif(not LINUX_MAPS, reason="needs /proc/self/maps")
def test_freed_programs_give_back_their_memory_maps():
    x = jnp.ones(8)
    bounded = programs.bounded_jit(_scaled_sum, static_argnums=(1,), cache=programs.ProgramCache(4))
    plain = jax.jit(lambda x, n: _scaled_sum(x, n), static_argnums=(1,))
    grown = {}
    for name, f in (("bounded", bounded), ("plain", plain)):
        start = programs.process_map_count()
        for n in range(40):
            f(x, n)
        grown[name] = programs.process_map_count() - start
    assert grown["plain"] > 100, grown  # each plain executable keeps its maps (~6 for this one)
    assert grown["bounded"] < grown["plain"] / 4, grown  # 4 live programs at most
    plain.clear_cache()


def test_cache_size_knob(monkeypatch):
    before = programs.cache_size()
    try:
        programs.set_cache_size(7)
        assert programs.cache_size() == 7
        assert programs.live_programs() <= 7
    finally:
        programs.set_cache_size(before)
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="int >= 1"):
            programs.set_cache_size(bad)
    monkeypatch.setenv(programs.ENV_VAR, "12")
    assert programs._size_from_env() == 12
    monkeypatch.setenv(programs.ENV_VAR, "lots")
    with pytest.raises(ValueError, match="JAXSPEC_MAX_PROGRAMS must be an int >= 1, got 'lots'"):
        programs._size_from_env()
    monkeypatch.delenv(programs.ENV_VAR)
    assert programs._size_from_env() == programs.DEFAULT_MAX_PROGRAMS


def test_low_map_limit_warns_once_with_the_sysctl_line(tmp_path, monkeypatch):
    limit = tmp_path / "max_map_count"
    monkeypatch.setattr(programs, "MAP_COUNT_FILE", str(limit))
    monkeypatch.setitem(programs._WARNING, "warned", False)
    limit.write_text("262144\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        programs._warn_if_map_limit_is_low()  # 20 x 2,000 + this process fits: silent
    limit.write_text("30000\n")
    with pytest.warns(RuntimeWarning) as caught:
        programs._warn_if_map_limit_is_low()
        programs._warn_if_map_limit_is_low()  # once only
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "vm.max_map_count is 30000" in message and "sudo sysctl -w vm.max_map_count=262144" in message
    assert "\n" not in message


def test_default_fits_the_default_map_limit():
    # The arithmetic of programs.py: a full cache plus a notebook's ~5,000 maps stays under 65,530.
    assert programs.DEFAULT_MAX_PROGRAMS * programs.MAPS_PER_PROGRAM + 5_000 < 65_530 - 10_000


@pytest.mark.skipif(not LINUX_MAPS, reason="needs /proc/self/maps")
def test_speculative_loops_past_the_cache_give_back_their_maps(tmp_path):
    """3 distinct speculative loops in one process with the cache bounded to 2 programs: the first
    loop's program adds ~1,000 maps (this 1-layer model), and every later one frees the least recent
    program as it compiles, so the maps stay flat where unbounded they would grow by 2 loops' worth.
    The same worker with `--loops 60` and the default 20 programs is the long run behind the cache
    (tests/program_cache_worker.py): without the cache that process died at the 59th loop (64,716
    maps, "LLVM compilation error: Cannot allocate memory"); with it, 23,189 maps at most. That run
    takes ~14 minutes of a core, too long for CI, so this test keeps the mechanism at a smaller scale."""
    out = tmp_path / "report.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop(programs.ENV_VAR, None)
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "program_cache_worker.py"), str(out), "--loops", "3",
         "--cache-size", "2", "--batch-sizes", "1"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    if proc.returncode:
        pytest.fail(f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    report = json.loads(out.read_text())
    assert report["loops"] == 3 and report["spec_loops_compiled"] == 3
    assert report["mismatches"] == []  # greedy tokens == generate, every loop
    assert report["mean_tau"] > 1.3  # drafts were accepted: the tree commit ran
    assert report["live_programs"] <= 2 == report["cache_size"]
    maps = report["maps_after"]
    per_loop = maps[0] - report["start_maps"]  # the cache (generate's program + this) still had room
    assert per_loop > 500, report
    assert max(maps[1:]) - maps[0] < per_loop, report  # unbounded: + 2 x per_loop


@pytest.mark.skipif(not LINUX_MAPS, reason="needs /proc/self/maps")
@pytest.mark.long  # 14 minutes of a core
def test_sixty_speculative_loops_in_one_process(tmp_path):
    """60 distinct speculative loops under the default vm.max_map_count and the default 20 programs:
    without the cache this process died at the 59th loop (64,716 maps); with it the maps stay under
    35,000 (measured 23,189), and greedy tokens equal `generate` in every loop."""
    out = tmp_path / "report.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop(programs.ENV_VAR, None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "program_cache_worker.py"), str(out), "--loops", "60"],
                          env=env, capture_output=True, text=True, timeout=3000)
    if proc.returncode:
        pytest.fail(f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    report = json.loads(out.read_text())
    assert report["loops"] == 60 and report["spec_loops_compiled"] == 60
    assert report["mismatches"] == [] and report["mean_tau"] > 1.3
    assert report["live_programs"] <= programs.DEFAULT_MAX_PROGRAMS == report["cache_size"]
    assert report["max_maps"] < 35_000, report
    first = report["maps_after"][:10]  # before the cache filled, each loop added its maps
    per_loop = (first[-1] - first[0]) / 9
    assert per_loop > 500 and report["start_maps"] + 60 * per_loop > 35_000 + 20_000, report
