"""Loading across hosts, simulated: 2 CPU processes x 4 devices under `jax.distributed` (localhost).

An FP4-quantized official-layout checkpoint (4 shards + index) is loaded into a (data 1, tensor 2,
expert 4) mesh spanning both processes: each process reads only the tensors and slices its own
devices hold. The gathered parameters and greedy `speculative_generate` tokens equal a
single-process, single-device run. tests/multiprocess_worker.py runs in three subprocesses at once
(the two cluster processes and the reference). A tiny DeepSeek-V4.1 release folder loads the same way
(`load_release(mesh=...)`: each process places the shards its devices hold).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxspec as js
from jaxspec.checkpoint import save_hf_checkpoint
from jaxspec.checkpoint.safetensors_io import open_folder
from jaxspec.testing import high_acceptance, long_tests, randomize, write_v41_release

HERE = os.path.dirname(os.path.abspath(__file__))
# The V4.1 folder across processes is long-tier (~60 s more of three processes compiling V4.1); CI holds its
# mechanism in tests/test_sharding_8dev.py (load_release(mesh=...) placing each device's shard) and the V4 run here.
LONG = long_tests()
# 8 heads / groups / experts: split over tensor 2 x expert 4 (as tests/sharding_worker.py).
CFG = js.ModelConfig.preset("test", num_heads=8, o_groups=8, n_routed_experts=8, num_layers=2,
                            layer_types=("csa", "hca"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def run(run_once):
    # The three processes run once per test run, whichever xdist workers ask for them.
    root = run_once("multiprocess", _run_processes)
    ckpt, out = root / "ckpt", root / "out"
    reports = {name: json.load(open(out / f"{name}.json")) for name in ("process0", "process1", "single")}
    return reports, np.load(out / "process0.npz"), np.load(out / "single.npz"), open_folder(str(ckpt)), out


def _run_processes(root):
    ckpt, out = root / "ckpt", root / "out"
    out.mkdir()
    params = high_acceptance(randomize(js.init_params(CFG, jax.random.key(0)), jax.random.key(1)))
    save_hf_checkpoint(ckpt, CFG, params, quantize="fp4", max_shard_bytes=96 * 1024)
    if LONG:
        write_v41_release(root / "v41")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                        " --xla_llvm_disable_expensive_passes=true").strip()
    worker = [sys.executable, os.path.join(HERE, "multiprocess_worker.py"), str(ckpt), str(out),
              *(["--v41", str(root / "v41")] if LONG else [])]
    port = _free_port()
    procs = [subprocess.Popen(worker + ["--process-id", str(i), "--port", str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    procs.append(subprocess.Popen(worker + ["--single"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True))
    try:
        logs = [p.communicate(timeout=480)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        if p.returncode:
            pytest.fail(f"worker {p.args[-2:]} failed ({p.returncode}):\n{log[-6000:]}")


def test_cluster_of_two_processes(run):
    reports, *_ = run
    for name in ("process0", "process1"):
        r = reports[name]
        assert (r["process_count"], r["devices"], r["local_devices"]) == (2, 8, 4)
        assert r["shardings_ok"]


def test_gathered_params_equal_single_process_load(run):
    _, gathered, single, *_ = run
    assert sorted(gathered.files) == sorted(single.files)
    for k in single.files:
        assert gathered[k].dtype == single[k].dtype and gathered[k].shape == single[k].shape, k
        assert gathered[k].tobytes() == single[k].tobytes(), k


def test_speculative_tokens_equal_single_process(run):
    reports, *_ = run
    single = reports["single"]
    assert single["tau"] > 1.5  # drafts accepted: the tree commit runs
    for name in ("process0", "process1"):
        assert reports[name]["tokens"] == single["tokens"]
        assert reports[name]["lengths"] == single["lengths"]


def test_each_process_reads_only_what_its_devices_hold(run):
    reports, _, _, folder, _ = run
    p0, p1 = reports["process0"], reports["process1"]
    # experts: one per device over expert x tensor; each process reads exactly the 4 it holds
    for r in (p0, p1):
        held = set().union(*map(set, r["experts_held"].values()))
        assert len(held) == CFG.n_routed_experts // 2
        assert set(r["experts_read"]) == held
    assert set(p0["experts_read"]).isdisjoint(p1["experts_read"])
    # heads split over "tensor" (= over the processes): the two halves of wq_b, each read once
    for name in ("layers.0.attn.wq_b.weight", "layers.1.attn.wo_b.weight"):
        assert p0["bytes_read"][name] + p1["bytes_read"][name] == folder.tensors[name].nbytes
        assert p0["bytes_read"][name] == p1["bytes_read"][name]
    # every other tensor is either split (each byte read by one process) or replicated (read whole
    # by both); wo_a's scale block is shared by its head groups and read once per group
    split = replicated = 0
    for name, info in folder.tensors.items():
        a, b = p0["bytes_read"].get(name, 0), p1["bytes_read"].get(name, 0)
        if name.endswith("wo_a.scale"):
            continue
        if a == b == info.nbytes:
            replicated += info.nbytes
        else:
            assert a + b == info.nbytes, name
            split += info.nbytes
            assert ".experts." in name or a == b, name  # tensor halves
    assert replicated and split > 0.4 * reports["single"]["bytes_in_files"]
    for r in (p0, p1):
        dup = sum(v for k, v in r["bytes_read"].items() if k.endswith("wo_a.scale"))
        assert sum(r["bytes_read"].values()) - dup == replicated + split // 2


@pytest.mark.long
def test_a_v41_release_loads_across_processes(run):
    """load_release(mesh=...) of a V4.1 folder over both processes: every leaf in its declared sharding, the
    gathered target and drafter bitwise the single-process load, the same greedy tokens."""
    reports, *_, out = run
    gathered, single = np.load(out / "process0_v41.npz"), np.load(out / "single_v41.npz")
    assert sorted(gathered.files) == sorted(single.files) and len(single.files) > 50
    for k in single.files:
        assert gathered[k].dtype == single[k].dtype and gathered[k].tobytes() == single[k].tobytes(), k
    for name in ("process0", "process1"):
        assert reports[name]["v41_shardings_ok"]
        assert reports[name]["v41_tokens"] == reports["single"]["v41_tokens"]
