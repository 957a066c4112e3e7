"""Parity of `prefill_logits` with the transformers reference `DeepseekV4ForCausalLM` (eager, fp32).

A tiny HF model gets random values for every parameter (including the ones HF zero/one-initialises:
sinks, APE position biases, routing biases, hyper-connection base/scale, norms, and a random hash
table), is written with `save_pretrained`, loaded with `load_hf_checkpoint` (HF spelling, and the
official spelling after a key rewrite), and both models run the same batch without a cache.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is needed for the HF parity tests")
transformers = pytest.importorskip("transformers", reason="transformers is needed for the HF parity tests")
try:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
except ImportError:  # pragma: no cover - older transformers
    pytest.skip("this transformers has no DeepSeek-V4 model", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

from jaxspec.checkpoint import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from jaxspec.model.network import one_shot_logits as prefill_logits  # noqa: E402

HCA = 8
CSA = 4


def _hf_config(**overrides):
    kw = dict(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
        layer_types=[
            "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        compress_rates={"compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA},
        sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=16, index_topk=3,
        qk_rope_head_dim=8, num_hash_layers=1,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1024,
    )
    kw.update(overrides)
    cfg = DeepseekV4Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _randomize(model, seed: int) -> None:
    """Non-trivial values for every parameter and persistent buffer."""
    g = torch.Generator().manual_seed(seed)

    def rand(shape, std=1.0):
        return torch.randn(shape, generator=g) * std

    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.ndim == 1 and ("norm" in name or "layernorm" in name):
                p.copy_(1.0 + rand(p.shape, 0.2))
            elif leaf == "sinks":
                p.copy_(rand(p.shape, 1.0))
            elif leaf == "position_bias":
                p.copy_(rand(p.shape, 0.5))
            elif leaf in ("base", "hc_base"):
                p.copy_(rand(p.shape, 0.3))
            elif leaf in ("scale", "hc_scale"):
                p.copy_(1.0 + rand(p.shape, 0.3))
            elif leaf in ("fn", "hc_fn"):
                p.copy_(rand(p.shape, 0.1))
            elif p.ndim >= 2:
                fan_in = p.shape[-1]
                p.copy_(rand(p.shape, 1.0 / np.sqrt(fan_in)))
            else:
                raise AssertionError(f"unhandled parameter {name} {tuple(p.shape)}")
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(rand(b.shape, 0.3))
            elif name.endswith("tid2eid"):
                v, k = b.shape
                e = model.config.n_routed_experts
                rows = [torch.randperm(e, generator=g)[:k] for _ in range(v)]
                b.copy_(torch.stack(rows).to(b.dtype))


def _official_rewrite(src: str, dst: str, cfg: DeepseekV4Config) -> None:
    """Turn an HF save_pretrained folder into the official DeepSeek spelling and config form."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    out = {}
    for k, v in tensors.items():
        if k.startswith("model."):
            k = k[len("model."):]
            k = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                 "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}.get(k, k)
            # save_pretrained writes the attention's KV norm as `attn.norm`; DeepSeek's files (and
            # inference/model.py) call it `attn.kv_norm`. The compressors' `norm` keeps its name.
            k = re.sub(r"^(layers\.\d+\.attn)\.norm\.weight$", r"\1.kv_norm.weight", k)
        out[k] = v
    assert any(k.endswith(".attn.kv_norm.weight") for k in out)
    assert not any(k.endswith(".attn.norm.weight") for k in out)
    save_file(out, os.path.join(dst, "model.safetensors"))
    rates = cfg.compress_rates
    ratio = {"sliding_attention": 0, "compressed_sparse_attention": rates["compressed_sparse_attention"],
             "heavily_compressed_attention": rates["heavily_compressed_attention"]}
    official = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank, "sliding_window": cfg.sliding_window,
        "compress_ratios": [ratio[t] for t in cfg.layer_types] + [0],  # trailing 0: the MTP layer
        "compress_rate_csa": rates["compressed_sparse_attention"],
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "rope_theta": cfg.rope_theta, "compress_rope_theta": cfg.compress_rope_theta,
        "rope_scaling": {k: v for k, v in cfg.rope_parameters["compress"].items()
                         if k in ("type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow")},
        "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size, "n_shared_experts": cfg.n_shared_experts,
        "num_hash_layers": cfg.mlp_layer_types.count("hash_moe"),
        "routed_scaling_factor": cfg.routed_scaling_factor, "scoring_func": "sqrtsoftplus",
        "swiglu_limit": cfg.swiglu_limit, "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps, "rms_norm_eps": cfg.rms_norm_eps, "num_nextn_predict_layers": 1,
        "max_position_embeddings": cfg.max_position_embeddings, "torch_dtype": "float32",
    }
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(official, f)


def _run_parity(tmp_path, seq_len: int, spelling: str = "hf", seed: int = 0, hca: int = HCA, **overrides):
    torch.manual_seed(seed)
    rates = {"compressed_sparse_attention": CSA, "heavily_compressed_attention": hca}
    hf_cfg = _hf_config(compress_rates=rates, **overrides)
    model = DeepseekV4ForCausalLM(hf_cfg).float().eval()
    _randomize(model, seed)
    hf_dir = str(tmp_path / "hf")
    model.save_pretrained(hf_dir)
    load_dir = hf_dir
    if spelling == "official":
        load_dir = str(tmp_path / "official")
        _official_rewrite(hf_dir, load_dir, hf_cfg)
    cfg, params = load_hf_checkpoint(load_dir)
    assert cfg.num_mtp_layers == 0 and params.mtp is None
    assert cfg.layer_types == ("sliding", "csa", "hca", "csa")
    assert (cfg.csa_ratio, cfg.hca_ratio) == (CSA, hca)

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, hf_cfg.vocab_size, size=(2, seq_len))
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens), use_cache=False).logits.numpy()
    got = np.asarray(prefill_logits(params, cfg, jnp.asarray(tokens, jnp.int32)))
    assert got.shape == ref.shape
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err <= 1e-4, f"relative error {err:.3e}"
    return cfg, params, hf_dir


def test_parity_hf_spelling_topk_cuts(tmp_path):
    # 61 tokens: 15 CSA entries per query at most, index_topk=3 keeps only some; 7 HCA entries.
    cfg, params, hf_dir = _run_parity(tmp_path, seq_len=61, spelling="hf", index_topk=3)
    # Writing the loaded params back in HF spelling reproduces save_pretrained's tensors exactly.
    from safetensors.numpy import load_file

    save_hf_checkpoint(tmp_path / "again", cfg, params, spelling="hf")
    ref = load_file(os.path.join(hf_dir, "model.safetensors"))
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert sorted(again) == sorted(ref)
    for k, v in ref.items():
        assert again[k].dtype == v.dtype and again[k].shape == v.shape, k
        np.testing.assert_array_equal(again[k], v, err_msg=k)


def test_parity_official_spelling_topk_keeps_all(tmp_path):
    # index_topk=32 > 16 available entries: every causal entry is attended.
    _run_parity(tmp_path, seq_len=64, spelling="official", seed=1, index_topk=32)


def test_parity_window_not_multiple_of_ratio(tmp_path):
    _run_parity(tmp_path, seq_len=53, spelling="hf", seed=2, sliding_window=6, index_topk=5)


def test_parity_official_spelling_hca16(tmp_path):
    # HCA ratio 16 over 70 tokens (4 HCA entries), window 8, top-k cuts.
    _run_parity(tmp_path, seq_len=70, spelling="official", seed=3, hca=16, index_topk=4)


def test_parity_indexer_ties_break_to_lowest_index(tmp_path, monkeypatch):
    """With 2 index heads many scores tie at exactly 0 (every ReLU zero), and torch.topk's order among
    ties is unspecified; jax.lax.top_k keeps the lowest entry index. With torch's top-k made stable
    (the same rule) the models agree, i.e. ties are the only source of difference."""

    def stable_topk(self, k, dim=-1, largest=True, sorted=True):
        assert largest
        values, indices = torch.sort(self, dim=dim, descending=True, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    monkeypatch.setattr(torch.Tensor, "topk", stable_topk)
    _run_parity(tmp_path, seq_len=61, spelling="hf", seed=4, index_topk=3, index_n_heads=2)
