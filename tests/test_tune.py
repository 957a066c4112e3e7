"""The budget chooser: the objective picks what it should from measurements, calibration measures
what it claims on a real model, the choice round-trips through tune.json, and spec="auto" runs it."""

import json
import os

import numpy as np
import pytest

import jaxspec as js
from jaxspec.cost import projected_seconds
from jaxspec.harness.report import comparison_table, tuning_table
from jaxspec.harness.tune import choose, compare_with_sweep, pooled_measurements, project_measurements, tune
from jaxspec.speculation.auto import NO_SPECULATION, Tuning, auto_spec, load_tuning

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def _record(batch, spec, dataset, generated, seconds, tau=None, cycles=None):
    r = {"batch": batch, "spec": spec, "dataset": dataset, "generated": generated, "seconds": seconds,
         "tokens_per_s": generated / seconds, "spread": 0.02}
    if spec != NO_SPECULATION:
        r.update(tau=tau, cycles=cycles)
    return r


def test_pooled_rates_and_the_choice_fall_back_to_no_speculation():
    records = [
        _record(1, NO_SPECULATION, "gsm8k", 100, 1.0), _record(1, NO_SPECULATION, "mbpp", 100, 2.0),
        _record(1, "s3_k1_d4", "gsm8k", 100, 0.5, 3.0, 40), _record(1, "s3_k1_d4", "mbpp", 100, 2.5, 2.0, 60),
        _record(16, NO_SPECULATION, "gsm8k", 1600, 4.0), _record(16, "s3_k1_d4", "gsm8k", 1600, 5.0, 2.0, 800),
    ]
    pooled = {(m["batch"], m["spec"]): m for m in pooled_measurements(records)}
    # pooled over datasets: tokens / seconds summed, not a mean of rates
    assert pooled[(1, NO_SPECULATION)]["tokens_per_s"] == pytest.approx(200 / 3.0)
    assert pooled[(1, "s3_k1_d4")]["tokens_per_s"] == pytest.approx(200 / 3.0)
    assert pooled[(1, "s3_k1_d4")]["tau"] == pytest.approx((3.0 * 40 + 2.0 * 60) / 100)
    assert pooled[(16, "s3_k1_d4")]["ratio_vs_ar"] == pytest.approx(0.8)
    assert choose(list(pooled.values())) == {1: NO_SPECULATION, 16: NO_SPECULATION}  # a tie keeps AR (listed first)
    records[2] = _record(1, "s3_k1_d4", "gsm8k", 100, 0.4, 3.0, 40)
    assert choose(pooled_measurements(records)) == {1: "s3_k1_d4", 16: NO_SPECULATION}


def test_projection_uses_the_measured_tau_and_the_cost_models_times(test_cfg):
    pooled = pooled_measurements([_record(2, NO_SPECULATION, "gsm8k", 10, 1.0),
                                  _record(2, "s2_k2_d4", "gsm8k", 10, 1.0, 2.5, 8)])
    project_measurements(pooled, test_cfg, 64, "h200")
    ar, spec = pooled
    seconds = projected_seconds(test_cfg, js.SpecConfig.parse("s2_k2_d4"), 2, 64, "h200")
    assert spec["projected_tokens_per_s"] == pytest.approx(2 * 2.5 / seconds)
    assert ar["projected_tokens_per_s"] == pytest.approx(2 / projected_seconds(test_cfg, None, 2, 64, "h200"))
    with pytest.raises(ValueError, match="unknown accelerator"):
        project_measurements(pooled, test_cfg, 64, "tpu9")


def test_tuning_round_trip_nearest_bucket_and_bad_files(tmp_path):
    tuning = Tuning({1: "s3_k2_d6", 16: NO_SPECULATION}, (), 64)
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
    tuning = Tuning({1: "s4_k1_d5", 4: NO_SPECULATION}, (), 64)
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
        compare_with_sweep(Tuning({1: "s2_k1_d3"}, (), 64), records)


def test_tune_times_every_candidate_end_to_end_and_refuses_a_loaded_machine(agreeing_params, test_cfg,
                                                                             monkeypatch):
    """One bucket, one candidate, tiny lengths: the records say what was timed. An unpinned process
    (as a pytest worker is) gets a verdict that is not clean, and tune refuses unless allow_loaded."""
    from jaxspec.core import measure

    monkeypatch.setattr(measure, "pinned_core", lambda: None)
    prompts = {"a": PROMPTS[:2], "b": PROMPTS[2:]}
    args = dict(batch_sizes=(2,), candidates=("s2_k1_d3",), max_new_tokens=8, repeats=1, retries=0, progress=False)
    with pytest.raises(ValueError, match="stayed loaded"):  # not pinned here, or the other core busy
        tune(agreeing_params, test_cfg, prompts, **args)
    tuning = tune(agreeing_params, test_cfg, prompts, allow_loaded=True, **args)
    assert tuning.choices.keys() == {2} and tuning.choices[2] in (NO_SPECULATION, "s2_k1_d3")
    assert tuning.estimator == "end-to-end"
    assert {(g["spec"], g["prompts"]) for g in tuning.groups} == {(NO_SPECULATION, 8), ("s2_k1_d3", 8)}
    assert len(tuning.groups) == 4 and len(tuning.verdicts) == 2  # (spec, dataset) x 2; a verdict per dataset
    spec = next(m for m in tuning.measurements if m["spec"] == "s2_k1_d3")
    assert 1.0 <= spec["tau"] <= 3.0 and spec["generated"] == 2 * 8 * 8 and spec["seconds"] > 0
    assert tuning.choices == choose(tuning.measurements)
    assert "x AR" in tuning_table(tuning) and "LOADED" in tuning_table(tuning)
    with pytest.raises(ValueError, match="allowed 1.."):
        tune(agreeing_params, test_cfg, prompts, batch_sizes=(1,), candidates=("s9_k1_d10",), progress=False)
    with pytest.raises(ValueError, match="batch sizes"):
        tune(agreeing_params, test_cfg, prompts, batch_sizes=(0,), progress=False)


@pytest.mark.parametrize("choice", [NO_SPECULATION, "s3_k2_d6"])
def test_auto_spec_runs_the_choice_and_stays_exact(agreeing_params, test_cfg, choice):
    tuning = Tuning({4: choice}, (), 32)
    ref = js.generate(agreeing_params, test_cfg, PROMPTS, max_new_tokens=32)
    out = js.speculative_generate(agreeing_params, test_cfg, PROMPTS, "auto", max_new_tokens=32, tuning=tuning)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert out.stats["spec"] == choice
    with pytest.raises(ValueError, match="tuning"):
        js.speculative_generate(agreeing_params, test_cfg, PROMPTS, "auto", max_new_tokens=8)
    with pytest.raises(ValueError, match="only used"):
        js.speculative_generate(agreeing_params, test_cfg, PROMPTS, "s3_k2_d6", max_new_tokens=8, tuning=tuning)


def test_cli_tune_names_a_missing_checkpoint(tmp_path):
    from jaxspec.cli import main

    with pytest.raises(SystemExit, match="does not exist"):
        main(["tune", "--checkpoint", str(tmp_path / "none")])


@pytest.mark.long  # a minute and a half; CI times tune() itself (the tests above) on the test model
def test_cli_tune_on_the_shipped_checkpoint(tmp_path, capsys):
    from jaxspec.cli import main
    from jaxspec.training.data import data_available

    if not (os.path.isdir("checkpoints/tiny-v4") and data_available()):
        pytest.skip("needs the shipped checkpoint and ../shared/data")
    out = tmp_path / "tune.json"
    argv = ["tune", "--checkpoint", "checkpoints/tiny-v4", "--datasets", "gsm8k", "--num-prompts", "2",
            "--batch-sizes", "2", "--candidates", "s2_k1_d3", "--new-tokens", "16", "--repeats", "1", "--no-pin",
            "--allow-loaded", "--out", str(out)]
    assert main(argv) == 0
    assert load_tuning(out).spec_for(2) in (None, js.SpecConfig(2, 1, 3))
    assert "chosen: batch 2:" in capsys.readouterr().out


@pytest.mark.long  # ~50 s; CI: a stopped sweep finishing the rest from its progress file (tests/test_eval.py)
def test_tune_resumes_from_the_groups_it_finished(agreeing_params, test_cfg, tmp_path, monkeypatch):
    """A stopped tune keeps each finished (bucket, dataset) group in its progress file; the rerun
    measures only the groups that file lacks, and a file of other candidates is not reused."""
    import jaxspec.harness.tune as tune_lib

    measured = []
    real = tune_lib._measure_group
    monkeypatch.setattr(tune_lib, "_measure_group", lambda *a, **k: measured.append(a[4]) or real(*a, **k))
    progress = tmp_path / "tune.progress.jsonl"
    args = dict(max_new_tokens=8, repeats=1, retries=0, allow_loaded=True, progress=False, resume=progress)
    prompts = {"a": PROMPTS[:2]}
    first = tune(agreeing_params, test_cfg, prompts, (1,), ("s2_k1_d3",), **args)
    assert measured == [1] and len(progress.read_text().splitlines()) == 1
    with open(progress, "a") as f:
        f.write('{"signature": "cut off by a kill')  # a stopped run's last line
    second = tune(agreeing_params, test_cfg, prompts, (1, 2), ("s2_k1_d3",), **args)
    assert measured == [1, 2]  # bucket 1 came from the file
    assert [g["seconds"] for g in second.groups if g["batch"] == 1] == [g["seconds"] for g in first.groups]
    # Other candidates (or prompts, or lengths) make another signature: such a file is not reused.
    specs = ["ar", "s2_k1_d3"]  # the timed methods' names
    same = tune_lib._signature(test_cfg, prompts, specs, 8, 1)
    assert tune_lib._signature(test_cfg, prompts, ["ar", "s2_k2_d4"], 8, 1) != same
    assert tune_lib._signature(test_cfg, {"a": PROMPTS[:1]}, specs, 8, 1) != same
    assert tune_lib._finished_groups(progress, same).keys() == {"1:a", "2:a"}


def test_load_checkpoint_carries_its_tune_json_for_spec_auto(tmp_path, agreeing_params, test_params, test_cfg):
    """A checkpoint's draft holding tune.json needs no tuning= for spec="auto"; bare params still do."""
    from jaxspec.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(tmp_path, test_cfg, agreeing_params)
    Tuning({4: "s3_k2_d6"}, (), 32).save(tmp_path)
    ckpt = load_checkpoint(tmp_path)
    cfg, params, _ = ckpt
    out = js.speculative_generate(params, cfg, PROMPTS, "auto", max_new_tokens=16, draft=ckpt.draft)
    assert out.stats["spec"] == "s3_k2_d6"
    np.testing.assert_array_equal(out.tokens, js.generate(params, cfg, PROMPTS, max_new_tokens=16).tokens)
    with pytest.raises(ValueError, match="tuning="):  # params alone: nothing registered behind the caller's back
        js.speculative_generate(params, cfg, PROMPTS, "auto", max_new_tokens=8)


def test_the_shipped_checkpoint_carries_its_tuning():
    """checkpoints/tiny-v4/tune.json parses, covers the batch buckets it was measured for, and
    load_checkpoint carries it with the draft, for spec="auto"."""
    from jaxspec.checkpoint import load_checkpoint

    shipped = load_tuning("checkpoints/tiny-v4")
    assert sorted(shipped.choices) == [1, 4, 16, 64]
    # chosen from end-to-end timings, every (bucket, dataset) group measured on a quiet machine
    assert shipped.estimator == "end-to-end"
    assert sorted({(v["batch"], v["dataset"]) for v in shipped.verdicts}) == [
        (b, d) for b in (1, 4, 16, 64) for d in ("gsm8k", "mbpp", "sharegpt")]
    assert all(v["clean"] for v in shipped.verdicts)
    ckpt = load_checkpoint("checkpoints/tiny-v4")
    assert ckpt.draft.tuning == shipped
    for b in (1, 3, 64, 200):  # every batch size maps to a bucket's choice
        spec = shipped.spec_for(b)
        assert spec is None or spec.validate_for(ckpt.cfg) is None


def test_the_shipped_drafts_carry_their_cross_draft_tuning():
    """checkpoints/tiny-v4/drafts/tune.json (`jaxspec tune --draft all`) parses, chose among the checkpoint's
    three drafts from every (bucket, dataset) group measured on a quiet machine, and
    load_checkpoint(draft="all") carries it for spec="auto"."""
    from jaxspec.checkpoint import load_checkpoint

    shipped = load_tuning("checkpoints/tiny-v4/drafts")
    assert sorted(shipped.choices) == [1, 4] and shipped.estimator == "end-to-end"
    assert sorted({(v["batch"], v["dataset"]) for v in shipped.verdicts}) == [
        (b, d) for b in (1, 4) for d in ("gsm8k", "mbpp", "sharegpt")]
    assert all(v["clean"] for v in shipped.verdicts)
    assert set(shipped.drafts) == {"default", "one-step", "dspark"}
    every = load_checkpoint("checkpoints/tiny-v4", draft="all")
    assert every.draft.tuning == shipped
    for b in (1, 4):
        draft, spec = shipped.choice_for(b)
        assert spec is None or (draft in {d.name for d in every.draft.drafts} and spec.validate_for(every.cfg) is None)


def test_the_shipped_dspark_draft_carries_its_tuning():
    """checkpoints/tiny-v4/drafts/dspark/tune.json (`jaxspec tune --draft dspark`, chains and the `_vb` tree at
    every bucket) parses, every (bucket, dataset) group was measured clean, and load_checkpoint(draft="dspark")
    carries it: spec="auto" with the DSpark draft alone runs what it chose at each bucket."""
    from jaxspec.checkpoint import load_checkpoint

    shipped = load_tuning("checkpoints/tiny-v4/drafts/dspark")
    assert sorted(shipped.choices) == [1, 4, 16, 64]
    assert sorted({(v["batch"], v["dataset"]) for v in shipped.verdicts}) == [
        (b, d) for b in (1, 4, 16, 64) for d in ("gsm8k", "mbpp", "sharegpt")]
    assert all(v["clean"] for v in shipped.verdicts)
    measured = {(m["batch"], m["spec"]) for m in shipped.measurements}
    assert {(b, "s7_k2_d8_vb") for b in (1, 4, 16, 64)} <= measured  # the tree beside the chains
    ckpt = load_checkpoint("checkpoints/tiny-v4", draft="dspark")
    assert ckpt.draft.tuning == shipped


def test_a_candidate_far_behind_ar_is_not_measured_at_larger_buckets(agreeing_params, test_cfg, monkeypatch):
    """Buckets run smallest first; a spec below prune_below x AR (pooled over the datasets) at one
    bucket is left out of the larger ones, and prune_below=None measures every spec everywhere."""
    import jaxspec.harness.tune as tune_lib

    speed = {1: {"s1_k1_d2": 1.2, "s3_k1_d4": 0.95, "s7_k1_d8": 0.7}, 4: {"s1_k1_d2": 1.1, "s3_k1_d4": 0.85},
             16: {"s1_k1_d2": 0.99}}
    measured = []

    def fake_group(params, cfg, methods, prompts, b, *rest):
        measured.append((b, sorted(n for n in methods if n != NO_SPECULATION)))
        rate = {NO_SPECULATION: 100.0,
                **{n: 100.0 * speed.get(b, {}).get(n, 0.5) for n in methods if n != NO_SPECULATION}}
        records = [{"batch": b, "spec": n, "seconds": 1000 / r, "generated": 1000, "tokens_per_s": r,
                    "ratio_vs_ar": r / 100, "spread": 0.01, "prompts": 8,
                    **({} if n == NO_SPECULATION else {"tau": 2.0, "cycles": 10})} for n, r in rate.items()]
        return {"records": records, "verdict": {"clean": True, "reasons": []}}

    monkeypatch.setattr(tune_lib, "_measure_group", fake_group)
    args = dict(batch_sizes=(1, 4, 16), candidates=("s1_k1_d2", "s3_k1_d4", "s7_k1_d8"), progress=False)
    tuning = tune(agreeing_params, test_cfg, {"a": PROMPTS, "b": PROMPTS}, **args)
    everything = ["s1_k1_d2", "s3_k1_d4", "s7_k1_d8"]
    assert measured == [(1, everything)] * 2 + [(4, ["s1_k1_d2", "s3_k1_d4"])] * 2 + [(16, ["s1_k1_d2"])] * 2
    assert tuning.choices == {1: "s1_k1_d2", 4: "s1_k1_d2", 16: NO_SPECULATION}
    measured.clear()
    tune(agreeing_params, test_cfg, {"a": PROMPTS}, prune_below=None, **args)
    assert measured == [(b, everything) for b in (1, 4, 16)]
    with pytest.raises(ValueError, match="prune_below"):
        tune(agreeing_params, test_cfg, {"a": PROMPTS}, prune_below=1.5, **args)


def test_tune_measures_sampled_decoding_under_a_rule(agreeing_params, test_cfg, tmp_path):
    """`tune(sampling=Sampled(...))`: AR and the candidate sample at the settings (the rule's tau is a sampled
    one: > 1 on the agreeing draft), the tuning records them and round-trips them; the CLI's flags are checked
    (--top-p / --accept without --temperature are errors)."""
    import argparse

    from jaxspec.cli.common import sampling_from_args
    from jaxspec.harness.eval import Sampled

    sampled = Sampled(1.0, top_p=0.9, accept="residual", seed=3)
    tuning = tune(agreeing_params, test_cfg, {"a": PROMPTS[:2]}, batch_sizes=(2,), candidates=("s2_k1_d3",),
                  max_new_tokens=8, repeats=1, retries=0, progress=False, allow_loaded=True, sampling=sampled)
    assert tuning.sampling == {"temperature": 1.0, "top_p": 0.9, "accept": "residual", "seed": 3}
    spec = next(m for m in tuning.measurements if m["spec"] == "s2_k1_d3")
    assert 1.0 < spec["tau"] <= 3.0
    back = load_tuning(tuning.save(tmp_path / "tune.json"))
    assert back.sampling == tuning.sampling and back.choices == tuning.choices

    def args(**kw):
        return argparse.Namespace(**{"temperature": 0.0, "top_p": None, "accept": None, "seed": 0, **kw})

    assert sampling_from_args(args()) is None
    assert sampling_from_args(args(temperature=0.6)) == Sampled(0.6)
    with pytest.raises(ValueError, match="need --temperature"):
        sampling_from_args(args(accept="block"))
    with pytest.raises(ValueError, match="accept must be"):
        Sampled(0.6, accept="rsd")
