"""The terms behind the R1 step-vs-drafts shape point (docs/cost_model.md): a draft step's own
kernels, the MTP block at its own precision and the TP x EP split of the routed experts."""

from __future__ import annotations

import dataclasses

import pytest

from jaxspec.core.spec import SpecConfig
from jaxspec.cost import fit as cost_fit
from jaxspec.cost import inventory, latency, routing
from jaxspec.cost.terms import Setup, layer_pass, stage_table

MESH = (1, 8, 1)


@pytest.fixture(scope="module")
def r1():
    return cost_fit.r1_like()


def test_each_draft_step_launches_its_input_and_selection_kernels(r1):
    s = Setup(r1, MESH, 1, 2048, "fp8", "fp4", layout="even")
    kernels = dict(latency.H200.kernels)
    for steps in (1, 3, 5):
        draft = stage_table(s, SpecConfig(steps, 1, steps + 1))["draft"]
        # per step: the MTP block (sliding), its head, its inputs, its sampling; expansion between steps
        assert draft.layer_passes == {"sliding": steps, "head": steps, "mtp_in": steps, "draft_sample": steps,
                                      **({"draft_expand": steps - 1} if steps > 1 else {})}
        launches = steps * (kernels["sliding"] + kernels["head"] + kernels["mtp_in"] + kernels["draft_sample"])
        launches += (steps - 1) * kernels["draft_expand"]
        assert latency.split(draft, latency.hardware("b200"), latency.H200)["launch"] == pytest.approx(
            launches * latency.H200.launch_us * 1e-6)


def test_mtp_weights_store_only_the_mtp_block_at_their_precision(r1):
    base = Setup(r1, MESH, 1, 2048, "fp8", "fp4", layout="even")
    bf16 = dataclasses.replace(base, mtp_weights="plain")
    plain = inventory.layout_units(r1, MESH, "plain", "fp4", "even")
    u, v = base.units(), bf16.units()
    for name in ("mtp", "mtp_kv", "mtp_head"):
        assert v[name] == plain[name]
    assert v["layers.5"] == u["layers.5"] and v["vocab"] == u["vocab"]
    # one bf16 R1 expert on one device of 8 (EP): 3 x 7168 x 2048 x 2 B
    assert v["mtp"].expert_bytes == 3 * 7168 * 2048 * 2


def test_moe_groups_split_each_expert_over_its_group(r1):
    ep = inventory.layout_units(r1, MESH, "fp8", "fp4", "even")
    tp_ep = inventory.layout_units(r1, MESH, "fp8", "fp4", "even", 2)
    u, v = ep["layers.5"], tp_ep["layers.5"]
    assert (u.expert_groups, v.expert_groups) == (8, 2)
    assert v.expert_bytes == pytest.approx(u.expert_bytes / 4) and v.dense_bytes == u.dense_bytes
    s = Setup(r1, MESH, 1, 2048, "fp8", "fp4", layout="even", moe_groups=2)
    ar = stage_table(s, None)["ar"]
    # tokens replicated over the 8 devices: two all-reduces per layer (attention, experts), no all-to-all
    assert ar.collectives["all_reduce"][0] == 2 * r1.num_layers and "all_to_all" not in ar.collectives
    # the busiest device reads its group's share: E[max of 2 groups] x a quarter expert
    c = layer_pass(s, "layers.5", 1)
    busiest = routing.expected_max_per_device(256, 8, 1, 2)  # of the 8 experts, the fuller group's
    assert 4 < busiest < 8
    assert c.busiest_bytes - c.total_bytes == pytest.approx((busiest - 4) * v.expert_bytes)
    with pytest.raises(ValueError, match="moe_groups"):
        inventory.layout_units(r1, MESH, "fp8", "fp4", "even", 3)


def test_r1_structure_keeps_r1_sizes_with_full_context_layers(r1):
    cfg = cost_fit.r1_structure()
    assert (cfg.num_layers, cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok) == (61, 7168, 256, 8)
    assert set(cfg.layer_types) == {"sliding"} and cfg.sliding_window == 2048 and cfg.num_hash_layers == 0
    assert cost_fit.model_config("r1-structure") == cfg
