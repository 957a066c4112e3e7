"""The GPU program, lowered for CUDA on this CPU (`jaxspec.core.gpu_export`) and inspected: the Pallas kernels
at V4-Flash shapes, the greedy and sampling speculative cycle with attention "pallas". The text must
hold the Triton kernels (tree attention, chain compression, the routed experts' grouped matmul)
and no XLA matmul over a whole routed-expert stack (the dense rewrite). One process lowers for CPU
too: there the interpreter and the dense / gathered experts remain.

Marked `gpu_lowering`; `scripts/test_jax012.sh` runs this file again under jax 0.12 (.venv312).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxspec as js
from jaxspec.core.dspark import DSparkConfig
from jaxspec.core.gpu_export import TRITON_CALL, expert_stack_dots, export_for_cuda, kernel_calls
from jaxspec.layers import moe
from jaxspec.model import network
from jaxspec.model import state as state_lib
from jaxspec.model.dspark import abstract_dspark_params
from jaxspec.model.network import Models
from jaxspec.model.sampling import Sampling
from jaxspec.ops.pallas import chain_compress, tree_attention
from jaxspec.ops.pallas.grouped_matmul import grouped_matmul
from jaxspec.ops.quant import abstract_block_scaled
from jaxspec.speculation.cycle import Speculator, prefill, speculative_cycle
from jaxspec.speculation.dspark import DSparkDrafter
from jaxspec.testing import mtp_models, mtp_prefill, mtp_speculator

pytestmark = pytest.mark.gpu_lowering
S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
FLASH = js.ModelConfig.preset("v4-flash")


def _attention_args(b=1, t=8, lc=2048, k=512):
    h, c = FLASH.num_heads, FLASH.head_dim  # 64 heads, 512 channels
    return dict(q=S((b, t, h, c), BF16), window_kv=S((b, FLASH.sliding_window, c), BF16),
                window_pos=S((b, FLASH.sliding_window), I32), new_kv=S((b, t, c), BF16),
                new_mask=S((b, t, t), jnp.bool_), positions=S((b, t), I32), sink=S((h,), F32),
                comp=S((b, lc, c), BF16), comp_len=S((b,), I32), comp_index=S((b, t, k), I32),
                entries=S((b, t, c), BF16), entry_mask=S((b, t, t), jnp.bool_))


@pytest.mark.parametrize("mode", ["none", "dense", "sparse"])
def test_tree_attention_at_v4_flash_shapes_lowers_to_triton(mode):
    a = _attention_args()
    base = (a["q"], a["window_kv"], a["window_pos"], a["new_kv"], a["new_mask"], a["positions"], a["sink"])
    kw = dict(window=FLASH.sliding_window, scale=FLASH.head_dim ** -0.5)

    def fn(*args):
        extra = {}
        if mode == "dense":  # HCA: every committed entry
            extra = dict(comp_kv=args[7], comp_len=args[8])
        elif mode == "sparse":  # CSA: the node's top-512 entries, plus the branch-local ones
            extra = dict(comp_kv=args[7], comp_index=args[8], tree_entries=args[9], tree_entry_mask=args[10])
        return tree_attention(*args[:7], **kw, **extra)

    more = {"none": (), "dense": (a["comp"], a["comp_len"]),
            "sparse": (a["comp"], a["comp_index"], a["entries"], a["entry_mask"])}[mode]
    text = export_for_cuda(fn, *base, *more)
    assert kernel_calls(text) == {f"tree_attention_{mode}": 1}
    # The same function lowered for this CPU runs the interpreter: no Triton call.
    assert TRITON_CALL not in jax.jit(fn).lower(*base, *more).as_text()


@pytest.mark.parametrize("ratio,overlap,width", [(4, True, 512), (4, True, 128), (128, False, 512)])
def test_chain_compress_at_v4_flash_shapes_lowers_to_triton(ratio, overlap, width):
    b, t, coff = 1, 8, 2 if overlap else 1
    ring = S((b, coff * ratio, coff * width), F32)
    new = S((b, t, coff * width), F32)
    args = (ring, ring, new, new, S((b, t), I32), S((b,), I32), S((b, t, t), I32), S((width,), F32),
            S((FLASH.rope_head_dim // 2,), F32))
    text = export_for_cuda(lambda *a: chain_compress(*a, ratio=ratio, overlap=overlap, eps=1e-6), *args)
    assert kernel_calls(text) == {"chain_compress": 1}


@pytest.mark.parametrize("fmt", ["plain", "fp8", "fp4"])
def test_grouped_matmul_at_v4_flash_expert_shapes_lowers_to_triton(fmt):
    e, d, i = FLASH.n_routed_experts, FLASH.hidden_size, FLASH.moe_intermediate_size
    rows = 8 * 6 * FLASH.num_experts_per_tok  # batch 8, 6 tree nodes
    if fmt == "plain":
        w = S((e, d, i), BF16)
    else:
        block, scale = ((1, 128, 128), jnp.float32) if fmt == "fp8" else ((1, 32, 1), jnp.float8_e8m0fnu)
        w = abstract_block_scaled((e, d, i), BF16, block, fmt, scale)
    text = export_for_cuda(lambda x, w, off: grouped_matmul(x, w, off), S((rows, d), BF16), w, S((e + 1,), I32))
    assert kernel_calls(text) == {f"grouped_matmul_{fmt}": 1}
    assert not expert_stack_dots(text, e, d, i)


def _cycle_args(cfg, batch, spec, sampling):
    """(speculator, models, state, sampling, active) of one cycle of the MTP draft, abstract; sampled
    children under the block rule (the default at T > 0) when `sampling`, else the greedy walk."""
    params = jax.eval_shape(lambda: js.init_params(cfg, jax.random.key(0)))
    tokens, lengths = S((batch, 16), I32), S((batch,), I32)
    state = jax.eval_shape(lambda p, t, n: mtp_prefill(p, cfg, t, n, 256, spec=spec), params, tokens, lengths)
    settings = jax.eval_shape(lambda: Sampling.create(0.7 if sampling else 0.0, top_k=20 if sampling else None))
    sp = mtp_speculator(cfg, spec, "block" if sampling else "greedy")
    return (sp, mtp_models(params), state, settings, S((batch,), jnp.bool_))


def _check_cycle(cfg, batch, spec="s3_k2_d6", sampling=False):
    args = _cycle_args(cfg, batch, spec, sampling)
    text = export_for_cuda(speculative_cycle, *args, static_argnums=(0,))
    calls = kernel_calls(text)
    assert any(n.startswith("tree_attention_") for n in calls), calls
    assert calls["chain_compress"] > 0, calls
    assert calls["grouped_matmul_plain"] > 0, calls  # on CUDA the routed experts always take the kernel
    e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert not expert_stack_dots(text, e, d, i)
    assert "ragged_dot" not in text
    return calls


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_cycle_of_tiny_for_cuda_holds_the_kernels(batch):
    _check_cycle(js.ModelConfig.preset("tiny").replace(kernels="pallas"), batch)


@pytest.mark.parametrize("spec", ["s4_k2_d8"])
def test_dspark_tree_cycle_of_tiny_for_cuda_holds_the_kernels(spec):
    """A DSpark tree cycle (the drafter's block pass and Markov-conditioned beam included) lowered for CUDA:
    the target's kernels, the routed experts of the drafter's stage through the grouped kernel too (no
    dense expert stack anywhere)."""
    cfg = js.ModelConfig.preset("tiny").replace(kernels="pallas", num_mtp_layers=0)
    dcfg = DSparkConfig(block_size=8, noise_token_id=cfg.vocab_size - 1, target_layers=(3, 4, 5), markov_rank=64,
                        num_stages=1)
    params = jax.eval_shape(lambda: js.init_params(cfg, jax.random.key(0)))
    models = Models(target=params, drafter=abstract_dspark_params(cfg, dcfg))
    sp = Speculator(cfg, js.SpecConfig.parse(spec), DSparkDrafter(dcfg))
    settings = jax.eval_shape(Sampling.create)
    state = jax.eval_shape(lambda m, t, n, g: prefill(sp, m, t, n, 256, g), models, S((8, 16), I32), S((8,), I32),
                           settings)
    text = export_for_cuda(speculative_cycle, sp, models, state, settings, S((8,), jnp.bool_), static_argnums=(0,))
    calls = kernel_calls(text)
    assert any(n.startswith("tree_attention_") for n in calls), calls
    assert calls["grouped_matmul_plain"] > 0, calls
    assert not expert_stack_dots(text, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)


def test_the_kernel_switch_picks_the_experts_path_as_every_kernels():
    """kernels="xla": the jnp path on every platform (the blocked path at 8 tokens x 2 experts of 8: a
    loop over row blocks with one switch over the experts, three dots per expert, no dot over the whole
    expert stack; no Triton call, for CPU or for CUDA).
    kernels="pallas": the grouped kernel, compiled for CUDA, the interpreter for CPU."""
    cfg = js.ModelConfig.preset("tiny")
    e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    experts = moe.MLPParams(w1=S((e, d, i), F32), w3=S((e, d, i), F32), w2=S((e, i, d), F32))
    args = (experts, S((8, d), F32), S((8, 2), I32), S((8, 2), F32))

    def under(kernels):
        return lambda ex, x, idx, w: moe.sparse_experts(ex, cfg.replace(kernels=kernels), x, idx, w)

    for text in (jax.jit(under("xla")).lower(*args).as_text(), export_for_cuda(under("xla"), *args)):
        assert TRITON_CALL not in text and not expert_stack_dots(text, e, d, i)
        assert "stablehlo.while" in text and "stablehlo.case" in text and text.count("stablehlo.dot_general") >= 3 * e
    cuda = export_for_cuda(under("pallas"), *args)
    assert kernel_calls(cuda) == {"grouped_matmul_plain": 3} and not expert_stack_dots(cuda, e, d, i)
    cpu = jax.jit(under("pallas")).lower(*args).as_text()
    assert TRITON_CALL not in cpu and not expert_stack_dots(cpu, e, d, i)  # the interpreted kernel


@pytest.mark.long
@pytest.mark.parametrize("batch", [1, 8])
def test_sampling_cycle_of_tiny_for_cuda_holds_the_kernels(batch):
    _check_cycle(js.ModelConfig.preset("tiny").replace(kernels="pallas"), batch, sampling=True)


@pytest.mark.long
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("sampling", [False, True])
def test_cycle_of_a_two_layer_v4_flash_for_cuda_holds_the_kernels(batch, sampling):
    cfg = FLASH.replace(num_layers=2, layer_types=("csa", "hca"), num_hash_layers=1, kernels="pallas")
    calls = _check_cycle(cfg, batch, sampling=sampling)
    assert {"tree_attention_sparse", "tree_attention_dense"} <= set(calls)


def test_sharded_cycle_on_8_devices_for_cuda_holds_the_kernels(tmp_path):
    """(1, 8, 1): tensor-parallel attention and expert hidden width; (1, 1, 8): one expert per device
    (expert parallel, `sharding.active.routed_experts`). In a subprocess with 8 CPU devices."""
    out = tmp_path / "lowering.json"
    worker = os.path.join(os.path.dirname(__file__), "gpu_lowering_worker.py")
    proc = subprocess.run([sys.executable, worker, str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for mesh in ("1,8,1", "1,1,8"):
        r = result[mesh]
        assert "error" not in r, (mesh, r)
        assert r["devices"] == 8
        assert r["kernels"].get("grouped_matmul_plain", 0) > 0 and r["kernels"].get("chain_compress", 0) > 0, r
        assert any(k.startswith("tree_attention_") for k in r["kernels"]), r
        assert not r["dense_expert_dots"], (mesh, r["dense_expert_dots"])


@pytest.mark.gpu_lowering
def test_sinkhorn_lowers_to_one_triton_kernel_for_cuda():
    from jaxspec.ops.pallas.sinkhorn import sinkhorn

    text = export_for_cuda(lambda c: sinkhorn(c, 19, 1e-6), jax.ShapeDtypeStruct((8, 4, 4), jnp.float32))
    assert kernel_calls(text) == {"sinkhorn": 1} and "stablehlo.while" not in text


def _v41_flash_widths():
    """V4.1-Flash's widths (d 5120, 64 heads of 512, 384 experts top-6 of 2304, 32 index heads, window
    128) on the 8-layer layout of `v41-test` (every role; Engram's small tables), kernels "pallas"."""
    flash, test = js.ModelConfig.preset("v41-flash"), js.ModelConfig.preset("v41-test")
    return flash.replace(num_layers=8, layer_types=test.layer_types, v41=test.v41, kernels="pallas")


@pytest.mark.parametrize("t", [1, 8])  # a decode step; a chunk of 8 (a chain verify's shape)
def test_v41_step_for_cuda_holds_the_kernels(t):
    cfg = _v41_flash_widths()
    params = jax.eval_shape(lambda: js.init_params(cfg, jax.random.key(0)))
    state = jax.eval_shape(lambda: state_lib.init_state(cfg, 1, 1024))

    def step(params, state, tokens):
        out, state = network.extend(params, cfg, state, tokens, jnp.ones(tokens.shape, bool))
        return out.logits, state

    text = export_for_cuda(step, params, state, S((1, t), I32))
    calls = kernel_calls(text)
    # attention over the window and the shared pools (window-only layers: "none"; pooled: "sparse")
    assert {"tree_attention_none", "tree_attention_sparse"} <= set(calls), calls
    assert calls["grouped_matmul_plain"] == 3 * cfg.num_layers, calls  # w1, w3, w2 of every layer's experts
    assert calls["sinkhorn"] == 2 * cfg.num_layers, calls
    assert not expert_stack_dots(text, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)


def test_v41_dspark_tree_cycle_for_cuda_holds_the_kernels():
    """A V4.1 DSpark tree cycle (v41-test: every role, Engram; its own drafter, 2 stages with their own
    4-expert MoE) lowered for CUDA: the verify's tree attention over the window ("none", layers 0-1) and the
    shared pools ("sparse", layers 2-7), the grouped matmul for the target's and the stages' experts, the
    Sinkhorn kernel per sub-layer, no dense expert stack. The ratio-2 pair and ratio-1 rows pool as jnp ops,
    and a stage's block attention (its ring and 5 block keys) is jnp too (docs/v41.md)."""
    cfg = js.ModelConfig.preset("v41-test", kernels="pallas")
    dcfg = DSparkConfig(block_size=5, noise_token_id=cfg.vocab_size - 1, target_layers=(5, 6, 7),
                        markov_rank=cfg.hidden_size, num_stages=2, n_routed_experts=4, num_experts_per_tok=2)
    params = jax.eval_shape(lambda: js.init_params(cfg, jax.random.key(0)))
    models = Models(target=params, drafter=abstract_dspark_params(cfg, dcfg))
    sp = Speculator(cfg, js.SpecConfig.parse("s4_k2_d8"), DSparkDrafter(dcfg))
    settings = jax.eval_shape(Sampling.create)
    state = jax.eval_shape(lambda m, t, n, g: prefill(sp, m, t, n, 256, g), models, S((2, 16), I32), S((2,), I32),
                           settings)
    text = export_for_cuda(speculative_cycle, sp, models, state, settings, S((2,), jnp.bool_), static_argnums=(0,))
    calls = kernel_calls(text)
    assert {"tree_attention_none", "tree_attention_sparse"} <= set(calls), calls
    assert calls["tree_attention_none"] == 2 and calls["tree_attention_sparse"] == 6, calls
    # w1, w3, w2 of every target layer's experts in the verify, and of both stages' in the draft
    assert calls["grouped_matmul_plain"] == 3 * (cfg.num_layers + dcfg.num_stages), calls
    assert calls["sinkhorn"] == 2 * (cfg.num_layers + dcfg.num_stages), calls
    for experts in (cfg.n_routed_experts, dcfg.n_routed_experts):
        assert not expert_stack_dots(text, experts, cfg.hidden_size, cfg.moe_intermediate_size)
