"""DeepSeek-V4's official checkpoints: the exact names, FP8 / FP4 block-scaled weights, sharded
index, region reads and the one-line errors.

The quantized folders are written by tests/official_layout.py (its own quantizer, number formats
decoded from the bits, its own file writer), never by jaxspec's writer; the reference is the same
stored values dequantized in numpy there, written as a plain F32 checkpoint.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from official_layout import (
    EXPERT_NAMES,
    FP8_NAMES,
    INDEX,
    QUANT_CONFIG,
    Raw,
    flash_tensor,
    hf_spelling,
    official_names,
    officialize,
    raw,
    read_plain,
    write_file,
    write_folder,
    write_index,
    write_sparse,
)

from jaxspec.checkpoint import LoadStats, load_hf_checkpoint, open_hf_checkpoint, save_hf_checkpoint
from jaxspec.checkpoint.keys import official_config
from jaxspec.checkpoint.safetensors_io import open_folder, read_header
from jaxspec.core.config import ModelConfig
from jaxspec.model.network import init_params
from jaxspec.model.network import one_shot_logits as prefill_logits

# 4 layers (sliding, csa, hca, csa), 4 experts, hash layer 0, an MTP block: every kind of tensor.
CFG = ModelConfig.preset("test", bos_id=0, eos_id=1)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, size=(2, 40)), jnp.int32)


def _params(cfg: ModelConfig, seed: int = 0):
    """Random params of cfg's structure (norms near 1, matrices ~0.1, valid hash tables)."""
    rng = np.random.default_rng(seed)
    flat, treedef = jax.tree_util.tree_flatten_with_path(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))
    out = []
    for path, x in flat:
        if jnp.issubdtype(x.dtype, jnp.floating):
            noise = rng.standard_normal(x.shape).astype(np.float32)
            out.append(jnp.asarray((1 + 0.1 * noise) if "norm" in jax.tree_util.keystr(path) else 0.1 * noise, x.dtype))
        else:
            ids = np.argsort(rng.random((x.shape[0], cfg.n_routed_experts)), axis=-1)[:, : x.shape[1]]
            out.append(jnp.asarray(ids, x.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


@pytest.fixture(scope="session")
def plain(tmp_path_factory):
    """Official-spelling fp32 tensors of random params (jaxspec's unquantized writer) and the config."""
    path = tmp_path_factory.mktemp("plain")
    save_hf_checkpoint(path, CFG, _params(CFG), spelling="official")
    with open(path / "config.json") as f:
        return read_plain(str(path)), json.load(f)


def _quantized(root, plain, experts="fp4", spelling="official"):
    """-> (folder of the release's layout, folder of its numpy dequantization as F32)."""
    tensors, config = plain
    stored, ref = officialize(tensors, experts)
    qconfig = dict(config, quantization_config=QUANT_CONFIG, torch_dtype="bfloat16")
    if spelling == "hf":
        stored = {hf_spelling(k): v for k, v in stored.items()}
    write_folder(str(root / f"{experts}_{spelling}"), qconfig, stored, shards=3)
    ref_raw = {k: raw("F32" if v.dtype == np.float32 else "I64", v) for k, v in ref.items()}
    write_folder(str(root / f"{experts}_ref"), config, ref_raw, shards=2)
    return root / f"{experts}_{spelling}", root / f"{experts}_ref"


def _leaves(params):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


# ---- names ---------------------------------------------------------------------------------------
def test_official_names_cover_the_reference_inventory(plain, tmp_path):
    names = official_names(CFG.layer_types, CFG.num_hash_layers, CFG.n_routed_experts, mtp=True)
    assert set(plain[0]) == names
    assert {"layers.0.attn.kv_norm.weight", "mtp.0.attn.kv_norm.weight", "mtp.0.hc_head_fn",
            "layers.1.attn.indexer.compressor.ape", "layers.0.ffn.gate.tid2eid"} <= names
    # jaxspec's quantized writer: the same names plus one scale per FP8 / FP4 weight, in the release's dtypes
    save_hf_checkpoint(tmp_path / "q", CFG, _params(CFG), quantize="fp4", max_shard_bytes=32 * 1024)
    folder = open_folder(str(tmp_path / "q"))
    assert folder.indexed and len({i.file for i in folder.tensors.values()}) > 1
    quantized = {n for n in names if FP8_NAMES.search(n) or EXPERT_NAMES.search(n)}
    assert set(folder.tensors) == names | {n[: -len("weight")] + "scale" for n in quantized}
    dtypes = {n: i.dtype for n, i in folder.tensors.items()}
    assert dtypes["layers.1.attn.wq_b.weight"] == "F8_E4M3" and dtypes["layers.1.attn.wq_b.scale"] == "F8_E8M0"
    assert dtypes["layers.2.ffn.experts.3.w2.weight"] == "I8" and dtypes["layers.2.ffn.experts.3.w2.scale"] == "F8_E8M0"
    assert dtypes["embed.weight"] == dtypes["layers.1.attn.compressor.wkv.weight"] == "BF16"
    assert dtypes["layers.1.hc_attn_fn"] == dtypes["layers.1.attn.attn_sink"] == "F32"
    assert dtypes["layers.0.ffn.gate.tid2eid"] == "I64"
    config = json.load(open(tmp_path / "q" / "config.json"))
    assert config["quantization_config"]["weight_block_size"] == [128, 128] and config["expert_dtype"] == "fp4"
    assert config["compress_ratios"] == [0, 4, 16, 4, 0]


@pytest.mark.parametrize("experts", ["fp4", "fp8"])
def test_jaxspec_quantizer_matches_the_test_quantizer(plain, tmp_path, experts):
    """save_hf_checkpoint(quantize=...) stores the same bytes as the tests' own quantizer."""
    params = _params(CFG)
    save_hf_checkpoint(tmp_path / "q", CFG, params, quantize=experts)
    stored, _ = officialize(plain[0], experts)
    folder = open_folder(str(tmp_path / "q"))
    assert set(folder.tensors) == set(stored)
    for name, info in folder.tensors.items():
        with open(info.file, "rb") as f:
            f.seek(info.begin)
            data = f.read(info.nbytes)
        assert (info.dtype, info.shape) == (stored[name].dtype, stored[name].shape), name
        assert data == stored[name].data, name


# ---- values --------------------------------------------------------------------------------------
@pytest.mark.parametrize("experts", ["fp4", "fp8"])
def test_quantized_checkpoint_equals_numpy_dequantization(plain, tmp_path, experts):
    """Release layout (FP8 attention / shared / MTP projections, FP4 or FP8 + float32-scale experts,
    BF16 rest, 3 shards + index) loads to exactly the numpy dequantization of its stored values."""
    qdir, refdir = _quantized(tmp_path, plain, experts)
    stats = LoadStats()
    cfg, params = load_hf_checkpoint(qdir, dtype="float32", stats=stats)
    cfg_ref, ref = load_hf_checkpoint(refdir, dtype="float32")
    assert cfg == cfg_ref and cfg.num_mtp_layers == 1 and cfg.dtype == "float32"
    got, want = _leaves(params), _leaves(ref)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # the quantization is real: experts moved off their fp32 values
    w1 = plain[0]["layers.1.ffn.experts.2.w1.weight"].T
    assert 1e-3 < _rel(got[".layers[1].ffn.experts.w1"][2], w1) < 0.3
    logits, logits_ref = prefill_logits(params, cfg, TOKENS), prefill_logits(ref, cfg_ref, TOKENS)
    assert _rel(logits, logits_ref) <= 1e-5
    assert stats.total_read == stats.bytes_in_files + 5  # each wo_a scale block is read by both of its groups
    shards = [qdir / f for f in os.listdir(qdir) if f.endswith(".safetensors")]
    headers = sum(8 + int.from_bytes(open(f, "rb").read(8), "little") for f in shards)
    assert stats.bytes_in_files == sum(os.path.getsize(f) for f in shards) - headers  # every data byte, once


def test_bfloat16_run_dtype(plain, tmp_path):
    qdir, refdir = _quantized(tmp_path, plain, "fp4")
    cfg, params = load_hf_checkpoint(qdir, dtype="bfloat16")
    _, ref = load_hf_checkpoint(refdir, dtype="float32")
    got, want = _leaves(params), _leaves(ref)
    assert cfg.dtype == "bfloat16"
    for k in (".layers[1].attn.wq_b", ".layers[2].ffn.experts.w2", ".mtp.inputs.e_proj", ".embed"):
        assert got[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got[k], want[k].astype(ml_dtypes.bfloat16), err_msg=k)
    assert got[".layers[1].attn.sink"].dtype == np.float32


def test_hf_and_official_spelling_give_identical_logits(plain, tmp_path):
    official, _ = _quantized(tmp_path, plain, "fp4")
    hf, _ = _quantized(tmp_path, plain, "fp4", spelling="hf")
    names = set(json.load(open(hf / INDEX))["weight_map"])
    assert {"model.layers.0.attn.norm.weight", "model.layers.0.attn.wq_a.weight_scale_inv", "model.embed_tokens.weight",
            "model.hc_head.hc_fn", "head.weight", "mtp.0.attn.kv_norm.weight"} <= names
    cfg_a, a = load_hf_checkpoint(official, dtype="float32")
    cfg_b, b = load_hf_checkpoint(hf, dtype="float32")
    assert cfg_a == cfg_b
    for (k, x), y in zip(_leaves(a).items(), _leaves(b).values(), strict=True):
        assert x.tobytes() == y.tobytes(), k
    logits_a, logits_b = prefill_logits(a, cfg_a, TOKENS), prefill_logits(b, cfg_b, TOKENS)
    np.testing.assert_array_equal(np.asarray(logits_a), np.asarray(logits_b))


@pytest.mark.parametrize("form", ["F4", "U8"])
def test_packed_fp4_forms(plain, tmp_path, form):
    """Experts declared F4 [out, in] (safetensors' own FP4) or U8 [out, in/2] read like DeepSeek's I8."""
    qdir, _ = _quantized(tmp_path, plain, "fp4")
    stored, _ = officialize(plain[0], "fp4")
    for name, t in list(stored.items()):
        if EXPERT_NAMES.search(name):
            shape = (t.shape[0], 2 * t.shape[1]) if form == "F4" else t.shape
            stored[name] = Raw(form, shape, t.data)
    other = tmp_path / form
    write_folder(str(other), json.load(open(qdir / "config.json")), stored, shards=2)
    _, a = load_hf_checkpoint(qdir, dtype="float32")
    _, b = load_hf_checkpoint(other, dtype="float32")
    for (k, x), y in zip(_leaves(a).items(), _leaves(b).values(), strict=True):
        np.testing.assert_array_equal(x, y, err_msg=k)


def test_region_reads_touch_only_their_bytes(plain, tmp_path):
    """Any slice of a leaf equals that slice of the whole leaf; one expert reads one expert's tensors."""
    qdir, _ = _quantized(tmp_path, plain, "fp4")
    ck = open_hf_checkpoint(qdir, dtype="float32")
    rng = np.random.default_rng(1)
    for leaf in (".layers[1].ffn.experts.w2", ".layers[1].attn.wo_a", ".layers[3].attn.wq_b", ".embed", ".head",
                 ".layers[0].ffn.tid2eid", ".mtp.block.ffn.shared.w1", ".layers[2].hc_ffn.fn"):
        whole = ck.read(leaf)
        for _ in range(4):
            index = []
            for n in whole.shape:
                a = int(rng.integers(0, n))
                index.append(slice(a, int(rng.integers(a + 1, n + 1))))
            np.testing.assert_array_equal(ck.read(leaf, tuple(index)), whole[tuple(index)], err_msg=f"{leaf} {index}")
    ck.reader.bytes_read.clear()
    part = ck.read(".layers[2].ffn.experts.w1", (slice(3, 4), slice(0, 32), slice(0, 8)))
    assert part.shape == (1, 32, 8)
    # ours [E, d, I] = ckpt [I, d] per expert: I rows 0..7 of expert 3, all d = 32 columns (16 bytes, 1 scale each)
    assert dict(ck.reader.bytes_read) == {"layers.2.ffn.experts.3.w1.weight": 8 * 16,
                                          "layers.2.ffn.experts.3.w1.scale": 8}


def test_v4_flash_release_layout_validates_and_reads_by_region(tmp_path):
    """Every header of V4-Flash as released (names, dtypes, shapes, scale grids of the reference doc;
    ~160 GB of all-zero sparse files, one shard per block + index) passes `open_hf_checkpoint` for
    the v4-flash config, and a slice of one expert reads only its own bytes."""
    probe = tmp_path / "probe"
    with open(probe, "wb") as f:
        f.truncate(1 << 30)
    if os.stat(probe).st_blocks * 512 > 1 << 20:
        pytest.skip("this file system has no sparse files")
    cfg = ModelConfig.preset("v4-flash")
    names = official_names(cfg.layer_types, cfg.num_hash_layers, cfg.n_routed_experts, mtp=True)
    names |= {n[: -len("weight")] + "scale" for n in names if FP8_NAMES.search(n) or EXPERT_NAMES.search(n)}
    blocks: dict[str, dict] = {}
    for name in sorted(names):
        m = re.match(r"^(layers\.(\d+)|mtp\.0)\.", name)
        kind = cfg.layer_types[int(m.group(2))] if m and m.group(2) else "sliding"
        blocks.setdefault(m.group(1) if m else "top", {})[name] = flash_tensor(name, kind)
    folder = tmp_path / "DeepSeek-V4-Flash"
    folder.mkdir()
    weight_map = {}
    for i, entries in enumerate(blocks.values()):
        file = f"model-{i + 1:05d}-of-{len(blocks):05d}.safetensors"
        write_sparse(str(folder / file), entries)
        weight_map.update(dict.fromkeys(entries, file))
    write_index(str(folder), weight_map)
    config = dict(official_config(cfg), quantization_config=QUANT_CONFIG, torch_dtype="bfloat16", bos_token_id=0,
                  eos_token_id=1)
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)

    ck = open_hf_checkpoint(folder)
    assert ck.cfg == cfg and len(ck.cfg.layer_types) == 43
    assert 150e9 < ck.stats().bytes_in_files < 170e9
    part = ck.read(".layers[2].ffn.experts.w1", (slice(5, 6), slice(0, 64), slice(0, 32)))
    assert part.shape == (1, 64, 32) and part.dtype == ml_dtypes.bfloat16 and not part.astype(np.float32).any()
    # ours [E, d, I] = ckpt [I, d] per expert: rows 0..31, columns 0..63 = 32 packed bytes and 2 scales per row
    assert dict(ck.reader.bytes_read) == {"layers.2.ffn.experts.5.w1.weight": 32 * 32,
                                          "layers.2.ffn.experts.5.w1.scale": 32 * 2}


# ---- one-line errors -------------------------------------------------------------------------------
def _error(folder, edit) -> str:
    """Apply `edit(folder)`, load, and return the ValueError's text (one line)."""
    edit(folder)
    with pytest.raises(ValueError) as e:
        load_hf_checkpoint(folder, dtype="float32")
    text = str(e.value)
    assert "\n" not in text
    return text


def _rewrite(folder, name: str, new: Raw | None, file: str | None = None) -> None:
    """Replace, add (in `file`) or drop (new=None) one tensor of a shard, and its index entry."""
    weight_map = json.load(open(folder / INDEX))["weight_map"]
    file = weight_map.get(name, file)
    tensors = {}
    for k, info in read_header(str(folder / file)).items():
        with open(info.file, "rb") as f:
            f.seek(info.begin)
            tensors[k] = Raw(info.dtype, info.shape, f.read(info.nbytes))
    if new is None:
        del tensors[name], weight_map[name]
    else:
        tensors[name] = new
        weight_map[name] = file
    write_file(str(folder / file), tensors)
    write_index(str(folder), weight_map)


@pytest.fixture()
def qdir(plain, tmp_path):
    return _quantized(tmp_path, plain, "fp4")[0]


def test_error_missing_scale(qdir):
    text = _error(qdir, lambda d: _rewrite(d, "layers.1.attn.wq_b.scale", None))
    assert text == ("FP8 weight 'layers.1.attn.wq_b.weight' has no scale tensor (layers.1.attn.wq_b.scale or "
                    ".weight_scale_inv)")


def test_error_scale_grid(qdir):
    bad = raw("F8_E8M0", np.full((32, 2), 127, np.uint8))  # experts' w1 [I=32, d=32] needs [32, 1]
    text = _error(qdir, lambda d: _rewrite(d, "layers.3.ffn.experts.0.w1.scale", bad))
    assert text == ("scale 'layers.3.ffn.experts.0.w1.scale' has shape [32, 2], expected [32, 1] for the FP4 weight "
                    "'layers.3.ffn.experts.0.w1.weight' [32, 32] in 1 x 32 blocks")


@pytest.mark.parametrize("dtype", ["F6_E2M3", "Q3"])
def test_error_unknown_dtype(qdir, dtype):
    bad = Raw(dtype, (128, 32), b"\0" * 128 * 32)
    text = _error(qdir, lambda d: _rewrite(d, "layers.1.attn.wq_b.weight", bad))
    assert text.startswith(f"tensor 'layers.1.attn.wq_b.weight' has unsupported dtype '{dtype}' (supported: ")


def test_error_tensor_missing_from_index(qdir):
    weight_map = json.load(open(qdir / INDEX))["weight_map"]
    file = weight_map.pop("layers.2.attn.wkv.weight")  # still in its shard
    text = _error(qdir, lambda d: write_index(str(d), weight_map))
    assert text == f"tensor 'layers.2.attn.wkv.weight' is missing from {INDEX} (it is in {file})"


def test_error_tensor_missing_everywhere(qdir):
    text = _error(qdir, lambda d: _rewrite(d, "mtp.0.hnorm.weight", None))
    assert text.startswith(f"missing tensor 'mtp.0.hnorm.weight' in {INDEX} of ")


def test_error_shard_file_missing(qdir):
    weight_map = json.load(open(qdir / INDEX))["weight_map"]
    file = sorted(set(weight_map.values()))[1]
    first = next(k for k, v in weight_map.items() if v == file)
    text = _error(qdir, lambda d: os.remove(d / file))
    assert text == f"shard file '{file}' (tensor '{first}' in {INDEX}) is missing from '{qdir}'"


def test_error_scale_beside_a_plain_weight(qdir):
    file = json.load(open(qdir / INDEX))["weight_map"]["layers.0.attn_norm.weight"]
    scale = raw("F8_E8M0", np.full((1, 1), 127, np.uint8))
    text = _error(qdir, lambda d: _rewrite(d, "layers.0.attn_norm.scale", scale, file))
    assert text == ("unexpected tensor 'layers.0.attn_norm.scale': its weight 'layers.0.attn_norm.weight' is BF16, "
                    "not quantized")
