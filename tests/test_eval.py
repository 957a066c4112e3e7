"""Evaluation harness: Sequoia DP against brute force, config validation, and sweep results
identical on 1 and 8 (simulated) devices."""

import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from jaxspec.core.spec import SpecConfig
from jaxspec.harness.eval import SweepConfig, distinct_ngram_ratio
from jaxspec.harness.report import markdown_table, plot_acceptance
from jaxspec.speculation.budget import matched_linear, sequoia_optimum
from jaxspec.training.plots import plot_distill_history


def _brute_force(p, budget, max_depth):
    """Max over all rooted trees with `budget` nodes of sum over nodes of prod p[rank] on the path
    (p per depth: p[depth - 1][rank], the last row for deeper nodes)."""
    rows = [list(r) for r in p] if isinstance(p[0], (list, tuple)) else [list(p)]
    p = rows[0]
    best = 0.0
    for parents in itertools.product(*[range(i) for i in range(1, budget)]):
        depth, value, children = [0], [1.0], {}
        ok = True
        for par in parents:
            rank = children.get(par, 0)
            children[par] = rank + 1
            if rank >= len(p) or depth[par] + 1 > max_depth:
                ok = False
                break
            depth.append(depth[par] + 1)
            value.append(value[par] * rows[min(depth[-1], len(rows)) - 1][rank])
        if ok:
            best = max(best, sum(value))
    return best


@pytest.mark.parametrize("p", [[0.7, 0.2, 0.05], [0.4, 0.35, 0.2], [0.9]])
@pytest.mark.parametrize("budget,max_depth", [(1, 3), (4, 2), (5, 3), (6, 4), (6, 1)])
def test_sequoia_matches_brute_force(p, budget, max_depth):
    expected = _brute_force(p, budget, max_depth)
    if expected == 0.0:  # no tree of that size fits
        with pytest.raises(ValueError, match="no tree"):
            sequoia_optimum(p, budget, max_depth)
    else:
        assert sequoia_optimum(p, budget, max_depth) == pytest.approx(expected)


@pytest.mark.parametrize("rows", [[[0.9, 0.1], [0.2, 0.1]], [[0.9, 0.1], [0.05, 0.01]],
                                  [[0.95, 0.04, 0.01], [0.6, 0.2, 0.1], [0.3, 0.25, 0.2]]])
@pytest.mark.parametrize("budget,max_depth", [(3, 2), (5, 3), (6, 4)])
def test_sequoia_per_depth_matches_brute_force(rows, budget, max_depth):
    # a one-step draft reused deeper: the per-depth rates change which tree is best
    assert sequoia_optimum(rows, budget, max_depth) == pytest.approx(_brute_force(rows, budget, max_depth))
    assert sequoia_optimum([rows[0]] * 3, budget, max_depth) == pytest.approx(sequoia_optimum(rows[0], budget,
                                                                                              max_depth))


def test_sequoia_per_depth_chooses_width_where_depth_fails():
    assert sequoia_optimum([[0.9, 0.1], [0.2, 0.1]], 3, 2) == pytest.approx(1 + 0.9 + 0.9 * 0.2)  # the chain
    assert sequoia_optimum([[0.9, 0.1], [0.05, 0.01]], 3, 2) == pytest.approx(1 + 0.9 + 0.1)  # two children


def test_sequoia_zero_acceptance_rank():
    # a rank that is never accepted must not poison the DP with 0 * -inf
    assert sequoia_optimum([0.2, 0.0], 5, 3) == pytest.approx(_brute_force([0.2, 0.0], 5, 3))


def test_sequoia_bad_input():
    with pytest.raises(ValueError, match="probabilities"):
        sequoia_optimum([1.5], 4, 2)
    with pytest.raises(ValueError, match="budget"):
        sequoia_optimum([0.5], 0, 2)


def test_matched_linear_and_config():
    assert matched_linear(SpecConfig.parse("s3_k2_d6")).name == "s5_k1_d6"
    with pytest.raises(ValueError, match="unknown dataset"):
        SweepConfig(datasets=("gsm8k", "imagenet"))
    with pytest.raises(ValueError, match="batch sizes"):
        SweepConfig(batch_sizes=(0,))
    with pytest.raises(ValueError, match="s3_k2_d6"):
        SweepConfig(specs=("tree",))


def test_markdown_table_shows_gains():
    rec = [
        {"dataset": "gsm8k", "batch_size": 1, "spec": "s5_k1_d6", "tau": 2.0, "tau_star": 2.5,
         "tokens_per_s": 100.0, "kind": "linear", "num_draft_tokens": 6},
        {"dataset": "gsm8k", "batch_size": 1, "spec": "s3_k2_d6", "tau": 2.5, "tau_star": 2.9,
         "tokens_per_s": 110.0, "kind": "tree", "num_draft_tokens": 6},
    ]
    table = markdown_table(rec)
    assert "2.50 (2.90)" in table and "+25.0%" in table and "+10.0%" in table


def test_markdown_table_relative_throughput_and_distinct_ngrams():
    rec = [
        {"dataset": "gsm8k", "batch_size": 4, "spec": "ar", "tokens_per_s": 200.0, "distinct_4gram": 0.5},
        {"dataset": "gsm8k", "batch_size": 4, "spec": "s5_k1_d6", "tau": 2.0, "tau_star": 2.5,
         "tokens_per_s": 300.0, "kind": "linear", "num_draft_tokens": 6},
    ]
    table = markdown_table(rec)
    assert "| AR tokens/s | 200 |" in table and "| s5_k1_d6 | 1.50 |" in table
    assert "gsm8k 0.500" in table


def test_distinct_ngram_ratio():
    tokens = np.array([[1, 2, 3, 4, 1, 2, 3, 4], [5, 5, 5, 5, 5, 5, 5, 5], [1, 2, 3, 0, 0, 0, 0, 0]])
    # row 0: 5 four-grams, 4 distinct; row 1: 5 four-grams, 1 distinct; row 2: 3 tokens, skipped
    assert distinct_ngram_ratio(tokens, np.array([8, 8, 3]), 4) == pytest.approx((4 / 5 + 1 / 5) / 2)
    assert distinct_ngram_ratio(tokens[:1], np.array([4]), 4) == 1.0
    with pytest.raises(ValueError):
        distinct_ngram_ratio(tokens[2:], np.array([3]), 4)


_SWEEP = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
    from jaxspec.testing import high_acceptance, randomize
    import jaxspec as js
    from jaxspec.harness.eval import SweepConfig, run_sweep
    cfg = js.ModelConfig.preset("test", num_layers=2, layer_types=("csa", "hca"))
    params = jax.jit(lambda k: high_acceptance(randomize(js.init_params(cfg, k), jax.random.fold_in(k, 1))))(
        jax.random.key(0))
    rng = __import__("numpy").random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(2, 12))).tolist() for _ in range(8)]
    sweep = SweepConfig(datasets=("gsm8k",), specs=("s2_k2_d4",), batch_sizes=(8,), num_prompts=8,
                        max_new_tokens=10, rank_width=2)
    records = run_sweep(params, cfg, None, sweep, sys.argv[2], prompts_by_dataset={"gsm8k": prompts},
                        progress=False)
    print(json.dumps([[r["spec"], r["devices"], r.get("per_prompt_tau")] for r in records]))
    """
)


@pytest.mark.long  # ~2.5 minutes; 8-device identity of the loops themselves is in test_sharding_8dev
def test_sweep_identical_on_1_and_8_devices(tmp_path):
    results = {}
    for n in (1, 8):
        out = subprocess.run(
            [sys.executable, "-c", _SWEEP, str(n), str(tmp_path / f"d{n}")],
            capture_output=True, text=True, cwd=Path(__file__).parent.parent, timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        results[n] = json.loads(out.stdout.strip().splitlines()[-1])
    one, eight = results[1], results[8]
    assert [r[1] for r in one] == [1, 1] and [r[1] for r in eight] == [8, 8]
    for a, b in zip(one, eight, strict=True):
        assert a[0] == b[0]
        if a[2] is not None:
            np.testing.assert_array_equal(a[2], b[2])
    files = sorted(p.name for p in (tmp_path / "d8").iterdir())
    assert files == ["fig3_tau_gain.png", "fig4_throughput_gain.png", "runs.jsonl", "table.md"]


@pytest.mark.parametrize(
    "argv,match",
    [
        (["sweep", "--checkpoint", "/nonexistent"], "does not exist"),
        (["sweep", "--checkpoint", ".", "--datasets", "imagenet"], "unknown dataset"),
        (["sweep", "--checkpoint", ".", "--specs", "tree"], "s3_k2_d6"),
        (["sweep", "--checkpoint", ".", "--batch-sizes", "0"], "batch sizes"),
    ],
)
def test_sweep_cli_bad_input(argv, match, capsys):
    from jaxspec.cli import main

    with pytest.raises(SystemExit) as err:
        main(argv)
    message = str(err.value.code)
    assert message.startswith("jaxspec: error:") and match in message and "\n" not in message


def _record(batch, spec, tau=2.0):
    base = {"dataset": "gsm8k", "batch_size": batch, "spec": spec, "num_prompts": 8, "max_new_tokens": 10,
            "tokens_per_s": 100.0 * tau, "seconds": 0.8, "generated": 80, "devices": 1}
    if spec != "ar":
        base.update({"kind": "tree", "num_draft_tokens": 4, "tau": tau, "per_prompt_tau": [tau] * 8,
                     "per_depth_acceptance": [0.5, 0.2], "speedup_vs_ar": tau, "tau_star": tau + 0.1,
                     "rank_acceptance": [0.5, 0.1]})
    return base


def test_sweep_resume_keeps_finished_groups_and_reruns_partial_ones(tmp_path):
    from jaxspec.harness.eval import SweepConfig, _finished_groups, load_runs, run_sweep

    sweep = SweepConfig(datasets=("gsm8k",), specs=("s2_k2_d4",), batch_sizes=(4, 8), num_prompts=8,
                        max_new_tokens=10, max_prompt_tokens=12)
    finished = [_record(4, "ar"), _record(4, "s2_k2_d4"), _record(8, "ar"), _record(8, "s2_k2_d4", 2.5)]
    runs = tmp_path / "runs.jsonl"
    runs.write_text("".join(json.dumps(r) + "\n" for r in finished) + '{"dataset": "gsm8k", "bat')  # killed mid-line
    assert load_runs(runs) == finished
    counts = {"gsm8k": 8}
    assert set(_finished_groups(finished, sweep, counts)) == {("gsm8k", 4), ("gsm8k", 8)}
    # a group missing a spec, or run on other sizes, is not finished
    assert set(_finished_groups(finished[:3], sweep, counts)) == {("gsm8k", 4)}
    assert _finished_groups(finished, sweep, {"gsm8k": 16}) == {}
    # everything finished: nothing runs (no params needed), the records and report are rewritten whole
    records = run_sweep(None, None, None, sweep, tmp_path, prompts_by_dataset={"gsm8k": [[3, 4]] * 8},
                        progress=False, resume=True)
    assert records == finished and load_runs(runs) == finished
    assert "s2_k2_d4" in (tmp_path / "table.md").read_text()


def test_merge_keeps_complete_groups_only(tmp_path):
    from jaxspec.harness.eval import merge_runs

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in [_record(4, "ar"), _record(4, "s2_k2_d4")]))
    b.write_text("".join(json.dumps(r) + "\n" for r in [_record(8, "ar")]))  # stopped before its spec ran
    records, left_out = merge_runs([a, b])
    assert records == [_record(4, "ar"), _record(4, "s2_k2_d4")] and left_out == [("gsm8k", 8)]
    # a group finished by a later process replaces the cut-short one whole, records never mix
    c = tmp_path / "c.jsonl"
    c.write_text("".join(json.dumps(r) + "\n" for r in [_record(8, "ar", 3.0), _record(8, "s2_k2_d4", 3.0)]))
    records, left_out = merge_runs([a, b, c])
    assert records[2:] == [_record(8, "ar", 3.0), _record(8, "s2_k2_d4", 3.0)] and left_out == []


def test_acceptance_figure_before_after(tmp_path):
    def run(tau, depth):
        r = _record(1, "s2_k2_d4", tau)
        r.update(per_depth_acceptance=depth, rank_acceptance=[0.6, 0.1, 0.05, 0.0])
        return r

    path = plot_acceptance([run(2.0, [0.7, 0.3])], [run(2.5, [0.9, 0.6])], "s2_k2_d4", tmp_path / "acc.png")
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no dataset has s4_k2_d8 runs in both"):
        plot_acceptance([run(2.0, [0.7, 0.3])], [run(2.5, [0.9, 0.6])], "s4_k2_d8", tmp_path / "none.png")


def test_distill_history_figure(tmp_path):
    held = lambda step, a: {"step": step, "heldout": {"agree1": a, "agree2": a - 0.1, "kl1": 1 - a, "kl2": 1.1 - a}}  # noqa: E731
    train = [{"step": s, "train_agree1": 0.5, "train_agree2": 0.4, "train_kl1": 0.5, "train_kl2": 0.6}
             for s in range(1, 30)]
    path = plot_distill_history([held(0, 0.5), *train, held(30, 0.7)], tmp_path / "d.png")
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"


def test_sweep_stopped_mid_way_finishes_the_rest_when_rerun(test_cfg, test_params, tmp_path, monkeypatch):
    """Ctrl-C in the second (dataset, batch) group; the same sweep run again keeps the first group's
    records as they were and runs only the second (resume is what `jaxspec sweep` does by default)."""
    import jaxspec.harness.eval as eval_lib
    from jaxspec.harness.eval import SweepConfig, load_runs, run_sweep

    real, calls = eval_lib.run_batch, []

    def counted(*args, **kwargs):
        calls.append((args[2].name if args[2] else "ar", kwargs["pad_batch_to"]))
        if stop_at is not None and len(calls) == stop_at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(eval_lib, "run_batch", counted)
    # Two datasets at one batch size share every compiled program (one prompt width), which keeps it cheap.
    sweep = SweepConfig(datasets=("gsm8k", "mbpp"), specs=("s2_k1_d3",), batch_sizes=(2,), num_prompts=4,
                        max_new_tokens=6, rank_width=2, repeats=1)
    prompts = {"gsm8k": [[5, 6, 7], [3], [9, 10, 11, 12], [4, 5]], "mbpp": [[8, 9], [10, 11, 12], [6], [7, 7]]}
    # Group (gsm8k, 2): the rank-acceptance pass (one call), a first pass of AR and the spec over the
    # 2 batches (it compiles), one timed round of the same; stop at the first call of group (mbpp, 2).
    stop_at = 1 + 2 * 2 + 2 * 2 + 1
    with pytest.raises(KeyboardInterrupt):
        run_sweep(test_params, test_cfg, None, sweep, tmp_path, prompts_by_dataset=prompts, progress=False,
                  resume=True)
    first = load_runs(tmp_path / "runs.jsonl")
    assert [(r["dataset"], r["spec"]) for r in first] == [("gsm8k", "ar"), ("gsm8k", "s2_k1_d3")]
    calls.clear()
    stop_at = None
    records = run_sweep(test_params, test_cfg, None, sweep, tmp_path, prompts_by_dataset=prompts, progress=False,
                        resume=True)
    assert len([name for name, _ in calls if name in ("ar", "s2_k1_d3")]) == 8  # one group ran, not two
    assert records[:2] == first and [(r["dataset"], r["spec"]) for r in records[2:]] == [("mbpp", "ar"),
                                                                                          ("mbpp", "s2_k1_d3")]
