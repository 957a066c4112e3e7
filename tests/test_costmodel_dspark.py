"""The analytic cost model of a DSpark cycle (docs/cost_model.md, "DSpark"): every term of the draft,
verify and commit against a hand calculation from the released shapes (docs/dspark.md, "What a release holds"),
the launch and collective counts, the `rules` layout's split Markov head, XLA's cost analysis of the
real DSpark stage programs on abstract shapes, and the SGLang check points."""

from __future__ import annotations

import json
import math

import pytest

import jaxspec as js
from jaxspec.core.dspark import DSparkConfig
from jaxspec.cost import fit as cost_fit
from jaxspec.cost import latency, routing
from jaxspec.cost.terms import Setup, main_pass, stage_table

V4_FLASH_DSPARK = DSparkConfig(block_size=5, noise_token_id=128799, target_layers=(40, 41, 42), markov_rank=256,
                               num_stages=3)
D, V, R, W, C, T = 4096, 129280, 256, 128, 512, 8  # hidden, vocab, Markov rank, window, kv width, tensor devices


def fp8(rows: int, cols: int) -> int:
    """An FP8 matrix as released: one byte per value, one UE8M0 byte per 128 x 128 block."""
    return rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128)


# One draft stage's non-routed weights (docs/dspark.md, "What a release holds"), all devices: FP8
# attention and shared expert, fp32 norms / sink / hyper-connections / gate bias, the bf16 router.
STAGE = (fp8(4096, 1024) + fp8(1024, 32768) + fp8(4096, 512) + fp8(8192, 4096) + fp8(4096, 8192)
         + 2 * fp8(2048, 4096) + fp8(4096, 2048)
         + 4 * (1024 + 512 + 2 * 4096 + 64 + 2 * (24 * 16384 + 24 + 3) + 256) + 2 * 256 * 4096)
# One FP4 routed expert: w1, w3 [2048 x 4096] and w2 [4096 x 2048] at half a byte, one scale per 32 values.
EXPERT = 3 * (2048 * 4096 // 2 + 2048 * 4096 // 32)


@pytest.fixture(scope="module")
def flash():
    cfg = js.ModelConfig.preset("v4-flash")
    return cfg, Setup(cfg, (1, T, 1), 1, 4096, "fp8", "fp4", layout="even")


@pytest.mark.parametrize("name, slots", [("s5_k1_d6", 5), ("s4_k2_d8", 7)])
def test_dspark_draft_terms_by_hand(flash, name, slots):
    cfg, s = flash
    spec = js.SpecConfig.parse(name)
    steps, gamma = spec.num_steps, V4_FLASH_DSPARK.block_size
    draft = stage_table(s, spec, V4_FLASH_DSPARK)["draft"]
    assert STAGE == 137_411_928 and EXPERT == 13_369_344
    # weights: 3 stages, the drafter's hc_head + norm and the target's bf16 head (split over 8), and per Markov
    # step the whole W2 [256, V] bf16 and the confidence head [d + r] fp32 (both replicated)
    head = (4 * (16384 * 4 + 4 + 1 + 4096) + 2 * D * V) / T
    assert draft.bytes["weights"] == pytest.approx(3 * STAGE / T + head + steps * (2 * R * V + 4 * (D + R)))
    # routed experts: 3 stages x the experts 5 block tokens touch, 28.63 of 256, over 8 devices
    assert routing.expected_distinct(256, 6, gamma) == pytest.approx(28.63, abs=0.01)
    assert draft.bytes["experts"] == pytest.approx(3 * routing.expected_distinct(256, 6, 5) / T * EXPERT)
    # gathered rows: 5 bf16 embedding rows (vocab-split) + one W1 row [r] bf16 per expanded slot
    assert draft.bytes["rows"] == pytest.approx(gamma * 2 * D / T + slots * 2 * R)
    assert draft.bytes["state_read"] == 3 * W * C * 2 and draft.bytes["state_write"] == 0  # each stage's ring
    # FLOPs: every block query attends the ring's W rows + the 5 block keys (8 heads per device)
    assert draft.flops["attention"] == pytest.approx(3 * 4 * gamma * (64 // T) * C * (W + gamma))
    assert draft.flops["experts"] == pytest.approx(3 * 2 * gamma * 6 / T * 3 * 2048 * 4096)
    assert draft.flops["markov"] == pytest.approx(2 * slots * R * V)  # [r] x [r, V] per expanded slot
    assert draft.flops["confidence"] == pytest.approx(2 * slots * (D + R))
    # per stage: the attention all-reduce and the dispatch / combine pair; one all-gather of the 5 positions'
    # fp32 logits; the replicated Markov head needs none
    assert draft.collectives["all_reduce"] == (3, pytest.approx(3 * 2 * 7 / 8 * gamma * D * 2))
    assert draft.collectives["all_to_all"][0] == 6
    assert draft.collectives["all_gather"] == (1, pytest.approx(7 / 8 * gamma * V * 4))
    expand = {"draft_expand": steps - 1} if steps > 1 else {}
    assert draft.layer_passes == {"dspark_in": 1, "sliding": 3, "head": 1, "markov": steps, **expand}
    assert draft.passes == 1  # one block pass; the Markov loop runs in the same program
    kernels = dict(latency.H200.kernels)
    launches = 1 + 3 * 22 + 4 + steps * 6 + (steps - 1) * 3
    assert kernels["dspark_in"] + 3 * kernels["sliding"] + kernels["head"] + steps * kernels["markov"] \
        + (steps - 1) * kernels["draft_expand"] == launches
    parts = latency.split(draft, latency.hardware("b200"), latency.H200)
    assert parts["launch"] == pytest.approx(launches * latency.H200.launch_us * 1e-6)
    assert parts["collective_latency"] == pytest.approx(10 * latency.H200.collective_us * 1e-6)


def test_dspark_verify_is_the_target_pass_plus_the_capture(flash):
    cfg, s = flash
    for name in ("s5_k1_d6", "s4_k2_d8"):
        spec = js.SpecConfig.parse(name)
        verify = stage_table(s, spec, V4_FLASH_DSPARK)["verify"]
        plain = main_pass(s, spec.num_draft_tokens, commit=0)
        # the capture: per layer 40..42 the [D, 4, d] output streams read and their mean [D, d] written, bf16
        n = spec.num_draft_tokens
        assert verify.bytes["capture"] == 3 * n * (4 + 1) * D * 2
        assert verify.flops["capture"] == 3 * n * 4 * D
        assert verify.layer_passes == {**plain.layer_passes, "capture": 3}
        assert verify.total_bytes - verify.bytes["capture"] == pytest.approx(plain.total_bytes)
        assert verify.collectives == plain.collectives
        # the MTP cycle's verify of the same width is the same target pass, without the capture
        mtp = stage_table(s, spec)["verify"]
        assert verify.total_bytes == pytest.approx(mtp.total_bytes + 3 * n * 5 * D * 2)
        assert verify.bytes["capture"] / verify.total_bytes < 5e-4  # negligible, as expected


def test_dspark_commit_terms_by_hand(flash):
    cfg, s = flash
    spec = js.SpecConfig.parse("s5_k1_d6")
    commit = stage_table(s, spec, V4_FLASH_DSPARK)["commit"]
    rows = spec.num_steps + 1  # the accepted path's rows, at most S + 1
    # main_proj [12288 -> 4096] FP8 + main_norm, once; per stage wkv [4096 -> 512] FP8 + kv_norm (fp32)
    main_proj = fp8(3 * D, D) + 4 * D
    wkv = fp8(D, C) + 4 * C
    assert commit.bytes["weights"] == pytest.approx((main_proj + 3 * wkv) / T)
    assert commit.flops["matmul"] == pytest.approx(2 * rows * (3 * D * D + 3 * D * C) / T)
    # the rows written: 3 rings x 6 rows x 1024 B, and the target's own commit (as the MTP cycle's)
    target = stage_table(s, spec)["commit"]
    mtp_ring = rows * C * 2  # the MTP refresh's ring rows, which the DSpark cycle does not write
    target_writes = target.bytes["state_write"] - mtp_ring
    assert commit.bytes["state_write"] == pytest.approx(target_writes + 3 * rows * C * 2)
    assert commit.collectives == {"all_reduce": (1, pytest.approx(2 * 7 / 8 * rows * D * 2))}
    assert commit.layer_passes == {"dspark_ctx": 1, "dspark_kv": 3} and commit.passes == 1


def test_rules_layout_splits_the_markov_head_and_gathers_its_logits(flash):
    cfg, _ = flash
    s = Setup(cfg, (1, T, 1), 1, 4096, "fp8", "fp4", layout="rules")
    spec = js.SpecConfig.parse("s4_k2_d8")
    draft = stage_table(s, spec, V4_FLASH_DSPARK)["draft"]
    even = stage_table(Setup(cfg, (1, T, 1), 1, 4096, "fp8", "fp4", layout="even"), spec, V4_FLASH_DSPARK)["draft"]
    # W2 vocab-split over the 8 tensor devices: each step reads an eighth of it, then all-gathers the step's
    # fp32 logits (1 slot at step one, 2 after: 7 slots)
    assert draft.collectives["all_gather"] == (1 + 4, pytest.approx(7 / 8 * 5 * V * 4 + 7 / 8 * 7 * V * 4))
    assert draft.flops["markov"] == pytest.approx(even.flops["markov"] / T)


def test_dspark_spec_deeper_than_the_block_is_one_line(flash):
    _, s = flash
    with pytest.raises(ValueError, match=r"deeper than the DSpark block of 5 positions: allowed 1\.\.5$"):
        stage_table(s, js.SpecConfig.parse("s6_k1_d7"), V4_FLASH_DSPARK)
    with pytest.raises(ValueError, match="target_layers"):
        stage_table(s, js.SpecConfig.parse("s3_k1_d4"), DSparkConfig(5, 1, (40, 43), 8))


@pytest.mark.parametrize("weights_dominate", [True, False])
def test_dspark_analytic_agrees_with_xla_cost_analysis(weights_dominate):
    from jaxspec.cost import xla as cost

    # hidden 2048 (k = E: XLA's dense CPU experts are what routing selects): the stages' weights dominate;
    # vocab 8192 and rank 512 at hidden 256: the Markov head's rank-r products dominate the draft's FLOPs
    if weights_dominate:
        cfg = js.ModelConfig.preset("test", hidden_size=2048, num_experts_per_tok=4, moe_intermediate_size=1024,
                                    vocab_size=512)
        dcfg, batch, stages = DSparkConfig(5, 511, (1, 2, 3), 16, 2), 1, ("draft", "verify", "commit")
    else:
        cfg = js.ModelConfig.preset("test", hidden_size=256, num_experts_per_tok=4, moe_intermediate_size=128,
                                    vocab_size=8192)
        dcfg, batch, stages = DSparkConfig(5, 8191, (1, 2, 3), 512, 2), 2, ("draft",)
    s = Setup(cfg, (1, 1, 1), batch, 64)
    for name in ("s3_k2_d5", "s5_k1_d6"):
        spec = js.SpecConfig.parse(name)
        xla = cost.stage_costs(cfg, spec, batch, 64, which=("plan", *stages), draft=dcfg)
        ours = stage_table(s, spec, dcfg)
        for stage in stages:
            assert ours[stage].total_flops == pytest.approx(xla[stage].flops, rel=0.02), (name, stage)
            # XLA's pre-fusion count also bills activations (and, per Markov step, more of W1 than its rows)
            assert ours[stage].total_bytes == pytest.approx(xla[stage].bytes, rel=0.15 if weights_dominate else 0.25), \
                (name, stage)
        if not weights_dominate:
            assert ours["draft"].flops["markov"] > 0.5 * ours["draft"].total_flops
        assert xla["plan"].bytes < 5e4  # index arithmetic the table leaves out
        assert xla["draft"].passes == 1


@pytest.fixture(scope="module")
def sglang():
    points = [p for p in cost_fit.load_points() if "8xb200" in p["name"] and p["preset"] == "v4-flash"]
    return {r["name"]: r for r in cost_fit.residuals(points, latency.H200)}


def test_sglang_dspark_check_points(sglang):
    """SGLang's DSpark chain on 8 x B200 (docs/cost_model.md, "The SGLang check"): the model's cycle over its AR
    step gives the published speedup over no speculation within 20% at the accept length assumed (2.74); the
    TPOT is within 30% at the concurrency-1 serving point and not at the single-stream ones, where the model's
    AR step itself is 1.7-2x the no-speculation TPOT of the same session (the H200-fitted latency terms)."""
    chain = {k: v for k, v in sglang.items() if "dspark" in k}
    assert len(chain) == 3
    for r in chain.values():
        assert abs(r["speedup_residual"]) <= 0.20, r
        assert 2.2 <= r["implied_accept_length"] <= 2.8, r
    assert abs(chain["v4-flash-dspark-sglang-8xb200-random-c1"]["residual"]) <= 0.30
    assert abs(chain["v4-flash-dspark-sglang-8xb200-1024"]["speedup_residual"]) <= 0.05
    for tag in ("1024", "512"):
        tpot, ar = sglang[f"v4-flash-dspark-sglang-8xb200-{tag}"], sglang[f"v4-flash-sglang-8xb200-ar-{tag}"]
        assert tpot["residual"] > 0.30 and ar["residual"] > 0.60
        # the gap is the AR step's: TPOT residual = AR residual x the speedup check
        assert 1 + tpot["residual"] == pytest.approx((1 + ar["residual"]) / (1 + tpot["speedup_residual"]), rel=1e-3)


def test_cli_costs_a_dspark_draft(tmp_path, capsys):
    from jaxspec.cli import main
    from jaxspec.cost import default_dspark

    out = tmp_path / "cost.json"
    assert main(["cost", "--preset", "test", "--draft", "dspark", "--specs", "s4_k1_d5,s4_k2_d8", "--batch-sizes", "1",
                 "--context", "64", "--tau", "2.5", "--json", str(out)]) == 0
    assert "a model, not a measurement" in " ".join(capsys.readouterr().out.split())
    cfg = js.ModelConfig.preset("test")
    dcfg = default_dspark(cfg)
    assert (dcfg.block_size, dcfg.target_layers, dcfg.num_stages) == (5, (1, 2, 3), 3)
    assert default_dspark(js.ModelConfig.preset("v4-flash")) == V4_FLASH_DSPARK
    rows = {r["spec"]: r["stages"] for r in json.loads(out.read_text())["rows"]}
    for name in ("s4_k1_d5", "s4_k2_d8"):
        want = stage_table(Setup(cfg, (1, 1, 1), 1, 64, layout="even"), js.SpecConfig.parse(name), dcfg)
        assert rows[name]["draft"]["flops_terms"]["markov"] == pytest.approx(want["draft"].flops["markov"])
        assert rows[name]["verify"]["bytes_terms"]["capture"] == pytest.approx(want["verify"].bytes["capture"])
    # the XLA path lowers the DSpark cycle too
    xla = tmp_path / "xla.json"
    assert main(["cost", "--model", "xla", "--preset", "test", "--draft", "dspark", "--specs", "s3_k2_d5",
                 "--batch-sizes", "1", "--context", "64", "--json", str(xla)]) == 0
    stages = {r["spec"]: r["stages"] for r in json.loads(xla.read_text())["rows"]}["s3_k2_d5"]
    assert stages["draft"]["passes"] == 1 and stages["verify"]["flops"] > 0
    with pytest.raises(SystemExit) as excinfo:
        main(["cost", "--preset", "test", "--draft", "dspark", "--specs", "s6_k1_d7"])
    assert "deeper than the DSpark block of 5 positions" in excinfo.value.code and "\n" not in excinfo.value.code


def test_projected_tau_of_chains_and_beam_trees_by_hand():
    from jaxspec.cost.acceptance import beam_tau, rates_from_chain

    published = (0.579, 0.447, 0.316, 0.237, 0.158)  # V4-Flash-0731, greedy, 5 drafts: accept length 2.74
    rates = rates_from_chain(published, 0.25)
    assert [r[0] for r in rates] == pytest.approx([0.579, 0.447 / 0.579, 0.316 / 0.447, 0.237 / 0.316, 0.158 / 0.237])
    assert rates[0][1] == pytest.approx(0.421 * 0.25)
    tau, kept = beam_tau(rates, js.SpecConfig.parse("s5_k1_d6"))
    assert tau == pytest.approx(1 + sum(published)) and kept == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0,) * 5]
    # by hand: c = 0.6, 0.5 and siblings at half the rest: depth 1 holds 0.6 / 0.2, depth 2 0.3 / 0.15 / 0.1 / 0.05;
    # a budget of 4 keeps 0.6, 0.3 and 0.2
    tau, kept = beam_tau(rates_from_chain((0.6, 0.3), 0.5), js.SpecConfig.parse("s2_k2_d4"))
    assert tau == pytest.approx(2.1) and kept == [(0,), (0, 0), (1,)]
    # the beam expands only the K best of a step: at depth 3 the children of (0, 0) and (0, 1) (0.30, 0.24), not
    # of (1, 0) (0.15); a budget of 11 keeps the whole pool of 2 + 4 + 4
    tau, kept = beam_tau([[0.6, 0.3], [0.5, 0.4], [0.9, 0.1]], js.SpecConfig.parse("s3_k2_d11"))
    assert {p[:2] for p in kept if len(p) == 3} == {(0, 0), (0, 1)} and len(kept) == 10
    assert tau == pytest.approx(1 + 0.6 + 0.3 + 0.30 + 0.24 + 0.15 + 0.12 + 0.27 + 0.03 + 0.216 + 0.024)
    with pytest.raises(ValueError, match="non-increasing"):
        rates_from_chain((0.5, 0.6), 0.2)
    with pytest.raises(ValueError, match="needs rates for 6 depths"):
        beam_tau(rates, js.SpecConfig.parse("s6_k1_d7"))
