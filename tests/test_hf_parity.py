"""Parity with the transformers reference `DeepseekV4ForCausalLM` (eager, fp32): prefill without a
cache, decode with its cache, the MTP block, and the sampling warpers.

A tiny HF model gets random values for every parameter (including the ones HF zero/one-initialises:
sinks, APE position biases, routing biases, hyper-connection base/scale, norms, and a random hash
table), is written with `save_pretrained`, loaded with `load_hf_checkpoint` (HF spelling, and the
official spelling after a key rewrite), and both models run the same tokens.

transformers has no MTP block (it drops `mtp.*` on load): the MTP reference is a second HF model of
one sliding-attention layer, whose decoder layer, hc_head and norm are the MTP block's, fed
u = h_proj(hnorm(H)) + e_proj(enorm(embed(next token))) per stream by five lines of torch here.

torch and transformers are imported, not skipped: CI fails when the oracle is missing
(scripts/setup.sh installs them). Tolerances: TOL, relative to the largest |logit|, where the
measured errors are 0.4-3.5e-6.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

from jaxspec.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from jaxspec.model import network
from jaxspec.model.network import one_shot_logits as prefill_logits
from jaxspec.model.sampling import processed_logprobs
from jaxspec.model.state import commit_layer, init_state, layer_state

TOL = 1e-5
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


def _hf_model(seed: int, **overrides) -> DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(_hf_config(**overrides)).float().eval()
    _randomize(model, seed)
    return model


def relative_error(got, ref) -> float:
    """max |got - ref| / max |ref|."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def _run_parity(tmp_path, seq_len: int, spelling: str = "hf", seed: int = 0, hca: int = HCA, **overrides):
    rates = {"compressed_sparse_attention": CSA, "heavily_compressed_attention": hca}
    model = _hf_model(seed, compress_rates=rates, **overrides)
    hf_cfg = model.config
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
    err = relative_error(got, ref)
    assert err <= TOL, f"relative error {err:.3e}"
    return cfg, params, hf_dir


def test_parity_hf_spelling_topk_cuts(tmp_path):
    # 61 tokens: 15 CSA entries per query at most, index_topk=3 keeps only some; 7 HCA entries.
    cfg, params, hf_dir = _run_parity(tmp_path, seq_len=61, spelling="hf", index_topk=3)
    # Writing the loaded params back in HF spelling reproduces save_pretrained's tensors exactly.
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


# ---------------------------------------------------------------------------------------------
# decode with a cache
# ---------------------------------------------------------------------------------------------

PREFILL, TOTAL = 13, 45  # a prefill that leaves partial CSA / HCA windows, then 32 one-token steps


def test_decode_with_cache_matches_hf_cached_decode(tmp_path):
    """Prefill 13 tokens, then decode token by token to 45 (teacher-forced): our `extend` with the
    committed state against HF's forward with its DynamicCache, step for step. The decode crosses the
    window (8) 4 times, CSA (4) 8 times, HCA (8) 4 times, with the indexer's top-3 cutting. HF's cached
    decode is first held to its own full forward (same positions), so a fault of its cache path
    could not pass as ours."""
    model = _hf_model(5, index_topk=3)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_hf_checkpoint(tmp_path / "hf")
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, size=(2, TOTAL))
    with torch.no_grad():
        full = model(torch.as_tensor(tokens), use_cache=False).logits.numpy()[:, PREFILL - 1:]
        cache = DynamicCache(config=model.config)
        hf = [model(torch.as_tensor(tokens[:, :PREFILL]), cache=cache, use_cache=True).logits[:, -1].numpy()]
        for i in range(PREFILL, TOTAL):
            hf.append(model(torch.as_tensor(tokens[:, i : i + 1]), cache=cache, use_cache=True).logits[:, -1].numpy())
    hf = np.stack(hf, axis=1)  # [B, TOTAL - PREFILL + 1, V]: the logits after each prefix
    assert relative_error(hf, full) <= TOL  # HF's cache path is consistent with HF itself

    step = jax.jit(lambda p, st, t: network.extend(p, cfg, st, t, jnp.ones(t.shape, bool), banded=False))
    out, state = step(params, init_state(cfg, 2, TOTAL), jnp.asarray(tokens[:, :PREFILL], jnp.int32))
    ours = [np.asarray(out.logits[:, -1])]
    for i in range(PREFILL, TOTAL):
        out, state = step(params, state, jnp.asarray(tokens[:, i : i + 1], jnp.int32))
        ours.append(np.asarray(out.logits[:, -1]))
    assert int(state.length[0]) == TOTAL
    err = relative_error(np.stack(ours, axis=1), hf)
    assert err <= TOL, f"relative error {err:.3e}"


# ---------------------------------------------------------------------------------------------
# the MTP block
# ---------------------------------------------------------------------------------------------


def _with_mtp_block(main: DeepseekV4ForCausalLM, folder, seed: int):
    """Save `main` to `folder` with an MTP block in the release's spelling (mtp.0.*) -> (the torch
    modules of the block: host model whose layer 0 / hc_head / norm are the block's, e_proj, h_proj,
    enorm, hnorm)."""
    host = _hf_model(seed, num_hidden_layers=1, layer_types=["sliding_attention"], num_hash_layers=0)
    d, eps = main.config.hidden_size, main.config.rms_norm_eps
    g = torch.Generator().manual_seed(seed)
    e_proj, h_proj = torch.nn.Linear(d, d, bias=False), torch.nn.Linear(d, d, bias=False)
    enorm, hnorm = DeepseekV4RMSNorm(d, eps=eps), DeepseekV4RMSNorm(d, eps=eps)
    with torch.no_grad():
        for module in (e_proj, h_proj):
            module.weight.copy_(torch.randn(d, d, generator=g) / np.sqrt(d))
        for module in (enorm, hnorm):
            module.weight.copy_(1.0 + 0.2 * torch.randn(d, generator=g))
    main.save_pretrained(folder / "main")
    host.save_pretrained(folder / "host")
    tensors = load_file(str(folder / "main" / "model.safetensors"))
    head = {"model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
            "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    for k, v in load_file(str(folder / "host" / "model.safetensors")).items():
        if k.startswith("model.layers.0."):
            tensors["mtp.0." + re.sub(r"^attn\.norm\.", "attn.kv_norm.", k[len("model.layers.0."):])] = v
        elif k in head:
            tensors["mtp.0." + head[k]] = v
    for name, module in {"e_proj": e_proj, "h_proj": h_proj, "enorm": enorm, "hnorm": hnorm}.items():
        tensors[f"mtp.0.{name}.weight"] = module.weight.detach().numpy().copy()
    save_file(tensors, str(folder / "main" / "model.safetensors"), metadata={"format": "pt"})
    return host, e_proj, h_proj, enorm, hnorm


def test_mtp_block_matches_torch_reference(tmp_path):
    """mtp_forward on the target's final streams H (taken from HF's forward) and the next tokens, at MTP
    positions 0..43: the whole sequence in one call, and one position per call committing the MTP
    window ring (width 8, wrapped 5 times), against the HF-module reference."""
    main = _hf_model(6, index_topk=3)
    host, e_proj, h_proj, enorm, hnorm = _with_mtp_block(main, tmp_path, seed=7)
    cfg, params = load_hf_checkpoint(tmp_path / "main")
    assert cfg.num_mtp_layers == 1 and params.mtp is not None
    tokens = np.random.default_rng(6).integers(0, cfg.vocab_size, size=(2, TOTAL))
    t = TOTAL - 1  # MTP position i reads H_i and token i + 1
    streams = []
    hook = main.model.hc_head.register_forward_hook(lambda module, args, out: streams.append(args[0]))
    with torch.no_grad():
        main(torch.as_tensor(tokens), use_cache=False)
        hook.remove()
        hidden, nxt = streams[0][:, :t], torch.as_tensor(tokens[:, 1:])
        e = main.model.embed_tokens(nxt)
        u = h_proj(hnorm(hidden)) + e_proj(enorm(e)).unsqueeze(2)  # [B, T, hc, d]
        pos = torch.arange(t)[None]
        rope = {kind: host.model.rotary_emb(e, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=host.config, inputs_embeds=e, attention_mask=None,
                                                 cache=None, position_ids=pos)
        z = host.model.layers[0](u, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=nxt)
        ref = main.lm_head(host.model.norm(host.model.hc_head(z))).numpy()

    h, nxt = jnp.asarray(hidden.numpy()), jnp.asarray(tokens[:, 1:], jnp.int32)

    @jax.jit
    def mtp_step(params, ring, length, h, nxt):  # the MTP block's own window ring and its length
        take = jnp.ones(nxt.shape, bool)
        ctx = network.causal_context(length, take)
        logits, _, rows = network.mtp_forward(params.replace(mtp=None), params.mtp, cfg, ring, h, nxt, ctx)
        new_length = length + nxt.shape[1]
        return logits, commit_layer(cfg, "sliding", ring, rows, ctx.positions, take, new_length), new_length

    empty = layer_state(cfg, "sliding", 2, TOTAL), jnp.zeros((2,), jnp.int32)
    whole, _, _ = mtp_step(params, *empty, h, nxt)
    err = relative_error(whole, ref)
    assert err <= TOL, f"one call: relative error {err:.3e}"
    (ring, length), steps = empty, []
    for i in range(t):
        logits, ring, length = mtp_step(params, ring, length, h[:, i : i + 1], nxt[:, i : i + 1])
        steps.append(np.asarray(logits[:, 0]))
    assert int(length[0]) == t
    err = relative_error(np.stack(steps, axis=1), ref)
    assert err <= TOL, f"one position per call: relative error {err:.3e}"


# ---------------------------------------------------------------------------------------------
# sampling: transformers' logits warpers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.6, 5, 0.9), (1.0, None, 0.8), (1.3, 20, None),
                                                     (0.7, 40, 0.5)])
def test_processed_logprobs_match_hf_warpers(temperature, top_k, top_p):
    """Temperature, then top-k, then top-p over what top-k kept, as `generate`'s warpers apply them,
    on distinct float32 logits (transformers keeps ties by sort order, we by value)."""
    logits = np.random.default_rng(8).normal(size=(64, 96)).astype(np.float32) * 2.0
    scores = torch.as_tensor(logits)
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p else []
    for warper in warpers:
        scores = warper(None, scores)
    ref = torch.softmax(scores, dim=-1).double().numpy()
    got = np.exp(np.asarray(processed_logprobs(jnp.asarray(logits), jnp.float32(temperature), jnp.int32(top_k or 0),
                                               jnp.float32(top_p or 1.0)), np.float64))
    np.testing.assert_array_equal(got > 0, ref > 0)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
