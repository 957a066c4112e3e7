"""Sharded == single device, on 8 simulated CPU devices.

The pytest process already owns a 1-device CPU backend, so tests/sharding_worker.py runs once in a
subprocess with `jax_num_cpu_devices=8`: for meshes (data, tensor, expert) (2,4,1) and (1,2,4)
(every axis; the long tier adds the one-axis meshes (8,1,1) and (1,8,1)) it runs `generate` and
`speculative_generate` (s2_k2_d4, drafts accepted at every depth) next to the unsharded run, inspects
the compiled speculative loop's HLO, loads checkpoints (and a V4.1 release folder) into shardings, runs a
Pallas kernel per shard (the long tier adds a DSpark tree on V4 and on V4.1, calibration / sweep batches and
the Pallas loop); the tests below assert on its JSON report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxspec.testing import long_tests

HERE = os.path.dirname(os.path.abspath(__file__))
# One mesh splits every axis in CI; the long tier adds a 4-way expert split and the one-axis meshes.
LONG = long_tests()
MESHES = ["2,2,2"] + (["1,2,4", "8,1,1", "1,8,1"] if LONG else [])


@pytest.fixture(scope="session")
def report(run_once):
    # The ~2-minute subprocess (~5 in the long tier) runs once per test run, whichever xdist workers ask for it.
    folder = run_once("eight_devices", lambda out: _run_worker(out / "report.json"))
    with open(folder / "report.json") as f:
        return json.load(f)


def _run_worker(out):
    env = dict(os.environ)
    # Same flags for the sharded and the single-device programs; cheaper CPU compiles.
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                        " --xla_llvm_disable_expensive_passes=true").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "sharding_worker.py"), str(out), "--meshes", *MESHES,
         *(["--long"] if LONG else [])],
        env=env, capture_output=True, text=True, timeout=1200,
    )
    if proc.returncode:
        pytest.fail(f"sharding worker failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    with open(out) as f:
        return json.load(f)


def test_eight_devices(report):
    assert report["devices"] == 8


@pytest.mark.parametrize("mesh", MESHES)
def test_generate_token_identical(report, mesh):
    ref, got = report["reference"], report["meshes"][mesh]
    assert got["generate"] == ref["generate"]
    assert got["generate_lengths"] == ref["generate_lengths"]


@pytest.mark.parametrize("mesh", MESHES)
def test_speculative_token_identical(report, mesh):
    ref, got = report["reference"], report["meshes"][mesh]
    assert ref["tau"] > 1.5, "the speculative run should accept drafts (exercise the tree commit)"
    assert got["speculative"] == ref["speculative"]
    assert got["speculative_lengths"] == ref["speculative_lengths"]
    assert got["speculative"] == ref["generate"]  # greedy speculation == greedy decoding


@pytest.mark.parametrize("mesh", MESHES)
def test_speculative_loop_keeps_parameter_shardings(report, mesh):
    got = report["meshes"][mesh]
    hlo = got["spec_loop_hlo"]
    assert got["param_shardings_kept"]
    assert hlo["unparsed"] == []
    assert hlo["param_gathers"] == [], "a split parameter is all-gathered whole inside the loop"
    if mesh != "8,1,1":
        assert hlo["num_split_params"] > 0


@pytest.mark.parametrize("mesh", MESHES)
def test_no_collective_crosses_data_shards(report, mesh):
    # The state, the verify scratch and the commit stay batch-split: no batch resharding per cycle.
    hlo = report["meshes"][mesh]["spec_loop_hlo"]
    assert hlo["cross_data"] == []
    if mesh == "8,1,1":
        assert hlo["kinds"] == {}, "pure data parallelism needs no collective at all"


def test_hlo_detectors_fire_on_bad_programs(report):
    assert report["controls"]["param_gather"] == ["f32[16,256]"]
    assert report["controls"]["cross_data"]


def test_prefill_logits_sharded(report):
    assert report["prefill_max_abs_diff"] < 1e-5


@pytest.mark.parametrize("kind", ["orbax", "safetensors"])
def test_checkpoints_load_into_shardings(report, kind):
    got = report["checkpoints"][kind]
    assert got["shardings"] and got["equal"]
    assert got["split_leaves"] > 0


def test_pallas_kernel_per_shard(report):
    assert report["kernel"] == {"equal": True, "shard_map": True}


@pytest.mark.parametrize("mesh", MESHES)
def test_sampled_output_does_not_depend_on_the_mesh(report, mesh):
    # Per-row keys fold in the global row, so a sequence draws the same tokens however it is split.
    ref, got = report["reference"], report["meshes"][mesh]
    assert got["generate_sampled"] == ref["generate_sampled"]
    assert got["speculative_sampled"] == ref["speculative_sampled"]
    assert ref["generate_sampled"] != ref["generate"]  # temperature 1 really sampled


@pytest.mark.long
def test_pallas_attention_in_the_sharded_loop(report):
    got = report["pallas_loop"]
    assert got["mesh"] == got["one_device"]


@pytest.mark.long
def test_a_dspark_tree_on_the_mesh_is_the_single_device_run(report):
    r = report["dspark"]
    assert r["sharded"] == r["single"] and r["tau"] > 1.5, r


@pytest.mark.long
def test_a_v41_dspark_tree_on_the_mesh_is_the_single_device_run(report):
    # V4.1's shared pools, candidates, Engram and QAT-expert layout split over (2, 2, 2), its own drafter
    r = report["v41_dspark"]
    assert r["sharded"] == r["single"] == r["generate"] and r["tau"] > 1.3, r


def test_a_v41_release_folder_loads_over_the_mesh(report):
    # load_release(mesh=...): every leaf in its declared sharding (many split over all 8 devices), the same
    # values and prefill logits as one device, the DSpark drafter loaded with it
    r = report["v41_release"]
    assert r["in_place"] and r["same_leaves"] and r["draft"] and r["split_leaves"] > 10, r
    assert r["prefill_max_abs_diff"] < 1e-4, r


@pytest.mark.long
def test_calibration_and_sweep_batches_on_the_mesh_are_the_single_device_run(report):
    # `jaxspec calibrate / sweep / tune --mesh`: the params sharded, the batch over "data".
    r = report["harness"]
    assert r["nodes"] > 0 and r["collect_equal"]
    assert r["run_batch_equal"] and r["run_batch_devices"] == 8
