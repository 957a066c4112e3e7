"""Sharding rules, meshes and the memory plan (no devices needed: the 8-device runs are in
test_sharding_8dev.py)."""

from __future__ import annotations

import jax
import pytest
from flax import struct
from jax.sharding import PartitionSpec as P

import jaxspec as js
from jaxspec import sharding
from jaxspec.cli import main
from jaxspec.model import placement
from jaxspec.model.state import abstract_state

PRESETS = ["test", "tiny", "v4-flash", "v4-pro"]


@struct.dataclass
class _Undeclared:
    new_weight: jax.Array  # a parameter whose field declares no logical axes


def _is_axes(a):
    return isinstance(a, tuple) and all(x is None or isinstance(x, str) for x in a)


@pytest.mark.parametrize("preset,mtp", [(p, m) for p in PRESETS for m in (1, 0)] + [("v41-test", 0), ("v41-flash", 0)])
def test_every_param_and_state_leaf_has_logical_axes(preset, mtp):
    cfg = js.ModelConfig.preset(preset, num_mtp_layers=mtp)
    params = placement.abstract_params(cfg)
    axes = sharding.logical_axes(params)
    for leaf, names in zip(jax.tree.leaves(params), jax.tree.leaves(axes, is_leaf=_is_axes),
                           strict=True):
        assert len(names) == leaf.ndim
    state = abstract_state(cfg, 2, 256)
    for leaf, names in zip(jax.tree.leaves(state),
                           jax.tree.leaves(sharding.logical_axes(state), is_leaf=_is_axes),
                           strict=True):
        assert len(names) == leaf.ndim and names[0] == "batch"


def test_flash_on_eight_devices_splits_heads_groups_experts_vocab():
    cfg = js.ModelConfig.preset("v4-flash")
    specs = placement.param_specs(cfg, (1, 8, 1))
    attn = specs.layers[4].attn
    assert attn.wq_b == P(None, "tensor")
    assert attn.wo_a == P("tensor") and attn.wo_b == P("tensor") and attn.sink == P("tensor")
    assert attn.wkv == P() and attn.indexer.wq_b == P()  # MQA kv head and indexer stay whole
    assert specs.layers[4].ffn.experts.w1 == P("tensor")  # experts take the tensor axis (EP)
    assert specs.layers[4].ffn.shared.w2 == P("tensor")  # shared expert: hidden over tensor
    assert specs.embed == P("tensor") and specs.head == P(None, "tensor")
    assert specs.layers[4].ffn.gate == P() and specs.norm == P()
    ep = placement.param_specs(cfg, (1, 2, 4)).layers[4].ffn.experts
    assert ep.w1 == P(("expert", "tensor")) and ep.w2 == P(("expert", "tensor"))


def test_indivisible_dims_fall_back_consistently():
    cfg = js.ModelConfig.preset("test")  # 4 heads, 2 o_groups, 4 experts
    specs = placement.param_specs(cfg, (1, 8, 1))
    attn = specs.layers[1].attn
    assert attn.wq_b == P() and attn.sink == P()  # 4 heads over 8: whole
    assert attn.wo_a == P() and attn.wo_b == P()  # 2 groups: g*o_lora=32 divides 8, but whole groups don't
    specs = placement.param_specs(cfg, (1, 2, 4))
    assert specs.layers[1].attn.wq_b == P(None, "tensor") and specs.layers[1].attn.wo_b == P("tensor")
    experts = specs.layers[1].ffn.experts  # 4 experts over expert=4; tensor left for the hidden width
    assert experts.w1 == P("expert", None, "tensor") and experts.w2 == P("expert", "tensor")


def test_rules_override_and_validation():
    cfg = js.ModelConfig.preset("v4-flash")
    specs = placement.param_specs(cfg, (1, 8, 1), rules={"vocab": None, "index_heads": "tensor"})
    assert specs.embed == P() and specs.layers[2].attn.indexer.wq_b == P(None, "tensor")
    state = abstract_state(cfg, 16, 512)
    assert placement.state_specs(cfg, state, (8, 1, 1)).layers[3].comp_kv == P("data")
    assert placement.state_specs(cfg, abstract_state(cfg, 4, 512), (8, 1, 1)).layers[3].comp_kv == P()
    for bad in ({"heads": "model"}, {"heads": ("tensor", "tensor")}):
        with pytest.raises(ValueError, match="mesh axes must be"):
            placement.param_specs(cfg, (1, 8, 1), rules=bad)
    with pytest.raises(ValueError, match="no logical-axis rule"):
        sharding.logical_axes(_Undeclared(new_weight=jax.numpy.zeros((2, 2))))


def test_meshes():
    assert js.make_mesh().shape == {"data": 1, "tensor": 1, "expert": 1}
    with pytest.raises(ValueError, match="needs 8 devices, 1 available"):
        js.make_mesh(data=2, tensor=4)
    with pytest.raises(ValueError, match="tensor must be an int >= 1"):
        js.make_mesh(tensor=0)
    assert [sharding.default_mesh_shape(n) for n in (1, 2, 4, 8)] == [(1, 1, 1), (1, 2, 1), (1, 4, 1), (1, 8, 1)]
    assert sharding.default_mesh_shape(8, js.ModelConfig.preset("v4-flash")) == (1, 8, 1)
    assert sharding.default_mesh_shape(8, js.ModelConfig.preset("test")) == (1, 2, 4)  # 2 o_groups, 4 experts
    assert sharding.parse_mesh("2,4,1") == (2, 4, 1)
    with pytest.raises(ValueError, match="three positive ints"):
        sharding.parse_mesh("2,4")


def test_bad_mesh_argument(test_cfg):
    params = None  # the mesh is checked before the parameters are looked at
    with pytest.raises(ValueError, match="jax.sharding.Mesh"):
        js.generate(params, test_cfg, [[1, 2]], max_new_tokens=2, mesh=(1, 8, 1))
    with pytest.raises(ValueError, match="jax.sharding.Mesh"):
        js.speculative_generate(params, test_cfg, [[1, 2]], "s2_k2_d4", max_new_tokens=2, mesh="1,8,1")


def test_distributed_arguments_are_checked_before_jax_sees_them():
    with pytest.raises(ValueError, match="HOST:PORT"):
        sharding.initialize_distributed("localhost", 2, 0)
    with pytest.raises(ValueError, match="both num_processes and process_id"):
        sharding.initialize_distributed("localhost:1234", 2, None)
    with pytest.raises(ValueError, match=r"process_id must be in \[0, 2\)"):
        sharding.initialize_distributed("localhost:1234", 2, 2)


def _flash_bytes_by_hand(tensor: int) -> tuple[int, int]:
    """v4-flash (bf16) per-device parameter and state bytes for mesh (1, tensor, 1), batch 16,
    context 65536, written out from the architecture (reference doc), not from the code."""
    V, d, H, c, q, g, do = 129280, 4096, 64, 512, 1024, 8, 1024
    HI, cI, E, k, I, hc = 64, 128, 256, 6, 2048, 4
    bf16, f32 = 2, 4
    t = tensor
    hyper = (hc * d * (2 + hc) * hc + (2 + hc) * hc + 3) * f32
    attn = (d * q * bf16 + q * f32 + q * H * c * bf16 // t + d * c * bf16 + c * f32
            + H * c * do * bf16 // t + g * do * d * bf16 // t + H * f32 // t)
    csa_comp = 2 * d * 2 * c * f32 + 4 * 2 * c * f32 + c * f32
    indexer = q * HI * cI * bf16 + d * HI * f32 + 2 * d * 2 * cI * f32 + 4 * 2 * cI * f32 + cI * f32
    hca_comp = 2 * d * c * f32 + 128 * c * f32 + c * f32
    moe = d * E * bf16 + 3 * E * d * I * bf16 // t + 3 * d * I * bf16 // t
    block = 2 * d * f32 + 2 * hyper + attn + moe

    def layer(i, kind):
        extra = {"sliding": 0, "csa": csa_comp + indexer, "hca": hca_comp}[kind]
        routing = V * k * 4 if i < 3 else E * f32  # tid2eid (int32) on the 3 hash layers, else gate bias
        return block + extra + routing

    kinds = ["sliding", "sliding"] + ["csa", "hca"] * 20 + ["csa"]
    hc_head = (hc * d * hc + hc + 1) * f32
    params = 2 * V * d * bf16 // t + d * f32 + hc_head + sum(layer(i, kind) for i, kind in enumerate(kinds))
    params += 2 * d * d * bf16 + 2 * d * f32 + block + E * f32 + hc_head + d * f32  # MTP: inputs, block, head
    B, L, W = 16, 65536, 128
    swa = B * W * c * bf16
    csa = swa + B * (L // 4) * c * bf16 + 2 * B * 8 * 2 * c * f32 + B * (L // 4) * cI * f32 + 2 * B * 8 * 2 * cI * f32
    hca = swa + B * (L // 128) * c * bf16 + 2 * B * 128 * c * f32
    # + the MTP draft's ring, the target streams it pairs the next row with, and both lengths
    state = 2 * swa + 21 * csa + 20 * hca + swa + B * hc * d * bf16 + 2 * B * 4
    return params, state


def test_memory_plan_matches_hand_calculation():
    cfg = js.ModelConfig.preset("v4-flash")
    plan = js.memory_plan(cfg, (1, 8, 1), batch=16, context=65536)
    params, state = _flash_bytes_by_hand(8)
    assert (plan.param_bytes, plan.state_bytes) == (params, state)
    assert plan.total_param_bytes == _flash_bytes_by_hand(1)[0]
    assert plan.bytes_per_device < 141 * 10**9  # fits an H200
    dp = js.memory_plan(cfg, (8, 1, 1), batch=16, context=65536)
    assert dp.param_bytes == plan.total_param_bytes and dp.state_bytes * 8 == state
    assert js.memory_plan(cfg, (8, 1, 1), batch=3, context=1024).batch == 8  # padded to the data axis
    with pytest.raises(ValueError, match="context must be"):
        js.memory_plan(cfg, (1, 8, 1), batch=1, context=cfg.max_position_embeddings + 1)


def test_plan_cli(capsys):
    assert main(["plan", "--preset", "v4-flash", "--devices", "8", "--batch", "16", "--context", "65536",
                 "--weights", "plain"]) == 0
    out = capsys.readouterr().out
    params, state = _flash_bytes_by_hand(8)
    assert f"parameters per device: {params:,} bytes" in out
    assert f"decode state per device: {state:,} bytes" in out
    assert "tensor=8" in out
    with pytest.raises(SystemExit, match="spans 4 devices"):
        main(["plan", "--devices", "8", "--mesh", "1,4,1"])
