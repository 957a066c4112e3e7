"""A DeepSeek-V4-Flash-0731-style folder written by the tests' own code: a tiny V4 target in the
official names plus a DSpark drafter `mtp.0/1/2.*` as docs/dspark.md ("What a release holds") lists it.

Independent of `jaxspec.checkpoint`'s writer: names, official shapes ([out, in]) and the config are
spelled here from that description; the number formats and the file writer are `official_layout`'s.
Stages are full blocks with score-routed MoE (`ffn.gate.bias`, no `tid2eid`); stage 0 adds
`main_proj` / `main_norm`, the last stage `norm`, `hc_head_*`, the Markov head (`markov_w1` [V, r],
`markov_w2` [V, r]) and the confidence head (`proj.weight` [1, d + r], no bias). config.json carries
the flat `dspark_*` keys, `num_nextn_predict_layers: 1` and `compress_ratios` = target + [0, 0, 0].
"""

from __future__ import annotations

import json
import os
import re

import ml_dtypes
import numpy as np
from official_layout import (
    QUANT_CONFIG,
    Raw,
    block_names,
    officialize,
    quant_fp8,
    raw,
    write_file,
    write_index,
)

# The geometry: ratios mlx-vlm accepts (CSA 4, HCA 128), widths that keep every test in seconds.
TARGET = {
    "vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 32,
    "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8,
    "compress_ratios": [0, 4, 128, 4], "index_n_heads": 4, "index_head_dim": 16, "index_topk": 3,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "num_hash_layers": 1, "hc_mult": 4,
}
DSPARK = {"dspark_block_size": 5, "dspark_noise_token_id": 95, "dspark_target_layer_ids": [1, 2, 3],
          "dspark_markov_rank": 8}
STAGES = 3


def config(dspark: dict | None = DSPARK, stages: int = STAGES, mtp: bool = False, **overrides) -> dict:
    """config.json in DeepSeek's official form: the tiny target, with the DSpark keys (`dspark`) and
    one 0 per drafter stage in compress_ratios, or the April form (mtp=True: one MTP layer)."""
    c = dict(TARGET, model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], num_key_value_heads=1,
             rope_theta=10000.0, compress_rope_theta=160000.0, max_position_embeddings=4096,
             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                           "beta_fast": 32, "beta_slow": 1},
             routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
             swiglu_limit=10.0, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, num_nextn_predict_layers=1,
             tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
    c.update(overrides)
    extra = stages if dspark else int(mtp)
    c["compress_ratios"] = list(c["compress_ratios"]) + [0] * extra
    if dspark:
        c.update(dspark)
    return c


def _kind(ratio: int, csa: int = 4) -> str:
    return "sliding" if ratio == 0 else "csa" if ratio == csa else "hca"


def names(c: dict, draft: str | None = "dspark", stages: int = STAGES) -> set[str]:
    """Every official tensor name of the folder (no scales): target, and the draft ("dspark", "mtp", None)."""
    n, e = c["num_hidden_layers"], c["n_routed_experts"]
    out = {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}
    for i, r in enumerate(c["compress_ratios"][:n]):
        out |= block_names(f"layers.{i}", _kind(r), i < c["num_hash_layers"], e)
    if draft == "mtp":
        out |= block_names("mtp.0", "sliding", False, e)
        out |= {f"mtp.0.{x}" for x in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight",
                                       "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")}
    if draft == "dspark":
        for s in range(stages):
            out |= block_names(f"mtp.{s}", "sliding", False, e)
        last = f"mtp.{stages - 1}"
        out |= {"mtp.0.main_proj.weight", "mtp.0.main_norm.weight", f"{last}.norm.weight", f"{last}.hc_head_fn",
                f"{last}.hc_head_base", f"{last}.hc_head_scale", f"{last}.markov_head.markov_w1.weight",
                f"{last}.markov_head.markov_w2.weight", f"{last}.confidence_head.proj.weight"}
    return out


def shape(name: str, c: dict) -> tuple[int, ...]:
    """The official shape of `name` ([out, in] for matrices) under config `c`."""
    d, v, hc = c["hidden_size"], c["vocab_size"], c["hc_mult"]
    h, hd, dq = c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    g, do, inter, e = c["o_groups"], c["o_lora_rank"], c["moe_intermediate_size"], c["n_routed_experts"]
    ni, ci, r = c["index_n_heads"], c["index_head_dim"], c.get("dspark_markov_rank", 8)
    m = re.match(r"^layers\.(\d+)\.", name)
    ratio = c["compress_ratios"][int(m.group(1))] if m else 0
    coff = 2 if ratio == 4 else 1
    rules = [
        (r"^(embed|head)\.weight$", (v, d)), (r"hc_head_fn$", (hc, hc * d)), (r"hc_head_base$", (hc,)),
        (r"hc_head_scale$", (1,)), (r"hc_(attn|ffn)_fn$", ((2 + hc) * hc, hc * d)),
        (r"hc_(attn|ffn)_base$", ((2 + hc) * hc,)), (r"hc_(attn|ffn)_scale$", (3,)),
        (r"indexer\.compressor\.(wkv|wgate)\.weight$", (2 * ci, d)), (r"indexer\.compressor\.ape$", (ratio, 2 * ci)),
        (r"indexer\.compressor\.norm\.weight$", (ci,)), (r"indexer\.wq_b\.weight$", (ni * ci, dq)),
        (r"indexer\.weights_proj\.weight$", (ni, d)),
        (r"attn\.compressor\.(wkv|wgate)\.weight$", (coff * hd, d)), (r"attn\.compressor\.ape$", (ratio, coff * hd)),
        (r"attn\.compressor\.norm\.weight$", (hd,)),
        (r"attn\.wq_a\.weight$", (dq, d)), (r"attn\.q_norm\.weight$", (dq,)), (r"attn\.wq_b\.weight$", (h * hd, dq)),
        (r"attn\.wkv\.weight$", (hd, d)), (r"attn\.kv_norm\.weight$", (hd,)),
        (r"attn\.wo_a\.weight$", (g * do, h * hd // g)), (r"attn\.wo_b\.weight$", (d, g * do)),
        (r"attn\.attn_sink$", (h,)),
        (r"ffn\.gate\.weight$", (e, d)), (r"ffn\.gate\.bias$", (e,)),
        (r"ffn\.gate\.tid2eid$", (v, c["num_experts_per_tok"])),
        (r"experts\.(\d+\.)?w[13]\.weight$", (inter, d)), (r"experts\.(\d+\.)?w2\.weight$", (d, inter)),
        (r"main_proj\.weight$", (d, len(c.get("dspark_target_layer_ids", [0])) * d)),
        (r"(e_proj|h_proj)\.weight$", (d, d)),
        (r"markov_w[12]\.weight$", (v, r)), (r"confidence_head\.proj\.weight$", (1, d + r)),
        (r"(^|\.)(norm|attn_norm|ffn_norm|enorm|hnorm|main_norm)\.weight$", (d,)),
    ]
    for pattern, s in rules:
        if re.search(pattern, name):
            return s
    raise KeyError(name)


def random_tensors(c: dict, draft: str | None = "dspark", seed: int = 0, stages: int = STAGES) -> dict[str, np.ndarray]:
    """fp32 (int64 hash tables) tensors of every name, scaled so activations stay near unit size:
    matrices N(0, 1/in), norms 1 + N(0, 0.1²), small biases / APE / mixes, sinks N(0, 0.5²); the
    Markov head large enough to move the argmax."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(names(c, draft, stages)):
        s = shape(name, c)
        if name.endswith("tid2eid"):
            out[name] = np.argsort(rng.random((s[0], c["n_routed_experts"])), axis=-1)[:, : s[1]].astype(np.int64)
            continue
        noise = rng.standard_normal(s)
        if re.search(r"(norm\.weight|hc_\w+_scale)$", name):
            x = 1 + 0.1 * noise
        elif name.endswith("attn_sink"):
            x = 0.5 * noise
        elif name == "embed.weight" or name.endswith("markov_w1.weight"):
            x = noise
        elif len(s) == 2 and not re.search(r"(ape|hc_\w+_fn)$", name):
            x = noise / np.sqrt(s[1])
        else:
            x = 0.1 * noise
        out[name] = x.astype(np.float32)
    return out


def store(tensors: dict[str, np.ndarray], fmt: str) -> tuple[dict[str, Raw], dict[str, np.ndarray]]:
    """-> (stored tensors with scales, what each stored tensor means in fp32). fmt "f32": as given;
    "bf16": the release's dtypes unquantized (BF16 `.weight`s, F32 / I64 rest); "fp4" / "fp8": the
    release's FP8 projections (main_proj too) and FP4 (or FP8 + float32 scale) routed experts."""
    if fmt == "f32":
        return {k: raw("I64" if v.dtype == np.int64 else "F32", v) for k, v in tensors.items()}, dict(tensors)
    if fmt == "bf16":
        stored, ref = {}, {}
        for k, v in tensors.items():
            if k.endswith(".weight"):
                b = v.astype(ml_dtypes.bfloat16)
                stored[k], ref[k] = raw("BF16", b.view(np.uint16)), b.astype(np.float32)
            else:
                stored[k], ref[k] = raw("I64" if v.dtype == np.int64 else "F32", v), v
        return stored, ref
    main = {k: v for k, v in tensors.items() if k.endswith("main_proj.weight")}
    stored, ref = officialize({k: v for k, v in tensors.items() if k not in main}, experts=fmt)
    for k, v in main.items():
        q, s, deq = quant_fp8(v)
        stored[k], stored[k[: -len("weight")] + "scale"], ref[k] = raw(*q), raw(*s), deq
    return stored, ref


def write(path: str, c: dict, stored: dict[str, Raw], quantized: bool = False, target_shards: int = 2) -> None:
    """config.json + the target in `target_shards` files, each `mtp.<s>` stage in a file of its own
    (as the 0731 release puts its stages in the last shards) + the index."""
    os.makedirs(path, exist_ok=True)
    config_json = dict(c, quantization_config=QUANT_CONFIG) if quantized else c
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_json, f)
    groups: dict[str, list[str]] = {}
    target = sorted(k for k in stored if not k.startswith("mtp."))
    for i in range(target_shards):
        groups[f"t{i}"] = target[i::target_shards]
    for k in sorted(k for k in stored if k.startswith("mtp.")):
        groups.setdefault(f"s{int(k.split('.')[1]):03d}", []).append(k)
    files = {g: f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i, g in enumerate(sorted(groups))}
    weight_map = {}
    for g, keys in groups.items():
        write_file(os.path.join(path, files[g]), {k: stored[k] for k in keys})
        weight_map.update(dict.fromkeys(keys, files[g]))
    write_index(path, weight_map)


def write_folder(path: str, fmt: str = "f32", draft: str | None = "dspark", seed: int = 0,
                 **config_overrides) -> tuple[dict, dict[str, np.ndarray]]:
    """Write a whole folder -> (its config, the fp32 meaning of every stored tensor)."""
    c = config(dspark=DSPARK if draft == "dspark" else None, mtp=draft == "mtp", **config_overrides)
    stored, ref = store(random_tensors(c, draft, seed), fmt)
    write(path, c, stored, quantized=fmt in ("fp4", "fp8"))
    return c, ref
