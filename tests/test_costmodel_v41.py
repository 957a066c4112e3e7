"""The analytic cost model on DeepSeek-V4.1-Flash: every figure of docs/cost_model.md ("V4.1") by hand.

v41-flash as released (FP8 32 x 32 weights, MXFP4 routed experts, FP8 Engram tables with one scale per
32 columns of a row), mesh (1, 8, 1), `even`, batch 1, context 4096.
"""

from __future__ import annotations

import pytest

import jaxspec as js
from jaxspec.cost import latency
from jaxspec.cost.terms import Setup, default_dspark, layer_pass, stage_table

D, Q, H, C, G, OL, I, V = 5120, 1280, 64, 512, 8, 1024, 2304, 129280
HC, TOPK, CI, HI, W = 4, 512, 128, 32, 128
FP8 = 1 + 1 / 1024  # one UE8M0 scale per 32 x 32 block
EXPERT = 3 * (D * I // 2 + D * I // 32)  # MXFP4: two values a byte, one scale per 32
# a layer without compressor, indexer or Engram: attention and shared expert FP8, the bf16 router and its
# fp32 bias, the fp32 hyper-connections (fn [hc d, (2 + hc) hc], base, scale), fp32 norms and sinks
PLAIN = ((D * Q + Q * H * C + D * C + H * C * OL + G * OL * D + 3 * D * I) * FP8 + D * 384 * 2 + 384 * 4
         + 2 * (HC * D * (2 + HC) * HC + (2 + HC) * HC + 3) * 4 + (2 * D + Q + C + H) * 4)
ENGRAM = 3 * 8 * 256 * (HC + 1) * D * FP8 + 2 * HC * D * 2  # wkv [(N-1) H head_dim, (hc+1) d], q / k weights
INDEXER = Q * HI * CI * FP8 + D * HI * 2  # wq_b FP8, weights_proj bf16
KEYS = C * CI * 2 + CI * 4 + C * 4  # wk, k_norm, the compressor's norm
OWNER2 = 2 * D * C * 2 + KEYS + INDEXER  # wkv and wgate bf16
OWNER1 = D * C * 2 + KEYS + INDEXER  # no gate at ratio 1
HEAD = D * V * 2 + D * 4  # bf16 head, fp32 norm; no hc_head in V4.1


@pytest.fixture(scope="module")
def setup():
    return Setup(js.ModelConfig.preset("v41-flash"), (1, 8, 1), 1, 4096, "fp8", "fp4", layout="even")


def test_weights_by_hand(setup):
    units = setup.units()
    assert units["layers.3"].expert_bytes == EXPERT == 18_800_640
    assert units["layers.0"].dense_bytes == pytest.approx(PLAIN / 8)
    assert units["layers.1"].dense_bytes == pytest.approx((PLAIN + ENGRAM) / 8)  # Engram, window only
    assert units["layers.2"].dense_bytes == pytest.approx((PLAIN + OWNER2) / 8)
    assert units["layers.14"].dense_bytes == pytest.approx((PLAIN + OWNER2 + ENGRAM) / 8)
    assert units["layers.20"].dense_bytes == pytest.approx((PLAIN + OWNER1) / 8)
    assert units["layers.24"].dense_bytes == pytest.approx((PLAIN + INDEXER) / 8)
    # The tables are gathered, never read whole: 24 rows of 256 FP8 + 8 scales per token, split 8 ways
    assert units["layers.1"].row_bytes == pytest.approx(24 * (256 + 8) / 8)
    dense = 40 * PLAIN + 2 * ENGRAM + 3 * OWNER2 + OWNER1 + 4 * INDEXER + HEAD
    ar = stage_table(setup, None)["ar"]
    assert ar.bytes["weights"] == pytest.approx(dense / 8)
    assert ar.bytes["weights"] == pytest.approx(1.0655e9, rel=1e-4)
    assert ar.bytes["experts"] == pytest.approx(40 * 6 / 8 * EXPERT)  # 564.0 MB


def test_state_reads_by_hand(setup):
    """Window rings everywhere; the owners' pools read by the top-k picks only; each index source scores
    its owner's keys whole (ratio 2: 2,048 entries at context 4096, ratio 1: 4,096)."""
    ring, pick = W * C * 2, TOPK * C * 2
    keys2, keys1, rows2 = 2048 * CI * 2, 4096 * CI * 2, 2 * 2 * C * 4  # rows2: the half-pair's fp32 kv and gate
    expected = (2 * ring + 30 * (ring + pick) + 3 * (ring + keys2 + rows2 + pick) + 5 * (ring + keys1 + pick))
    assert stage_table(setup, None)["ar"].bytes["state_read"] == expected == 32_006_144
    for layer, reads in ((3, ring + pick), (8, ring + keys2 + rows2 + pick), (21, ring + pick),
                         (28, ring + keys1 + pick)):
        assert layer_pass(setup, f"layers.{layer}", 1).bytes["state_read"] == reads


def test_flops_and_launches_by_hand(setup):
    heads = H // 8
    for layer, keys, scored in ((0, W + 1, 0), (3, W + 1 + TOPK + 1, 0), (2, W + 1 + TOPK + 1, 2049),
                                (24, W + 1 + TOPK + 1, 4097)):
        f = layer_pass(setup, f"layers.{layer}", 1).flops
        assert f["attention"] == 4 * heads * C * keys
        assert f["indexer"] == 2 * HI * (CI + 1) * scored
    ar = stage_table(setup, None)["ar"]
    assert ar.layer_passes == {"sliding": 2, "engram": 2, "owner": 4, "reuse": 30, "reindex": 4, "candidates": 1,
                               "head": 1}
    kernels = latency.DEFAULT_KERNELS
    launches = sum(kernels[k] * n for k, n in ar.layer_passes.items())
    assert launches == 2 * 22 + 2 * 6 + 4 * 34 + 30 * 23 + 4 * 28 + 3 + 4 == 1001
    parts = latency.split(ar, latency.hardware("h200"), latency.H200)
    assert parts["launch"] == pytest.approx(1001 * 4.35e-6)
    assert parts["collective_latency"] == pytest.approx((40 + 80 + 1) * 11.5e-6)


def test_dspark_draft_by_hand(setup):
    """V4.1's drafter: 3 window-only V4.1 stages with their own 128-expert top-3 MoE, taps 37-39."""
    draft_cfg = default_dspark(setup.cfg)
    assert draft_cfg.target_layers == (37, 38, 39)
    assert (draft_cfg.n_routed_experts, draft_cfg.num_experts_per_tok) == (128, 3)
    units = setup.units(draft_cfg)
    stage = PLAIN - D * (384 - 128) * 2 - (384 - 128) * 4  # its router over 128 experts
    assert units["dspark.stage.0"].dense_bytes == pytest.approx(stage / 8)
    draft = stage_table(setup, js.SpecConfig.parse("s5_k1_d6"), draft_cfg)["draft"]
    distinct = 128 * (1 - (1 - 3 / 128) ** 5) / 8  # per device, 5 block rows, independent routing
    assert draft.bytes["experts"] == pytest.approx(3 * distinct * EXPERT)
    markov = 256 * V * 2  # W2 read whole each of the 5 steps (replicated); W1 rows gathered
    assert draft.bytes["weights"] == pytest.approx(3 * stage / 8 + HEAD / 8 + 5 * (markov + (D + 256) * 4))
    verify = stage_table(setup, js.SpecConfig.parse("s5_k1_d6"), draft_cfg)["verify"]
    assert verify.bytes["capture"] == 3 * 6 * (HC + 1) * D * 2


def test_v41_needs_its_dspark_drafter():
    """V4.1 has no MTP block: a cycle without a DSpark drafter is a one-line error (the CLI's:
    tests/test_costmodel.py::test_bad_input_is_one_line)."""
    with pytest.raises(ValueError, match="no MTP block"):
        stage_table(Setup(js.ModelConfig.preset("v41-flash"), (1, 8, 1), 1, 4096), js.SpecConfig.parse("s3_k1_d4"))
