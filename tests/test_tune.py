"""The budget chooser: the objective picks what it should from measurements, calibration measures
what it claims on a real model, the choice round-trips through tune.json, and spec="auto" runs it."""

import json
import os

import numpy as np
import pytest

import jaxspec as js
from jaxspec.costmodel import projected_seconds
from jaxspec.report import comparison_table, tuning_table
from jaxspec.tree.budget import expected_tokens_per_cycle, sequoia_optimum
from jaxspec.tune import batch_tokens_per_cycle, calibrate, choose, compare_with_sweep, project_measurements
from jaxspec.tuning import NO_SPECULATION, Tuning, auto_spec, load_tuning

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def _measurement(batch, spec, cycle_seconds, tau):
    return {
        "batch": batch, "spec": spec, "cycle_seconds": cycle_seconds, "draft_seconds": cycle_seconds / 3,
        "tau": {"sequoia": tau, "measured": tau},
        "predicted_tokens_per_s": {"sequoia": batch * tau / cycle_seconds, "measured": batch * tau / cycle_seconds},
    }


def test_choose_maximises_predicted_throughput_and_falls_back_to_no_speculation():
    ms = [
        {"batch": 1, "spec": NO_SPECULATION, "step_seconds": 0.01, "tokens_per_s": 100.0},
        _measurement(1, "s3_k2_d6", 0.02, 3.0),  # 150 tok/s: wins at batch 1
        _measurement(1, "s4_k1_d5", 0.02, 2.5),  # 125
        {"batch": 16, "spec": NO_SPECULATION, "step_seconds": 0.04, "tokens_per_s": 400.0},
        _measurement(16, "s3_k2_d6", 0.2, 3.0),  # 240: slower than no speculation
        _measurement(16, "s4_k1_d5", 0.15, 2.5),  # 266
    ]
    assert choose(ms, "sequoia") == {1: "s3_k2_d6", 16: NO_SPECULATION}
    with pytest.raises(ValueError, match="estimator"):
        choose(ms, "guess")


def test_expected_tokens_per_cycle_is_sequoia_restricted_to_topk():
    acceptance = [0.6, 0.2, 0.1, 0.05]
    spec = js.SpecConfig.parse("s3_k2_d6")
    assert expected_tokens_per_cycle(acceptance, spec) == pytest.approx(sequoia_optimum([0.6, 0.2], 6, 3))
    chain = js.SpecConfig.parse("s3_k1_d4")
    assert expected_tokens_per_cycle(acceptance, chain) == pytest.approx(1 + 0.6 + 0.36 + 0.216)
    # A wider tree than the measured ranks: missing ranks count as never accepted.
    wide = js.SpecConfig.parse("s1_k4_d5")
    assert expected_tokens_per_cycle([0.5, 0.3], wide) == pytest.approx(1.8)


def test_batch_tokens_per_cycle_waits_for_the_slowest_row():
    # Batch 1: harmonic mean over prompts (a tau-1 prompt costs 4x the cycles of a tau-4 one).
    assert batch_tokens_per_cycle([1.0, 4.0], 1, draws=4096) == pytest.approx(1 / (0.5 * 1 + 0.5 * 0.25), rel=0.03)
    # A large batch almost surely holds a tau-1 row: it runs as many cycles as autoregressive decoding.
    assert batch_tokens_per_cycle([1.0, 4.0], 64) == pytest.approx(1.0)
    assert batch_tokens_per_cycle([3.0, 3.0, 3.0], 8) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        batch_tokens_per_cycle([], 1)


def test_tuning_round_trip_nearest_bucket_and_bad_files(tmp_path):
    tuning = Tuning((0.7, 0.1), {1: "s3_k2_d6", 16: NO_SPECULATION}, "sequoia", (), 64)
    path = tuning.save(tmp_path)
    assert path.name == "tune.json"
    back = load_tuning(tmp_path)
    assert back == tuning
    assert back.spec_for(1) == js.SpecConfig(3, 2, 6)
    assert back.spec_for(3) == js.SpecConfig(3, 2, 6)  # log2 distance 1.6 vs 2.4
    assert back.spec_for(64) is None
    assert auto_spec(tmp_path, 2) == js.SpecConfig(3, 2, 6)
    with pytest.raises(ValueError, match="batch_size"):
        back.spec_for(0)
    with pytest.raises(FileNotFoundError, match="jaxspec tune"):
        load_tuning(tmp_path / "missing")
    (tmp_path / "bad.json").write_text(json.dumps({"choices": {"1": "s9_k9"}}))
    with pytest.raises(ValueError):
        load_tuning(tmp_path / "bad.json")


def test_compare_with_sweep_reports_ratios():
    tuning = Tuning((0.7,), {1: "s4_k1_d5", 4: NO_SPECULATION}, "sequoia", (), 64)
    records = []
    for dataset, scale in (("gsm8k", 1.0), ("mbpp", 2.0)):
        for batch, rates in ((1, {"ar": 100, "s4_k1_d5": 120, "s4_k2_d8": 125}), (4, {"ar": 300, "s4_k1_d5": 250})):
            for spec, rate in rates.items():
                rate *= scale
                records.append({"dataset": dataset, "batch_size": batch, "spec": spec, "tokens_per_s": rate,
                                "generated": 1000, "seconds": 1000 / rate})
    rows = compare_with_sweep(tuning, records)
    by = {(r["dataset"], r["batch_size"]): r for r in rows}
    assert by[("gsm8k", 1)]["best"] == "s4_k2_d8"
    assert by[("gsm8k", 1)]["chosen_over_best"] == pytest.approx(120 / 125)
    assert by[("mbpp", 4)]["chosen_over_ar"] == pytest.approx(1.0)
    assert by[("all", 1)]["chosen_tokens_per_s"] == pytest.approx(2000 / (1000 / 120 + 1000 / 240))
    assert "s4_k2_d8" in comparison_table(rows)
    with pytest.raises(ValueError, match="no run"):
        compare_with_sweep(Tuning((0.7,), {1: "s2_k1_d3"}, "sequoia", (), 64), records)


@pytest.mark.long  # ~100 s; the CLI test below calibrates on the shipped checkpoint end to end
def test_calibrate_measures_every_candidate_per_bucket(agreeing_params, test_cfg):
    candidates = ("s2_k1_d3", "s2_k2_d4")
    tuning = calibrate(agreeing_params, test_cfg, PROMPTS, (1, 3), candidates, max_new_tokens=24, iters=2,
                       progress=False)
    assert sorted(tuning.choices) == [1, 4]  # buckets
    assert set(tuning.choices.values()) <= {NO_SPECULATION, *candidates}
    assert len(tuning.acceptance) == 2 and 0 < tuning.acceptance[0] <= 1 and sum(tuning.acceptance) <= 1 + 1e-6
    specs = [m for m in tuning.measurements if m["spec"] != NO_SPECULATION]
    assert len(specs) == 4 and len(tuning.measurements) == 6
    for m in specs:
        spec = js.SpecConfig.parse(m["spec"])
        assert 0 < m["draft_seconds"] and m["verify_commit_seconds"] >= 0
        assert 1.0 <= m["tau"]["measured"] <= spec.num_steps + 1
        assert m["tau"]["sequoia"] == pytest.approx(expected_tokens_per_cycle(tuning.acceptance, spec))
    assert tuning.estimator == "measured" and tuning.choices == choose(tuning.measurements, "measured")
    assert "predicted tok/s" in tuning_table(tuning)
    with pytest.raises(ValueError, match="allowed 1.."):
        calibrate(agreeing_params, test_cfg, PROMPTS, (1,), ("s9_k1_d10",), progress=False)
    with pytest.raises(ValueError, match="batch sizes"):
        calibrate(agreeing_params, test_cfg, PROMPTS, (0,), candidates, progress=False)


def test_projected_times_replace_the_measured_ones(test_cfg):
    measurements = [_measurement(2, "s2_k2_d4", 0.5, 2.0), {"batch": 2, "spec": NO_SPECULATION, "step_seconds": 0.1,
                                                            "tokens_per_s": 20.0}]
    project_measurements(measurements, test_cfg, 64, "h200")
    cycle, ar = measurements
    assert cycle["measured_cycle_seconds"] == 0.5 and ar["measured_step_seconds"] == 0.1
    spec = js.SpecConfig.parse("s2_k2_d4")
    assert cycle["cycle_seconds"] == pytest.approx(projected_seconds(test_cfg, spec, 2, 64, "h200"))
    assert ar["tokens_per_s"] == pytest.approx(2 / projected_seconds(test_cfg, None, 2, 64, "h200"))
    assert cycle["cycle_seconds"] > ar["step_seconds"]  # a cycle has more passes than a step
    with pytest.raises(ValueError, match="unknown accelerator"):
        project_measurements(measurements, test_cfg, 64, "tpu9")


@pytest.mark.parametrize("choice", [NO_SPECULATION, "s3_k2_d6"])
def test_auto_spec_runs_the_choice_and_stays_exact(agreeing_params, test_cfg, choice):
    tuning = Tuning((0.7, 0.1), {4: choice}, "sequoia", (), 32)
    ref = js.generate(agreeing_params, test_cfg, PROMPTS, max_new_tokens=32)
    out = js.speculative_generate(agreeing_params, test_cfg, PROMPTS, "auto", max_new_tokens=32, tuning=tuning)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert out.stats["spec"] == choice
    with pytest.raises(ValueError, match="tuning"):
        js.speculative_generate(agreeing_params, test_cfg, PROMPTS, "auto", max_new_tokens=8)
    with pytest.raises(ValueError, match="only used"):
        js.speculative_generate(agreeing_params, test_cfg, PROMPTS, "s3_k2_d6", max_new_tokens=8, tuning=tuning)


def test_cli_tune_on_the_shipped_checkpoint(tmp_path, capsys):
    from jaxspec.cli import main
    from jaxspec.data import data_available

    if not (os.path.isdir("checkpoints/tiny-v4") and data_available()):
        pytest.skip("needs the shipped checkpoint and ../shared/data")
    out = tmp_path / "tune.json"
    argv = ["tune", "--checkpoint", "checkpoints/tiny-v4", "--datasets", "gsm8k", "--num-prompts", "2",
            "--batch-sizes", "2", "--candidates", "s2_k1_d3", "--new-tokens", "16", "--iters", "1", "--out", str(out)]
    assert main(argv) == 0
    assert load_tuning(out).spec_for(2) in (None, js.SpecConfig(2, 1, 3))
    assert "chosen: batch 2:" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="does not exist"):
        main(["tune", "--checkpoint", str(tmp_path / "none")])


def test_calibrate_resumes_from_the_buckets_it_finished(agreeing_params, test_cfg, tmp_path, monkeypatch):
    """A stopped calibration keeps each finished bucket in its progress file; the rerun measures only
    the buckets that file lacks, and a file of other candidates is not reused."""
    import jaxspec.tune as tune_lib

    measured = []
    real = tune_lib._measure_bucket
    monkeypatch.setattr(tune_lib, "_measure_bucket", lambda *a, **k: measured.append(a[4]) or real(*a, **k))
    progress = tmp_path / "tune.progress.jsonl"
    args = dict(max_new_tokens=8, iters=1, progress=False, resume=progress)
    first = calibrate(agreeing_params, test_cfg, PROMPTS[:2], (1,), ("s2_k1_d3",), **args)
    assert measured == [1] and len(progress.read_text().splitlines()) == 1
    with open(progress, "a") as f:
        f.write('{"signature": "cut off by a kill')  # a stopped run's last line
    second = calibrate(agreeing_params, test_cfg, PROMPTS[:2], (1, 2), ("s2_k1_d3",), **args)
    assert measured == [1, 2]  # bucket 1 came from the file
    reused = [m for m in second.measurements if m["batch"] == 1]
    assert [m["cycle_seconds"] for m in reused if "cycle_seconds" in m] == \
        [m["cycle_seconds"] for m in first.measurements if "cycle_seconds" in m]
    # Other candidates (or prompts, or lengths) make another signature: such a file is not reused.
    specs = [js.SpecConfig.parse("s2_k1_d3")]
    same = tune_lib._signature(test_cfg, PROMPTS[:2], specs, 8, 1)
    assert tune_lib._signature(test_cfg, PROMPTS[:2], [js.SpecConfig.parse("s2_k2_d4")], 8, 1) != same
    assert tune_lib._signature(test_cfg, PROMPTS[:1], specs, 8, 1) != same
    assert tune_lib._finished_buckets(progress, same, [1, 2]).keys() == {1, 2}


def test_load_checkpoint_registers_its_tune_json_for_spec_auto(tmp_path, agreeing_params, test_params, test_cfg):
    """A checkpoint folder holding tune.json needs no tuning= for spec="auto"; other params still do."""
    from jaxspec import tuning as tuning_lib
    from jaxspec.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(tmp_path, test_cfg, agreeing_params)
    Tuning((0.7, 0.1), {4: "s3_k2_d6"}, "sequoia", (), 32).save(tmp_path)
    tuning_lib._LOADED.clear()
    cfg, params, _ = load_checkpoint(tmp_path)
    out = js.speculative_generate(params, cfg, PROMPTS, "auto", max_new_tokens=16)
    assert out.stats["spec"] == "s3_k2_d6"
    np.testing.assert_array_equal(out.tokens, js.generate(params, cfg, PROMPTS, max_new_tokens=16).tokens)
    with pytest.raises(ValueError, match="tuning="):  # another draft: nothing registered for it
        js.speculative_generate(test_params, test_cfg, PROMPTS, "auto", max_new_tokens=8)
    tuning_lib._LOADED.clear()


def test_the_shipped_checkpoint_carries_its_tuning():
    """checkpoints/tiny-v4/tune.json parses, covers the batch buckets it was measured for, and
    load_checkpoint registers it for spec="auto"."""
    from jaxspec import tuning as tuning_lib
    from jaxspec.checkpoint import load_checkpoint
    from jaxspec.tree.values import draft_fingerprint

    shipped = load_tuning("checkpoints/tiny-v4")
    assert sorted(shipped.choices) == [1, 4, 16, 64]
    tuning_lib._LOADED.clear()
    cfg, params, _ = load_checkpoint("checkpoints/tiny-v4")
    assert tuning_lib.registered_tuning(draft_fingerprint(params, cfg)) == shipped
    for b in (1, 3, 64, 200):  # every batch size maps to a bucket's choice
        spec = shipped.spec_for(b)
        assert spec is None or spec.validate_for(cfg) is None
    tuning_lib._LOADED.clear()
