"""Weights kept FP8 / FP4 (`weights="fp8"`): block-scaled leaves dequantized inside the matmuls.

The reference for the model is the same checkpoint loaded the default way (dequantized once, in
numpy); the reference for the block math is `jaxspec.checkpoint.quant.dequantize` in the release's
[out, in] orientation. The memory plan is checked against bytes written out from the architecture.
"""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from official_layout import QUANT_CONFIG, officialize, read_plain, write_folder

import jaxspec as js
import jaxspec.testing
from jaxspec.checkpoint import load_hf_checkpoint, save_checkpoint, save_hf_checkpoint
from jaxspec.checkpoint.keys import key_table
from jaxspec.checkpoint.quant import dequantize as np_dequantize
from jaxspec.cli import main
from jaxspec.cost.xla import _live_scopes
from jaxspec.model.network import abstract_params
from jaxspec.ops import quant
from jaxspec.ops.quant import BlockScaled
from jaxspec.sharding.rules import map_declared

CFG = js.ModelConfig.preset("test")  # float32
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, size=(2, 40)), jnp.int32)


def _leaves(params):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=quant.is_quantized)[0]}


def _params(cfg, seed=0):
    """Random params of cfg's structure from numpy (norms near 1, matrices ~0.1, valid hash tables):
    built in milliseconds, where an eager init_params takes seconds."""
    rng = np.random.default_rng(seed)
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]:
        if jnp.issubdtype(x.dtype, jnp.floating):
            noise = rng.standard_normal(x.shape).astype(np.float32)
            out.append(jnp.asarray((1 + 0.1 * noise) if "norm" in jax.tree_util.keystr(path) else 0.1 * noise, x.dtype))
        else:
            out.append(jnp.asarray(np.argsort(rng.random((x.shape[0], cfg.n_routed_experts)), axis=-1)[:, : x.shape[1]],
                                   x.dtype))
    return jax.tree_util.tree_unflatten(jax.tree.structure(abstract_params(cfg)), out)


def _np_dequantize(w: BlockScaled) -> np.ndarray:
    """numpy reference in our orientation: FP4 bytes unpacked along `in` (low nibble = even row)
    through ml_dtypes' e2m1, times each element's block scale."""
    data = np.asarray(w.data)
    if w.fmt == "fp4":
        nibbles = np.stack([data & 0xF, data >> 4], axis=-2).reshape(w.shape)
        values = nibbles.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    else:
        values = data.astype(np.float32)
    scale = np.asarray(w.scale).astype(np.float32)
    for axis, b in enumerate(w.block):
        scale = np.repeat(scale, b, axis=axis).take(np.arange(w.shape[axis]), axis=axis)
    return values * scale


def _load_both(path):
    """-> (params dequantized at load, params with FP8 / FP4 leaves kept)."""
    _, plain = load_hf_checkpoint(path, dtype="float32")
    _, stored = load_hf_checkpoint(path, dtype="float32", weights="fp8")
    return plain, stored


def _release(root, cfg, params, formats=("fp4", "fp8")):
    """params written as DeepSeek's release stores them by the tests' own quantizer and writer
    (tests/official_layout.py, not jaxspec's): root/"fp4" the instruct layout (FP4 experts), root/"fp8"
    the Base one (FP8 experts with float32 scales); root/"plain" the F32 export they come from."""
    save_hf_checkpoint(root / "plain", cfg, params)  # official spelling, F32 / I64
    tensors = read_plain(str(root / "plain"))
    config = json.loads((root / "plain" / "config.json").read_text())
    for fmt in formats:
        stored, _ = officialize(tensors, fmt)
        write_folder(str(root / fmt), dict(config, quantization_config=QUANT_CONFIG, torch_dtype="bfloat16"),
                     stored, shards=2)
    return root


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """Random params of the test preset (4 layers: sliding, csa, hca, csa; MTP) in both release layouts."""
    return _release(tmp_path_factory.mktemp("fp8w"), CFG, _params(CFG))


# two layers (sliding, csa: attention, indexer, hash-routed and learned-routed experts, shared expert, MTP)
# keep the generate / speculative_generate compiles short
SMALL = CFG.replace(num_layers=2, layer_types=("sliding", "csa"))


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    """The small config's params with a draft that agrees with the target, in the instruct layout."""
    return _release(tmp_path_factory.mktemp("fp8w_small"), SMALL, js.testing.high_acceptance(_params(SMALL, seed=1)),
                    formats=("fp4",))


# ---- the block math, ragged edges ------------------------------------------------------------------
def _random_release_weight(rng, out, inp, fmt):
    """A weight as the release stores it ([out, in]): random codes and power-of-two scales."""
    if fmt == "fp4":
        q = rng.integers(0, 256, size=(out, inp // 2), dtype=np.uint8)
        scale = np.exp2(rng.integers(-4, 3, size=(out, -(-inp // 32)))).astype(ml_dtypes.float8_e8m0fnu)
        return q, scale, (1, 32)
    q = rng.uniform(-448, 448, size=(out, inp)).astype(ml_dtypes.float8_e4m3fn)
    scale = np.exp2(rng.integers(-12, -4, size=(-(-out // 128), -(-inp // 128)))).astype(ml_dtypes.float8_e8m0fnu)
    return q, scale, (128, 128)


@pytest.mark.parametrize("fmt, out, inp", [("fp8", 200, 300), ("fp8", 130, 257), ("fp4", 50, 80)])
def test_matmul_with_a_block_scaled_weight_equals_dequantize_then_dot(fmt, out, inp):
    """Shapes that are no multiple of the block: the edge blocks are cut (300 = 2 x 128 + 44, 80 =
    2 x 32 + 16); our leaf is the release's tensor transposed (FP4 bytes too: packed along `in`)."""
    rng = np.random.default_rng(1)
    q, scale, block = _random_release_weight(rng, out, inp, fmt)
    reference = np_dequantize(q, scale, block).T  # [in, out] float32
    w = BlockScaled(data=jnp.asarray(q.T), scale=jnp.asarray(scale.T), block=block[::-1], dtype="float32")
    assert w.shape == (inp, out) and w.fmt == fmt
    np.testing.assert_array_equal(np.asarray(quant.dequantize(w)), reference)
    x = jnp.asarray(rng.standard_normal((3, inp)), jnp.float32)
    got = np.asarray(jax.jit(quant.matmul)(x, w))
    np.testing.assert_allclose(got, np.asarray(x) @ reference, rtol=1e-5, atol=1e-5 * np.abs(got).max())
    # a stack of two (experts): slice 1 is -w (FP4: both nibbles' sign bits flipped) or 2w (FP8: scales doubled)
    if fmt == "fp4":
        data, scale, factor = jnp.stack([w.data, w.data ^ 0x88]), jnp.stack([w.scale, w.scale]), -1.0
    else:
        data, scale, factor = jnp.stack([w.data, w.data]), jnp.stack([w.scale, (2 * w.scale.astype(jnp.float32))
                                                                          .astype(w.scale.dtype)]), 2.0
    stack = BlockScaled(data=data, scale=scale, block=(1, *w.block), dtype="float32")
    picked = quant.take(stack, jnp.asarray([1, 0, 1]))  # gathered still quantized, dequantized after
    assert picked.data.shape[0] == 3 and picked.scale.shape[0] == 3
    whole = np.asarray(quant.dequantize(stack))
    np.testing.assert_array_equal(np.asarray(quant.dequantize(picked)), whole[[1, 0, 1]])
    np.testing.assert_array_equal(whole[1], factor * reference)


def test_plain_weights_pass_through_unchanged():
    w = jnp.arange(6.0).reshape(2, 3)
    assert quant.dequantize(w) is w and quant.take(w, jnp.asarray([1]))[0].tolist() == [3.0, 4.0, 5.0]
    jaxpr = jax.make_jaxpr(lambda x, w: quant.matmul(x, w))(jnp.ones((1, 2)), w)
    assert [e.primitive.name for e in jaxpr.eqns] == ["dot_general"]  # the plain path adds no op


# ---- the model -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_fp8_weights_logits_equal_the_dequantized_model(released, fmt):
    """Every kept leaf dequantizes bit-equal to the default load; the logits (FP4 experts: the
    instruct release) equal the dequantized model's. The Base layout differs only in its experts'
    float32 scales, so its forward (the same code) is not compiled a second time."""
    plain, stored = _load_both(released / fmt)
    leaves = _leaves(stored)
    kept = {k for k, x in leaves.items() if isinstance(x, BlockScaled)}
    # exactly the leaves the release stores quantized stay so, routed experts in the release's format
    assert ".layers[1].attn.wq_b" in kept and ".layers[1].attn.wo_a" in kept and ".mtp.inputs.e_proj" in kept
    assert ".layers[2].ffn.shared.w2" in kept and ".layers[1].attn.indexer.wq_b" in kept
    assert ".head" not in kept and ".layers[1].attn.compressor.wkv" not in kept and ".layers[1].ffn.gate" not in kept
    assert len(kept) == 4 * 11 + 2 + 11 + 2  # attn 5 + shared 3 + experts 3 per layer, 2 indexers, MTP block + 2
    experts = leaves[".layers[3].ffn.experts.w2"]
    assert (experts.fmt, experts.block) == ((fmt, (1, 32, 1)) if fmt == "fp4" else (fmt, (1, 128, 128)))
    assert experts.data.dtype == (jnp.uint8 if fmt == "fp4" else jnp.float8_e4m3fn)
    plain_leaves = _leaves(plain)
    for k in kept:
        np.testing.assert_array_equal(_np_dequantize(leaves[k]), np.asarray(plain_leaves[k]), err_msg=k)
    if fmt == "fp8":
        return
    ref = js.prefill_logits(plain, CFG, TOKENS)
    got = js.prefill_logits(stored, CFG, TOKENS)
    rel = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
    assert rel <= 1e-5


def test_greedy_speculative_equals_generate_with_fp8_weights(agreeing):
    cfg, params = load_hf_checkpoint(agreeing / "fp4", dtype="float32", weights="fp8")
    assert cfg.layer_types == SMALL.layer_types and cfg.has_mtp
    assert isinstance(params.layers[1].ffn.experts.w1, BlockScaled)
    assert isinstance(params.mtp.inputs.e_proj, BlockScaled)
    prompts = [[5, 17, 3, 9, 40, 2, 11], [8, 1, 60]]
    ref = js.generate(params, cfg, prompts, max_new_tokens=12)
    out = js.speculative_generate(params, cfg, prompts, "s2_k2_d4", max_new_tokens=12)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    assert out.stats["mean_accepted_length"] > 1.5  # the draft agrees: the trees are accepted deep


def test_release_blocks_that_span_wo_a_groups(tmp_path):
    """o_lora_rank 48 (wo_a's release rows j*48 + r; a 128-row block spans groups 2 and 3), q_lora 144
    and expert width 160 (ragged 128 blocks): every kept leaf dequantizes to the default load's."""
    cfg = CFG.replace(o_groups=4, o_lora_rank=48, q_lora_rank=144, moe_intermediate_size=160)
    _release(tmp_path, cfg, _params(cfg, seed=3))
    for fmt in ("fp4", "fp8"):
        plain, stored = _load_both(tmp_path / fmt)
        wo_a = stored.layers[0].attn.wo_a
        assert wo_a.block == (1, 128, 16) and wo_a.scale.shape == (4, 1, 3)
        plain_leaves = _leaves(plain)
        for k, x in _leaves(stored).items():
            ref = _np_dequantize(x) if isinstance(x, BlockScaled) else np.asarray(x)
            np.testing.assert_array_equal(ref, np.asarray(plain_leaves[k]), err_msg=k)


def test_writers_refuse_quantized_params_and_a_plain_folder_is_no_fp8_source(released, tmp_path):
    _, stored = load_hf_checkpoint(released / "fp4", dtype="float32", weights="fp8")
    with pytest.raises(ValueError, match="dequantize_params"):
        save_checkpoint(tmp_path / "x", CFG, stored)
    with pytest.raises(ValueError, match="weights must be one of"):
        load_hf_checkpoint(released / "fp4", weights="int4")
    with pytest.raises(ValueError, match="stores none of the quantizable weights quantized"):
        load_hf_checkpoint(released / "plain", weights="fp8")  # an F32 export: nothing to keep
    plain = jax.eval_shape(quant.dequantize_params, stored)  # the plain params of the config, float32
    assert jax.tree.structure(plain) == jax.tree.structure(abstract_params(CFG))
    assert {x.dtype for x in jax.tree.leaves(plain)} == {jnp.dtype("float32"), jnp.dtype("int32")}


def test_the_fields_quantization_tags_are_the_release_table():
    """What the layers declare beside their fields (`axes(..., quant=)`) is what the checkpoint name
    table says the release stores quantized, leaf by leaf."""
    tags = {}
    map_declared(abstract_params(CFG), lambda x, names, tag, path: tags.setdefault("." + path, tag))
    table = {}
    for spec in key_table(CFG).values():
        path = spec.ours.replace("[", ".").replace("]", "")
        table[path] = spec.quant
    assert set(tags) == set(table)
    expect = {None: None, "fp8": "fp8", "fp8_groups": "fp8", "expert": "expert"}
    assert {p: expect[t] for p, t in tags.items()} == table
    assert tags[".layers.1.attn.wo_a"] == "fp8_groups" and tags[".mtp.block.ffn.experts.w2"] == "expert"


# ---- bytes: the memory plan and the cost model -----------------------------------------------------
def _flash_fp8_params_by_hand(t: int, experts: str = "fp4") -> int:
    """v4-flash per-device parameter bytes on mesh (1, t, 1) with the release's storage, written out
    from the architecture: FP8 (1 byte) + one UE8M0 byte per 128 x 128 block for the attention,
    indexer-query, shared-expert and MTP projections; routed experts FP4 (half a byte) + one UE8M0
    byte per 32 inputs (instruct) or FP8 + a float32 per 128 x 128 block (Base); the rest as today."""
    V, d, H, c, q, g, do = 129280, 4096, 64, 512, 1024, 8, 1024
    HI, cI, E, k, I, hc = 64, 128, 256, 6, 2048, 4
    bf16, f32 = 2, 4

    def fp8(rows, cols, split=1, scale_bytes=1):
        return (rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128) * scale_bytes) // split

    if experts == "fp4":
        routed = 3 * E * (d * I // 2 + d * I // 32) // t
    else:
        routed = 3 * E * fp8(d, I, scale_bytes=4) // t
    hyper = (hc * d * (2 + hc) * hc + (2 + hc) * hc + 3) * f32
    attn = (fp8(d, q) + q * f32 + fp8(q, H * c, t) + fp8(d, c) + c * f32
            + fp8(H * c, do, t) + fp8(g * do, d, t) + H * f32 // t)
    csa_comp = 2 * d * 2 * c * f32 + 4 * 2 * c * f32 + c * f32
    indexer = fp8(q, HI * cI) + d * HI * f32 + 2 * d * 2 * cI * f32 + 4 * 2 * cI * f32 + cI * f32
    hca_comp = 2 * d * c * f32 + 128 * c * f32 + c * f32
    moe = d * E * bf16 + routed + 3 * fp8(d, I, t)
    block = 2 * d * f32 + 2 * hyper + attn + moe

    def layer(i, kind):
        extra = {"sliding": 0, "csa": csa_comp + indexer, "hca": hca_comp}[kind]
        return block + extra + (V * k * 4 if i < 3 else E * f32)

    kinds = ["sliding", "sliding"] + ["csa", "hca"] * 20 + ["csa"]
    hc_head = (hc * d * hc + hc + 1) * f32
    params = 2 * V * d * bf16 // t + d * f32 + hc_head + sum(layer(i, kind) for i, kind in enumerate(kinds))
    return params + 2 * fp8(d, d) + 2 * d * f32 + block + E * f32 + hc_head + d * f32  # MTP


def test_memory_plan_counts_the_stored_bytes():
    flash = js.ModelConfig.preset("v4-flash")
    bf16 = js.memory_plan(flash, (1, 8, 1), batch=16, context=65536)
    fp8 = js.memory_plan(flash, (1, 8, 1), batch=16, context=65536, weights="fp8")
    assert fp8.param_bytes == _flash_fp8_params_by_hand(8)
    assert fp8.total_param_bytes == _flash_fp8_params_by_hand(1)
    assert fp8.state_bytes == bf16.state_bytes and fp8.param_bytes < 0.3 * bf16.param_bytes
    base = js.memory_plan(flash, (1, 8, 1), batch=16, context=65536, weights="fp8", experts="fp8")
    assert base.param_bytes == _flash_fp8_params_by_hand(8, "fp8")




# ---- the command line ------------------------------------------------------------------------------
def _per_device(out: str, what: str) -> int:
    return int(re.search(rf"{what} per device: ([\d,]+) bytes", out).group(1).replace(",", ""))


def test_plan_cli_reports_the_stored_bytes(capsys):
    flash = js.ModelConfig.preset("v4-flash")
    got = {}
    for weights in ("plain", "fp8"):
        assert main(["plan", "--preset", "v4-flash", "--devices", "8", "--mesh", "1,8,1", "--weights", weights]) == 0
        out = " ".join(capsys.readouterr().out.split())
        got[weights] = _per_device(out, "parameters"), _per_device(out, "decode state")
    assert "routed experts FP4 as released" in out
    assert got["fp8"][0] == _flash_fp8_params_by_hand(8)
    assert got["plain"][0] == js.memory_plan(flash, (1, 8, 1), batch=16, context=65536).param_bytes
    assert got["fp8"][1] == got["plain"][1]  # the decode state does not depend on how weights are stored


def test_cost_cli_reads_the_quantized_weights_at_their_stored_bytes(capsys, tmp_path):
    """One AR step of the test preset (float32): same FLOPs, and at least every FP8 weight outside the
    routed experts (each read once per step) costs its stored bytes instead of 4 per element."""
    data = {}
    for weights in ("plain", "fp8"):
        path = tmp_path / f"{weights}.json"
        assert main(["cost", "--preset", "test", "--specs", "s2_k2_d4", "--batch-sizes", "1", "--context", "64",
                     "--weights", weights, "--json", str(path)]) == 0
        data[weights] = json.loads(path.read_text())
    capsys.readouterr()
    assert data["fp8"]["weights"] == "fp8" and data["fp8"]["experts"] == "fp4"
    stages = {w: {(r["spec"], k): v for r in d["rows"] for k, v in r["stages"].items()} for w, d in data.items()}
    ar_plain, ar_fp8 = stages["plain"][("ar", "ar")], stages["fp8"][("ar", "ar")]
    assert ar_fp8["flops"] == ar_plain["flops"]
    tags = {}
    map_declared(abstract_params(CFG), lambda x, names, tag, path: tags.setdefault("." + path, tag))
    stored = {k: x for k, x in _leaves(abstract_params(CFG, "fp8")).items() if isinstance(x, BlockScaled)}
    saved = sum(4 * math.prod(x.shape) - quant.stored_nbytes(x) for k, x in stored.items()
                if tags[k.replace("[", ".").replace("]", "")] != "expert" and not k.startswith(".mtp"))
    assert saved > 0 and ar_plain["bytes"] - ar_fp8["bytes"] >= saved
    assert all(0 < stages["fp8"][k]["bytes"] <= v["bytes"] for k, v in stages["plain"].items() if k[1] != "plan")


def test_weight_reads_whose_result_is_discarded_are_not_counted():
    """The commit stage runs the MTP block for its cache rows and drops the rest, which lowering
    removes: the stored-bytes count must drop those reads too (v4-flash commit: else -3.4 GB)."""
    rng = np.random.default_rng(2)
    q, scale, block = _random_release_weight(rng, 64, 96, "fp8")
    w = BlockScaled(data=jnp.asarray(q.T), scale=jnp.asarray(scale.T), block=block[::-1], dtype="float32")
    v = w.replace(data=w.data[:, :32], scale=w.scale[:, :1])

    def f(x, w, v):
        quant.matmul(x, v)  # discarded
        return quant.matmul(x, w)

    with quant.count_weight_reads() as reads:
        closed = jax.make_jaxpr(f)(jnp.ones((2, 96)), w, v)
    live = reads.live(_live_scopes(closed.jaxpr))
    assert len(reads.accesses) == 2 and len(live.accesses) == 1
    assert (live.stored, live.dequantized) == (quant.stored_nbytes(w), 96 * 64 * 4)


def test_demo_cli_keeps_the_weights_of_a_release(agreeing, capsys):
    assert main(["demo", "--checkpoint", str(agreeing / "fp4"), "--weights", "fp8", "--batch", "1",
                 "--new-tokens", "2", "--spec", "none", "--repeats", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    n_kept = 2 * 11 + 1 + 11 + 2  # attn 5 + shared 3 + experts 3 per layer, 1 indexer, MTP block + 2
    assert f"{n_kept} weights kept FP8 / FP4 (fp4, fp8)" in out and "tokens/s" in out
    with pytest.raises(SystemExit, match="stores none of the quantizable weights"):
        main(["demo", "--checkpoint", str(agreeing / "plain"), "--weights", "fp8"])
    with pytest.raises(SystemExit, match="pass --checkpoint"):
        main(["demo", "--preset", "test", "--weights", "fp8"])
