import contextlib
import fcntl
import gc
import os
import shutil

import jax
import pytest

import jaxspec as js
from jaxspec.core import programs
from jaxspec.testing import high_acceptance, long_tests, mixed_acceptance, randomize, sharpened

# The slowest modules first, slowest leading (a CI run's --durations, summed per module): under
# `-n 2 --dist loadfile --no-loadscope-reorder` (a module stays on one worker, modules handed out in this
# order; xdist's default reorder by test count would undo it) the long ones overlap the rest and the short
# ones fill the end instead of one worker finishing minutes after the other. Subprocesses of minutes: the
# 8-device worker, the 2-process cluster, the CUDA lowering worker, the GPU check's dry run.
SLOW_FIRST = ("test_sharding_8dev.py", "test_dspark_speculation.py", "test_speculative.py", "test_calibration.py",
              "test_v41.py", "test_serve.py", "test_tune.py", "test_generate.py", "test_v41_dspark.py",
              "test_dspark_train.py", "test_multiprocess_load.py", "test_context_values.py", "test_model.py",
              "test_rsd.py", "test_gpu_lowering.py", "test_gpu_check.py", "test_sampling.py", "test_programs.py")


def _cuda_devices() -> int:
    try:
        return len(jax.devices("cuda"))
    except RuntimeError:  # no CUDA backend in this jaxlib, or no device for it
        return 0


def pytest_collection_modifyitems(config, items):
    """Slow modules first (SLOW_FIRST); `@pytest.mark.gpu` tests run only where jax sees a CUDA device;
    `@pytest.mark.long` checks (too long for CI, each covered there by a cheaper test of the same
    mechanism) run only with JAXSPEC_LONG_TESTS=1."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept within
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu and not _cuda_devices():
        skip = pytest.mark.skip(reason=f"gpu: no CUDA device here (jax's backend: {jax.default_backend()}); "
                                       "scripts/gpu_check.sh runs these on one")
        for item in gpu:
            item.add_marker(skip)
    if long_tests():
        return
    skip = pytest.mark.skip(reason="long: JAXSPEC_LONG_TESTS=1 ./test.sh runs it")
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def run_once(tmp_path_factory):
    """run_once(name, produce) -> a folder `produce(folder)` filled once per test run, however many
    xdist workers ask: the first takes a file lock in the base temp folder all workers share and
    produces; the others wait for it and read the same folder (an expensive subprocess, such as the
    8-device worker, then runs once per CI run whatever the scheduling). A failed `produce` leaves no
    folder behind, so a later caller tries again and fails with its own error."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # xdist: one basetemp per worker, below one folder they share

    def run(name, produce):
        folder = base / f"once-{name}"
        with open(base / f"once-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not (folder / ".done").exists():
                    shutil.rmtree(folder, ignore_errors=True)
                    folder.mkdir()
                    try:
                        produce(folder)
                    except BaseException:
                        shutil.rmtree(folder, ignore_errors=True)
                        raise
                    (folder / ".done").touch()
            finally:
                with contextlib.suppress(OSError):
                    fcntl.flock(lock, fcntl.LOCK_UN)
        return folder

    return run


# An xdist worker compiles thousands of programs over the suite, and XLA:CPU keeps each one's machine code
# in memory maps of the process (jaxspec/core/programs.py): a worker held 43,519 maps at 90% of a full run,
# and workers past vm.max_map_count (65,530) segfaulted inside the XLA compiler in two full runs. After any
# test module that leaves the worker above MAP_BUDGET maps, every compiled program is freed (later modules
# recompile what they share).
MAP_BUDGET = 30_000


@pytest.fixture(autouse=True, scope="module")
def _free_programs_past_the_map_budget():
    yield
    count = programs.process_map_count()
    if count is not None and count > MAP_BUDGET:
        programs.clear()
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def test_cfg():
    return js.ModelConfig.preset("test")


@pytest.fixture(scope="session")
def test_params(test_cfg):
    return randomize(js.init_params(test_cfg, jax.random.key(0)), jax.random.key(1))


@pytest.fixture(scope="session")
def agreeing_params(test_params):
    return high_acceptance(test_params)


@pytest.fixture(scope="session")
def mixed_params(test_params):
    """The MTP draft right about half the time per depth, siblings often accepted (`mixed_acceptance`)."""
    return mixed_acceptance(test_params)


@pytest.fixture(scope="session")
def confident_params(agreeing_params):
    """agreeing_params with a sharper target (same argmax), so sampled trees get accepted."""
    return sharpened(agreeing_params)


# `jaxspec` commands run in-process (`jaxspec.cli.main`) keep their compiled programs in a persistent cache; under
# test.sh that is the run's own JAX_COMPILATION_CACHE_DIR, without it none (not the user's ~/.cache).
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ.setdefault("JAXSPEC_NO_COMPILE_CACHE", "1")
# ... and never pin this process to one core (`jaxspec.core.measure.pin`: the demo, tune and sweep do
# by default); a test of pinning itself runs a subprocess.
os.environ.setdefault("JAXSPEC_NO_PIN", "1")
