"""On a CUDA device only (marker `gpu`; conftest skips these elsewhere, scripts/gpu_check.sh runs them on
an H200): the Pallas kernels compiled by Triton (`interpret=False`, never the interpreter the CPU tests
use) against the jnp paths, at V4-Flash widths (64 heads x 512, window 128, CSA 4 / HCA 128, top-512);
and greedy speculative decoding with the Pallas attention in bfloat16 token-identical to `generate`.

The jnp references run with float32 matmuls at full precision (`jax.default_matmul_precision`): XLA
would otherwise use TF32 on the GPU while the kernels' float32 dots are IEEE (`exact_dot_precision`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_grouped_experts import CFG as EXPERTS_CFG
from test_grouped_experts import _experts, _inputs
from test_pallas import _attention_inputs, _rel_err

import jaxspec as js
from jaxspec.layers import moe
from jaxspec.layers.attention import attend
from jaxspec.ops.pallas.chain_compress import chain_compress
from jaxspec.ops.pallas.grouped_matmul import grouped_matmul
from jaxspec.ops.pallas.sinkhorn import sinkhorn_kernel, sinkhorn_reference
from jaxspec.ops.pallas.tree_attention import tree_attention
from jaxspec.ops.pooling import pool_rows
from jaxspec.ops.rope import inv_freq
from jaxspec.speculation.plan import build_plan
from jaxspec.testing import high_acceptance, randomize

pytestmark = pytest.mark.gpu

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
FLASH = js.ModelConfig.preset("v4-flash")


def exact(fn, *args):
    """fn(*args) jitted with float32 matmuls at full precision: the reference side."""
    with jax.default_matmul_precision("float32"):
        return jax.jit(fn)(*args)


# Committed lengths 5, 200, 2600: under one window, past it, past 2048 tokens (CSA entries beyond
# top-512). Trees and chunked-prefill chains; window only, every HCA entry, the indexer's top-512.
ATTENTION = [(jnp.float32, "none", True), (jnp.float32, "dense", False), (jnp.float32, "sparse", True),
             (jnp.bfloat16, "none", False), (jnp.bfloat16, "dense", True), (jnp.bfloat16, "sparse", False)]


@pytest.mark.parametrize("dtype,mode,chain", ATTENTION)
def test_tree_attention_compiled_equals_jnp(dtype, mode, chain):
    w, ratio = FLASH.sliding_window, FLASH.csa_ratio
    args, kw = _attention_inputs(7, mode, 16 if chain else 9, FLASH.num_heads, FLASH.head_dim, dtype, chain=chain,
                                 window=w, lc=700, topk=FLASH.index_topk, ratio=ratio, committed=(5, 200, 2600))
    want = exact(lambda *a: attend(*a, **kw), *args)
    got = jax.jit(lambda *a: tree_attention(*a, **kw, interpret=False))(*args)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert _rel_err(got, want) <= TOL[dtype]


# (ratio, overlap, width): CSA main, CSA indexer, HCA
COMPRESS = {"csa": (4, True, FLASH.head_dim), "csa-indexer": (4, True, FLASH.index_head_dim),
            "hca": (FLASH.hca_ratio, False, FLASH.head_dim)}


@pytest.mark.parametrize("name", list(COMPRESS))
def test_chain_compress_compiled_equals_jnp(name):
    ratio, overlap, width = COMPRESS[name]
    coff, t = (2 if overlap else 1), 9
    committed = jnp.asarray([1, ratio, 3 * ratio - 2], jnp.int32)  # before, on and across a block boundary
    parents = jnp.asarray([[0, 0, 1, 1, 2, 3, 4, 5, 6], [0, 0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 1, 2, 2, 5, 6, 6]])
    plan = build_plan(parents, committed, 8)
    keys = jax.random.split(jax.random.key(len(name)), 5)
    b = committed.shape[0]
    rows = [jax.random.normal(k, (b, coff * ratio if i < 2 else t, coff * width)) for i, k in enumerate(keys[:4])]
    norm = 1.0 + 0.1 * jax.random.normal(keys[4], (width,))
    args = (*rows, plan.positions, committed, plan.ancestor_at_depth, norm, inv_freq(FLASH, True))
    kw = dict(ratio=ratio, overlap=overlap, eps=FLASH.rms_norm_eps)
    want = np.array(exact(lambda *a: pool_rows(*a, **kw), *args))
    got = np.asarray(jax.jit(lambda *a: chain_compress(*a, **kw, interpret=False))(*args))
    emits = np.asarray((plan.positions + 1) % ratio == 0)
    assert emits.any() and not emits.all()
    assert _rel_err(got[emits], want[emits]) <= 1e-5
    assert not got[~emits].any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_matmul_compiled_equals_ragged_dot(dtype):
    rng = np.random.default_rng(3)
    sizes = jnp.asarray([0, 17, 0, 230, 1, 0, 52, 0], jnp.int32)  # empty groups, one row, ragged tiles
    x = jnp.asarray(rng.standard_normal((int(sizes.sum()), 512)), dtype)
    w = jnp.asarray(rng.standard_normal((8, 512, 256)) / 20, dtype)
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes)])
    got = jax.jit(lambda *a: grouped_matmul(*a, interpret=False))(x, w, offsets)
    want = exact(lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32), x, w)
    assert _rel_err(got, want) <= (1e-5 if dtype == jnp.float32 else 1e-3)


@pytest.mark.parametrize("fmt", ["plain", "fp8", "fp8_e8m0", "fp4"])
def test_kernel_experts_compiled_equal_dense_experts(fmt):
    experts = _experts(fmt)
    x, idx, w = _inputs(300, seed=5)
    want = exact(lambda *a: moe.dense_experts(experts, EXPERTS_CFG, *a), x, idx, w)
    got = jax.jit(lambda *a: moe.kernel_experts(experts, EXPERTS_CFG, *a, interpret=False))(x, idx, w)
    assert _rel_err(got, want) <= 1e-5, fmt


@pytest.mark.parametrize("tokens", [1, 300, 5000])
def test_sinkhorn_compiled_equals_the_loop(tokens):
    comb = jax.nn.softmax(jax.random.normal(jax.random.key(tokens), (tokens, 4, 4)), axis=-1) + 1e-6
    want = jax.jit(lambda c: sinkhorn_reference(c, 19, 1e-6))(comb)
    got = jax.jit(lambda c: sinkhorn_kernel(c, 19, 1e-6, interpret=False))(comb)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def bf16_pallas():
    """`tiny` (window 32, CSA 4, HCA 16, head_dim 64) in bfloat16 with the Pallas attention, params
    whose MTP draft agrees often (trees get accepted, partially and fully)."""
    cfg = js.ModelConfig.preset("tiny").replace(dtype="bfloat16", kernels="pallas")
    key = jax.random.key(0)
    return cfg, high_acceptance(randomize(js.init_params(cfg, key), jax.random.fold_in(key, 1)))


NEAR_TIE = 2.0**-6  # top-2 logit gap / max |logit| below which bfloat16 cannot be trusted to decide


def float32_margin(params, cfg, prefix) -> float:
    """Top-2 gap of the next-token logits after `prefix`, relative to their largest magnitude, computed
    by the float32 twin of the bf16 params with the XLA attention."""
    cfg32 = cfg.replace(dtype="float32", kernels="xla")
    params32 = jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    logits = np.asarray(js.prefill_logits(params32, cfg32, jnp.asarray([prefix], jnp.int32)))[0, -1]
    top = np.sort(logits)
    return float((top[-1] - top[-2]) / np.abs(logits).max())


@pytest.mark.parametrize("spec", ["s3_k1_d4", "s3_k2_d6"])  # a chain and a K = 2 tree
def test_greedy_speculative_equals_generate_pallas_bf16(bf16_pallas, spec):
    """Token for token, until a row reaches a near tie: bf16 rounds a verify of several nodes and a
    one-token decode step differently (other tile shapes), which may flip an argmax whose float32 gap
    is within bf16's noise; such a flip is allowed only there. On these near-uniform params ~5% of
    positions are near ties; at least a third of the tokens must be compared."""
    cfg, params = bf16_pallas
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 31, 70, 150)]  # ragged, past the window
    ref = js.generate(params, cfg, prompts, max_new_tokens=48)
    out = js.speculative_generate(params, cfg, prompts, spec, max_new_tokens=48)
    assert out.stats["mean_accepted_length"] > 1.05, out.stats  # drafts were accepted, not only bonuses
    compared = 0
    for row, prompt in enumerate(prompts):
        differ = np.flatnonzero(out.tokens[row] != ref.tokens[row])
        if differ.size == 0:
            np.testing.assert_array_equal(out.lengths[row], ref.lengths[row])
            compared += ref.tokens.shape[1]
            continue
        j = int(differ[0])
        margin = float32_margin(params, cfg, prompt + ref.tokens[row, :j].tolist())
        assert margin < NEAR_TIE, f"row {row} departs at token {j} where the float32 gap is {margin:.4f}"
        compared += j
    assert compared >= ref.tokens.size / 3, compared
