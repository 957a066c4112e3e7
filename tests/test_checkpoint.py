"""Checkpoint I/O: orbax round trip, DeepSeek-V4 safetensors round trip in both spellings, and errors."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from jaxspec.checkpoint import load_checkpoint, load_hf_checkpoint, save_checkpoint, save_hf_checkpoint
from jaxspec.core.config import ModelConfig
from jaxspec.model.network import init_params


def _random_params(cfg: ModelConfig, seed: int = 0):
    """Params of cfg's exact structure with every float leaf (sinks, APE, biases, norms too) random and
    valid hash tables; built in numpy from the abstract tree (eager init_params is slow on CPU)."""
    rng = np.random.default_rng(seed)
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    out = []
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.floating):
            out.append(jnp.asarray(rng.standard_normal(x.shape, np.float32).astype(x.dtype)))
        else:  # tid2eid [V, k]: k distinct experts per token
            ids = np.argsort(rng.random((x.shape[0], cfg.n_routed_experts)), axis=-1)[:, : x.shape[1]]
            out.append(jnp.asarray(ids, x.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def _assert_bit_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4, trainer)
    return tok


# ---- orbax -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip_bit_exact(tmp_path, dtype):
    cfg = ModelConfig.preset("test", dtype=dtype, bos_id=1, eos_id=2)
    params = _random_params(cfg)
    tok = _tiny_tokenizer() if dtype == "float32" else None
    save_checkpoint(tmp_path / "ckpt", cfg, params, tokenizer=tok)
    cfg2, params2, tok2 = load_checkpoint(tmp_path / "ckpt")
    assert cfg2 == cfg and isinstance(cfg2.layer_types, tuple)
    _assert_bit_equal(params, params2)
    if tok is None:
        assert tok2 is None
    else:
        text = "the lazy fox"
        assert tok2.encode(text).ids == tok.encode(text).ids
        assert tok2.get_vocab() == tok.get_vocab()


def test_orbax_round_trip_without_mtp(tmp_path):
    cfg = ModelConfig.preset("test", num_mtp_layers=0)
    params = _random_params(cfg, seed=3)
    assert params.mtp is None
    save_checkpoint(tmp_path / "c", cfg, params)
    cfg2, params2, tok = load_checkpoint(tmp_path / "c")
    assert cfg2 == cfg and params2.mtp is None and tok is None
    _assert_bit_equal(params, params2)


def test_run_options_are_not_saved_with_the_model(tmp_path):
    """A checkpoint saved while running the kernels with a chunk of 64 holds the architecture only and
    loads with the default run options; a folder that older versions wrote with run options (and the
    kernel switch's first name) loads the same."""
    cfg = ModelConfig.preset("test", kernels="pallas", prefill_chunk=64)
    save_checkpoint(tmp_path / "c", cfg, _random_params(cfg, seed=4))
    with open(tmp_path / "c" / "config.json") as f:
        written = json.load(f)
    assert not {"kernels", "prefill_chunk"} & set(written) and written == json.loads(json.dumps(cfg.architecture()))
    plain = cfg.replace(kernels="xla", prefill_chunk=0)
    assert load_checkpoint(tmp_path / "c").cfg == plain
    with open(tmp_path / "c" / "config.json", "w") as f:
        json.dump({**written, "kernels": "pallas", "prefill_chunk": 64, "attention_impl": "pallas"}, f)
    assert load_checkpoint(tmp_path / "c").cfg == plain


def test_orbax_errors(tmp_path):
    cfg = ModelConfig.preset("test")
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    params = _random_params(cfg)
    save_checkpoint(tmp_path / "c", cfg, params)
    with pytest.raises(ValueError, match="already exists"):
        save_checkpoint(tmp_path / "c", cfg, params)
    save_checkpoint(tmp_path / "c", cfg, params, overwrite=True)
    with pytest.raises(ValueError, match="structure"):
        save_checkpoint(tmp_path / "d", cfg.replace(num_mtp_layers=0), params)


# ---- DeepSeek-V4 safetensors ---------------------------------------------------------------------
@pytest.mark.parametrize("spelling,dtype", [("official", "float32"), ("hf", "float32"), ("official", "bfloat16")])
def test_hf_round_trip(tmp_path, spelling, dtype):
    cfg = ModelConfig.preset("test", bos_id=0, eos_id=1, dtype=dtype)
    params = _random_params(cfg)
    save_hf_checkpoint(tmp_path / "m", cfg, params, spelling=spelling, max_shard_bytes=64 * 1024)
    files = [f for f in os.listdir(tmp_path / "m") if f.endswith(".safetensors")]
    assert len(files) > 1  # sharded
    keys = set()
    for f in files:
        with safe_open(tmp_path / "m" / f, framework="numpy") as st:
            keys |= set(st.keys())
    if spelling == "official":
        assert {"embed.weight", "hc_head_fn", "mtp.0.e_proj.weight", "layers.0.ffn.gate.tid2eid",
                "layers.0.attn.kv_norm.weight", "mtp.0.attn.kv_norm.weight"} <= keys
        assert "layers.0.attn.norm.weight" not in keys
    else:
        assert {"model.embed_tokens.weight", "model.hc_head.hc_fn", "head.weight"} <= keys
        assert "model.layers.1.attn.indexer.compressor.ape" in keys
        assert "model.layers.0.attn.norm.weight" in keys  # save_pretrained's name for the KV norm
    cfg2, params2 = load_hf_checkpoint(tmp_path / "m")
    assert cfg2 == cfg
    _assert_bit_equal(params, params2)


def test_hf_layout(tmp_path):
    """Orientation of the torch tensors: [out, in] linears, grouped wo_a, stacked experts."""
    cfg = ModelConfig.preset("test", num_mtp_layers=0)
    params = _random_params(cfg)
    save_hf_checkpoint(tmp_path / "m", cfg, params, spelling="official")
    t = load_file(tmp_path / "m" / "model.safetensors")
    a = params.layers[1].attn
    np.testing.assert_array_equal(t["layers.1.attn.wq_a.weight"], np.asarray(a.wq_a).T)
    g, i, do = a.wo_a.shape
    wo_a = t["layers.1.attn.wo_a.weight"]
    assert wo_a.shape == (g * do, i)
    np.testing.assert_array_equal(wo_a[do : 2 * do], np.asarray(a.wo_a[1]).T)
    w2 = np.asarray(params.layers[2].ffn.experts.w2[3])
    np.testing.assert_array_equal(t["layers.2.ffn.experts.3.w2.weight"], w2.T)
    np.testing.assert_array_equal(t["layers.0.hc_attn_fn"], np.asarray(params.layers[0].hc_attn.fn).T)
    np.testing.assert_array_equal(t["layers.1.attn.compressor.ape"], np.asarray(a.compressor.ape))
    assert t["layers.0.ffn.gate.tid2eid"].dtype == np.int64
    assert "layers.0.ffn.gate.bias" not in t and "layers.1.ffn.gate.bias" in t
    assert not any(k.startswith("mtp.") for k in t)


def test_hf_without_mtp_tensors_and_dtype(tmp_path):
    cfg = ModelConfig.preset("test")
    params = _random_params(cfg)
    save_hf_checkpoint(tmp_path / "m", cfg, params, spelling="official")
    path = tmp_path / "m" / "model.safetensors"
    t = load_file(path)
    save_file({k: v for k, v in t.items() if not k.startswith("mtp.")}, path)
    cfg2, params2 = load_hf_checkpoint(tmp_path / "m")
    assert cfg2.num_mtp_layers == 0 and params2.mtp is None
    assert json.load(open(tmp_path / "m" / "config.json"))["num_nextn_predict_layers"] == 1
    _assert_bit_equal(params.replace(mtp=None), params2)

    cfg3, params3 = load_hf_checkpoint(tmp_path / "m", dtype="bfloat16")
    assert cfg3.dtype == "bfloat16"
    assert params3.embed.dtype == jnp.bfloat16 and params3.layers[1].attn.wq_b.dtype == jnp.bfloat16
    assert params3.layers[1].attn.sink.dtype == jnp.float32
    assert params3.layers[1].attn.compressor.ape.dtype == jnp.float32
    assert params3.layers[1].ffn.gate_bias.dtype == jnp.float32 and params3.layers[0].ffn.tid2eid.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(params3.head), np.asarray(params.head.astype(jnp.bfloat16)))


def _saved(tmp_path):
    cfg = ModelConfig.preset("test")
    save_hf_checkpoint(tmp_path / "m", cfg, _random_params(cfg), spelling="hf")
    path = tmp_path / "m" / "model.safetensors"
    return path, load_file(path)


def test_hf_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nope")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="config.json"):
        load_hf_checkpoint(tmp_path / "empty")


def test_hf_missing_tensor(tmp_path):
    path, t = _saved(tmp_path)
    name = "model.layers.3.attn.indexer.compressor.wgate.weight"
    del t[name]
    save_file(t, path)
    with pytest.raises(ValueError, match="missing tensor 'layers.3.attn.indexer.compressor.wgate.weight'"):
        load_hf_checkpoint(path.parent)


def test_hf_misshaped_tensor(tmp_path):
    path, t = _saved(tmp_path)
    name = "model.layers.2.attn.compressor.ape"
    t[name] = np.zeros((8, 32), np.float32)  # HCA ratio is 16
    save_file(t, path)
    with pytest.raises(ValueError, match=f"tensor '{name}' has shape \\[8, 32\\], expected \\[16, 32\\]"):
        load_hf_checkpoint(path.parent)


def test_hf_unexpected_tensor(tmp_path):
    path, t = _saved(tmp_path)
    t["model.layers.0.ffn.gate.bias"] = np.zeros((4,), np.float32)  # layer 0 is hash-routed
    save_file(t, path)
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.ffn.gate.bias'"):
        load_hf_checkpoint(path.parent)


def test_hf_bad_expert_ids(tmp_path):
    path, t = _saved(tmp_path)
    t["model.layers.0.ffn.gate.tid2eid"] = np.full_like(t["model.layers.0.ffn.gate.tid2eid"], 7)
    save_file(t, path)
    with pytest.raises(ValueError, match="tid2eid"):
        load_hf_checkpoint(path.parent)
