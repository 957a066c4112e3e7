"""DeepSeek-V4 checkpoint names: the official key of every ModelParams leaf, the HF spelling, and
which tensors the official release stores quantized.

Official spelling (DeepSeek's release, `inference/model.py`; the Hugging Face repos
deepseek-ai/DeepSeek-V4-Flash / -Pro store these names): `embed.weight`, `head.weight`,
`norm.weight`, `hc_head_{fn,base,scale}`, per layer `layers.{i}.attn.{wq_a, q_norm, wq_b, wkv,
kv_norm, wo_a, wo_b}.weight`, `attn.attn_sink`, `attn.compressor.*`, `attn.indexer.*`,
`ffn.gate.{weight, bias | tid2eid}`, `ffn.experts.{e}.w{1,2,3}.weight`, `ffn.shared_experts.*`,
`attn_norm`, `ffn_norm`, `hc_{attn,ffn}_{fn,base,scale}`; the MTP block under `mtp.0.` with
`e_proj`, `h_proj`, `enorm`, `hnorm`, `norm` and its own `hc_head_*`. A quantized weight
`<prefix>.weight` has its scale in `<prefix>.scale`.

HF spelling (transformers' `DeepseekV4ForCausalLM.save_pretrained`, which inverts its conversion
mapping): the same under `model.` (except `head.weight`), with `model.embed_tokens.weight`,
`model.hc_head.hc_{fn,base,scale}`, the attention KV norm as `attn.norm.weight`, and scales as
`<prefix>.weight_scale_inv` (a multiplier despite the name); MTP tensors keep the official names.

Torch Linear weights are [out, in]; ours are [in, out] (x @ W), so matrices are transposed.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from jaxspec.core.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Spec:
    ours: str  # keystr path of the leaf in ModelParams
    kind: str  # "T" (transpose), "copy", "wo_a", "int"
    slot: int | None = None  # expert index into a stacked [E, ...] leaf
    quant: str | None = None  # how the official release stores it: "fp8", "expert" (fp4 / fp8) or None


def to_ckpt(kind: str, x: np.ndarray) -> np.ndarray:
    """Our leaf (one expert's slice for stacked leaves) -> the checkpoint tensor."""
    if kind == "T":
        return np.ascontiguousarray(x.T)
    if kind == "wo_a":  # [g, in, do] -> [g*do, in]
        g, i, do = x.shape
        return np.ascontiguousarray(x.transpose(0, 2, 1).reshape(g * do, i))
    if kind == "int":
        return x.astype(np.int64)
    return x


def ckpt_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if kind == "T":
        return tuple(reversed(shape))
    if kind == "wo_a":
        g, i, do = shape
        return (g * do, i)
    return tuple(shape)


def _block_specs(ck: str, ours: str, kind: str, hash_routed: bool, cfg: ModelConfig) -> dict[str, Spec]:
    s: dict[str, Spec] = {}

    def add(key: str, path: str, how: str, slot: int | None = None, quant: str | None = None) -> None:
        s[f"{ck}.{key}"] = Spec(f"{ours}.{path}", how, slot, quant)

    for name in ("wq_a", "wq_b", "wkv", "wo_b"):
        add(f"attn.{name}.weight", f"attn.{name}", "T", quant="fp8")
    add("attn.wo_a.weight", "attn.wo_a", "wo_a", quant="fp8")
    add("attn.q_norm.weight", "attn.q_norm", "copy")
    add("attn.kv_norm.weight", "attn.kv_norm", "copy")
    add("attn.attn_sink", "attn.sink", "copy")
    comps = []
    g = cfg.geometry(kind)
    if g.compressed:
        comps.append(("attn.compressor", "attn.compressor"))
    if g.indexed:
        comps.append(("attn.indexer.compressor", "attn.indexer.compressor"))
        add("attn.indexer.wq_b.weight", "attn.indexer.wq_b", "T", quant="fp8")
        add("attn.indexer.weights_proj.weight", "attn.indexer.weights_proj", "T")
    for c_ck, c_ours in comps:
        add(f"{c_ck}.wkv.weight", f"{c_ours}.wkv", "T")
        add(f"{c_ck}.wgate.weight", f"{c_ours}.wgate", "T")
        add(f"{c_ck}.ape", f"{c_ours}.ape", "copy")
        add(f"{c_ck}.norm.weight", f"{c_ours}.norm", "copy")
    add("attn_norm.weight", "attn_norm", "copy")
    add("ffn_norm.weight", "ffn_norm", "copy")
    for hc in ("attn", "ffn"):
        add(f"hc_{hc}_fn", f"hc_{hc}.fn", "T")
        add(f"hc_{hc}_base", f"hc_{hc}.base", "copy")
        add(f"hc_{hc}_scale", f"hc_{hc}.scale", "copy")
    add("ffn.gate.weight", "ffn.gate", "T")
    if hash_routed:
        add("ffn.gate.tid2eid", "ffn.tid2eid", "int")
    else:
        add("ffn.gate.bias", "ffn.gate_bias", "copy")
    for e in range(cfg.n_routed_experts):
        for w in ("w1", "w2", "w3"):
            add(f"ffn.experts.{e}.{w}.weight", f"ffn.experts.{w}", "T", e, quant="expert")
    if cfg.n_shared_experts:
        for w in ("w1", "w2", "w3"):
            add(f"ffn.shared_experts.{w}.weight", f"ffn.shared.{w}", "T", quant="fp8")
    return s


def key_table(cfg: ModelConfig) -> dict[str, Spec]:
    """Official-spelling checkpoint key -> where it goes in ModelParams (and how it is stored)."""
    t: dict[str, Spec] = {
        "embed.weight": Spec(".embed", "copy"),
        "head.weight": Spec(".head", "T"),
        "norm.weight": Spec(".norm", "copy"),
        "hc_head_fn": Spec(".hc_head.fn", "T"),
        "hc_head_base": Spec(".hc_head.base", "copy"),
        "hc_head_scale": Spec(".hc_head.scale", "copy"),
    }
    for i, kind in enumerate(cfg.layer_types):
        t.update(_block_specs(f"layers.{i}", f".layers[{i}]", kind, i < cfg.num_hash_layers, cfg))
    if cfg.has_mtp:
        t.update({
            "mtp.0.e_proj.weight": Spec(".mtp.inputs.e_proj", "T", quant="fp8"),
            "mtp.0.h_proj.weight": Spec(".mtp.inputs.h_proj", "T", quant="fp8"),
            "mtp.0.enorm.weight": Spec(".mtp.inputs.enorm", "copy"),
            "mtp.0.hnorm.weight": Spec(".mtp.inputs.hnorm", "copy"),
            "mtp.0.norm.weight": Spec(".mtp.norm", "copy"),
            "mtp.0.hc_head_fn": Spec(".mtp.hc_head.fn", "T"),
            "mtp.0.hc_head_base": Spec(".mtp.hc_head.base", "copy"),
            "mtp.0.hc_head_scale": Spec(".mtp.hc_head.scale", "copy"),
        })
        t.update(_block_specs("mtp.0", ".mtp.block", "sliding", False, cfg))
    return t


_DSPARK_HEADS = re.compile(r"^mtp\.\d+\.(markov_head|confidence_head)\.")
_STAGE = re.compile(r"^mtp\.(\d+)\.")


def draft_kind(config: dict[str, Any], keys: Any) -> str | None:
    """The draft a V4 folder holds, from config.json and its official-spelling tensor names
    (docs/dspark.md, "What a release holds"): "dspark" (config `dspark_block_size` > 0, or `mtp.0.main_proj`, or
    Markov / confidence heads), else "mtp" (the April block: `mtp.0.e_proj`, ...; any other `mtp.*`
    tensor is read as a damaged MTP block), else None. Never `num_nextn_predict_layers`: it is 1
    in the DSpark releases too."""
    block = config.get("dspark_block_size")
    keys = set(keys)
    if (isinstance(block, int) and not isinstance(block, bool) and block > 0) or "mtp.0.main_proj.weight" in keys \
            or any(_DSPARK_HEADS.match(k) for k in keys):
        return "dspark"
    return "mtp" if any(k.startswith("mtp.") for k in keys) else None


def draft_stages(keys: Any) -> int:
    """Number of distinct `mtp.<s>.` stages among the tensor names."""
    return len({m.group(1) for k in keys if (m := _STAGE.match(k))})


def dspark_key_table(cfg: ModelConfig, num_stages: int) -> dict[str, Spec]:
    """Official key -> DSparkParams leaf (`model.dspark`) of a DSpark drafter of `num_stages` stages:
    full blocks `mtp.{s}.*` (score-routed MoE), `main_proj` / `main_norm` on stage 0, `norm`,
    `hc_head_*`, the Markov and confidence heads on the last stage (docs/dspark.md)."""
    last = f"mtp.{num_stages - 1}"
    t: dict[str, Spec] = {
        "mtp.0.main_proj.weight": Spec(".main_proj", "T", quant="fp8"),
        "mtp.0.main_norm.weight": Spec(".main_norm", "copy"),
        f"{last}.norm.weight": Spec(".norm", "copy"),
        f"{last}.hc_head_fn": Spec(".hc_head.fn", "T"),
        f"{last}.hc_head_base": Spec(".hc_head.base", "copy"),
        f"{last}.hc_head_scale": Spec(".hc_head.scale", "copy"),
        f"{last}.markov_head.markov_w1.weight": Spec(".markov_w1", "copy"),  # an embedding table [V, r]
        f"{last}.markov_head.markov_w2.weight": Spec(".markov_w2", "T"),  # Linear(r -> V): [V, r]
        f"{last}.confidence_head.proj.weight": Spec(".confidence", "T"),  # Linear(d + r -> 1): [1, d + r]
    }
    for s in range(num_stages):
        t.update(_block_specs(f"mtp.{s}", f".stages[{s}]", "sliding", False, cfg))
    return t


def scale_key(weight_key: str) -> str:
    """`<prefix>.weight` -> `<prefix>.scale` (official); others have no scale."""
    return weight_key[: -len("weight")] + "scale" if weight_key.endswith(".weight") else weight_key + ".scale"


_HF_RENAMES = (
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$"), r"\1.kv_norm.weight"),
)


def normalize_key(key: str) -> str:
    """HF save_pretrained spelling -> official spelling (official keys pass through unchanged)."""
    if key.endswith(".weight_scale_inv"):
        key = key[: -len("weight_scale_inv")] + "scale"
    if key.startswith("model."):
        key = key[len("model."):]
        for pattern, repl in _HF_RENAMES:
            key = pattern.sub(repl, key)
    return key


def hf_key(key: str) -> str:
    """Official spelling -> HF save_pretrained spelling (MTP tensors keep the official form)."""
    if key.endswith(".scale"):  # hc_*_scale end in "_scale": not quantization scales
        key = key[: -len("scale")] + "weight_scale_inv"
    if key == "head.weight" or key.startswith("mtp."):
        return key
    if key == "embed.weight":
        return "model.embed_tokens.weight"
    m = re.match(r"^hc_head_(fn|base|scale)$", key)
    if m:
        return f"model.hc_head.hc_{m.group(1)}"
    key = re.sub(r"^(layers\.\d+\.attn)\.kv_norm\.weight$", r"\1.norm.weight", key)
    return "model." + key


def official_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json in DeepSeek's form: `compress_ratios` (one per layer, then 0 per MTP layer)."""
    c = cfg.to_hf_config()
    del c["layer_types"], c["compress_rates"]
    c["compress_ratios"] = [cfg.ratio(i) for i in range(cfg.num_layers)] + [0] * cfg.num_mtp_layers
    c["compress_rate_csa"] = cfg.csa_ratio
    c["compress_rate_hca"] = cfg.hca_ratio
    return c
