"""Static model config (the speculation shape, `SpecConfig`, is `jaxspec.core.spec`).

`ModelConfig` is frozen and hashable so it can be a static argument of `jax.jit`: every shape in
the model is a function of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.core.checks import is_int, is_power_of_two, positive_int
from jaxspec.core.hf_fields import V4_DEFAULTS, shared_fields, token_id
from jaxspec.core.v41 import (
    V41Layout,
    is_v41_config,
    v41_config_fields,
    v41_preset_fields,
    v41_text_config,
    validate_v41,
)

LAYER_TYPES = ("sliding", "csa", "hca", "pool2", "pool1")  # pool2 / pool1: V4.1's ratio-2 / ratio-1 layers
_HF_LAYER_TYPES = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
KERNELS = ("xla", "pallas")
# How a model is run, not what it computes: a static choice of the program (so jit keys on it), never
# written with a checkpoint nor read from one, never part of a fingerprint (`ModelConfig.architecture`).
RUN_OPTIONS = ("kernels", "prefill_chunk")
DTYPES = ("float32", "bfloat16")


def pooling_coff(overlap: bool) -> int:
    """Compressor rows per entry, in units of the ratio: CSA's overlapping windows pool two blocks
    (the previous block's A half and its own B half), HCA's one."""
    return 2 if overlap else 1


@dataclasses.dataclass(frozen=True)
class LayerGeometry:
    """What a layer's kind fixes, derived from the config in one place (`ModelConfig.geometry`)."""

    kind: str  # "sliding" / "csa" / "hca"
    ratio: int  # tokens per compressed entry; 0 = the sliding window only
    indexed: bool  # a lightning indexer picks top-k entries (CSA); else every entry is read (HCA)

    @property
    def compressed(self) -> bool:
        return self.ratio > 0

    @property
    def overlap(self) -> bool:  # CSA's pooling windows overlap
        return self.indexed

    @property
    def coff(self) -> int:  # 0 for a window-only layer
        return pooling_coff(self.overlap) if self.compressed else 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]  # one of LAYER_TYPES per main layer
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # YaRN on compressed layers; factor None disables it.
    yarn_factor: float | None = 16.0
    yarn_original_max_position: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    num_hash_layers: int = 3
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    num_mtp_layers: int = 1  # 0 = checkpoint without an MTP block (no speculation)
    max_position_embeddings: int = 1 << 20
    dtype: str = "float32"
    bos_id: int | None = None
    eos_id: int | None = None
    # DeepSeek-V4.1's layer roles (shared pools, indexer sources, candidate blocks, Engram); None = V4.
    v41: V41Layout | None = None
    # ---- run options (RUN_OPTIONS): how the program runs, never saved with the model ----
    kernels: str = "xla"  # "pallas": every op with a Pallas kernel runs it (compiled on GPUs); "xla": the jnp paths
    # Tokens per prefill chunk (a power of two); 0 = the default `jaxspec.model.prefill.prefill_chunk` picks.
    prefill_chunk: int = 0

    def __post_init__(self):
        _validate_model_config(self)

    # ---- derived ----------------------------------------------------------------------------
    def geometry(self, kind: str) -> LayerGeometry:
        """Ratio, pooling overlap and indexer of a layer kind ("sliding" for the MTP block)."""
        if kind not in LAYER_TYPES:
            raise ValueError(f"unknown layer kind {kind!r}; allowed: {LAYER_TYPES}")
        ratio = {"sliding": 0, "csa": self.csa_ratio, "hca": self.hca_ratio, "pool2": 2, "pool1": 1}[kind]
        return LayerGeometry(kind=kind, ratio=ratio, indexed=kind == "csa")

    def ratio(self, layer: int) -> int:
        """Compression ratio of a main layer (0 = sliding window only)."""
        return self.geometry(self.layer_types[layer]).ratio

    @property
    def has_mtp(self) -> bool:
        return self.num_mtp_layers > 0

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def architecture(self) -> dict[str, Any]:
        """The fields that say what the model computes (`dataclasses.asdict` without `RUN_OPTIONS`):
        what a checkpoint's config.json holds."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in RUN_OPTIONS}

    # ---- constructors -----------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; allowed: {sorted(_PRESETS)}")
        return dataclasses.replace(_PRESETS[name], **overrides)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], **overrides: Any) -> ModelConfig:
        """Build from a DeepSeek-V4 `config.json` dict, official or HF transformers form."""
        return _from_hf_config(config, **overrides)

    def to_hf_config(self) -> dict[str, Any]:
        """The HF transformers form (`layer_types` + `compress_rates`) of this config."""
        inverse = {v: k for k, v in _HF_LAYER_TYPES.items()}
        out: dict[str, Any] = {
            "model_type": "deepseek_v4",
            "architectures": ["DeepseekV4ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "layer_types": [inverse[t] for t in self.layer_types],
            "compress_rates": {
                "compressed_sparse_attention": self.csa_ratio,
                "heavily_compressed_attention": self.hca_ratio,
            },
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_shared_experts": self.n_shared_experts,
            "num_hash_layers": self.num_hash_layers,
            "routed_scaling_factor": self.routed_scaling_factor,
            "scoring_func": "sqrtsoftplus",
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "num_nextn_predict_layers": self.num_mtp_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
        }
        if self.yarn_factor is not None:
            out["rope_scaling"] = {
                "type": "yarn",
                "factor": self.yarn_factor,
                "original_max_position_embeddings": self.yarn_original_max_position,
                "beta_fast": self.yarn_beta_fast,
                "beta_slow": self.yarn_beta_slow,
            }
        return out


def _validate_model_config(cfg: ModelConfig) -> None:
    for name in (
        "vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank",
        "o_groups", "o_lora_rank", "sliding_window", "csa_ratio", "hca_ratio", "index_n_heads",
        "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
        "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings",
    ):
        positive_int(name, getattr(cfg, name))
    if not isinstance(cfg.layer_types, tuple) or len(cfg.layer_types) != cfg.num_layers:
        raise ValueError(
            f"layer_types must be a tuple of num_layers={cfg.num_layers} entries, got {cfg.layer_types!r}"
        )
    bad = [t for t in cfg.layer_types if t not in LAYER_TYPES]
    if bad:
        raise ValueError(f"layer_types entries must be one of {LAYER_TYPES}, got {bad}")
    if cfg.rope_head_dim < 2 or cfg.rope_head_dim % 2 or cfg.rope_head_dim > cfg.head_dim:
        raise ValueError(
            f"rope_head_dim must be even and in [2, head_dim={cfg.head_dim}], got {cfg.rope_head_dim}"
        )
    if cfg.rope_head_dim > cfg.index_head_dim:
        raise ValueError(
            f"rope_head_dim ({cfg.rope_head_dim}) must be <= index_head_dim ({cfg.index_head_dim})"
        )
    if cfg.num_heads % cfg.o_groups:
        raise ValueError(f"num_heads ({cfg.num_heads}) must be divisible by o_groups ({cfg.o_groups})")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ValueError(
            f"num_experts_per_tok ({cfg.num_experts_per_tok}) must be <= n_routed_experts "
            f"({cfg.n_routed_experts})"
        )
    if not 0 <= cfg.num_hash_layers <= cfg.num_layers:
        raise ValueError(f"num_hash_layers must be in [0, num_layers], got {cfg.num_hash_layers}")
    if cfg.num_mtp_layers not in (0, 1):
        raise ValueError(f"num_mtp_layers must be 0 or 1, got {cfg.num_mtp_layers}")
    if cfg.n_shared_experts not in (0, 1):
        raise ValueError(f"n_shared_experts must be 0 or 1, got {cfg.n_shared_experts}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {cfg.dtype!r}")
    if cfg.kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {cfg.kernels!r}")
    chunk = cfg.prefill_chunk
    if chunk != 0 and not is_power_of_two(chunk):
        raise ValueError(f"prefill_chunk must be 0 (default) or a power of two >= 1, got {chunk!r}")
    if cfg.yarn_factor is not None and cfg.yarn_factor <= 0:
        raise ValueError(f"yarn_factor must be > 0 or None, got {cfg.yarn_factor}")
    pooled = [t for t in cfg.layer_types if t in ("pool2", "pool1")]
    if cfg.v41 is None and pooled:
        raise ValueError("layer kinds pool2 / pool1 are V4.1's: give the config its V41Layout (v41=)")
    if cfg.v41 is not None:
        if not isinstance(cfg.v41, V41Layout):
            raise ValueError(f"v41 must be a V41Layout, got {type(cfg.v41).__name__}")
        validate_v41(cfg.v41, cfg.num_layers)
        if cfg.layer_types != tuple(cfg.v41.kind(i) for i in range(cfg.num_layers)):
            raise ValueError("a V4.1 config's layer_types must follow its ratios (sliding / pool2 / pool1)")
        if cfg.num_hash_layers or cfg.num_mtp_layers:
            raise ValueError("V4.1 has no hash-routed layers and no MTP block (num_hash_layers = num_mtp_layers = 0)")


def _ratio_to_layer_type(ratio: Any, csa_ratio: int) -> str:
    if not is_int(ratio) or ratio < 0:
        raise ValueError(f"compress_ratios entries must be 0 or a positive int, got {ratio!r}")
    if ratio == 0:
        return "sliding"
    return "csa" if ratio == csa_ratio else "hca"


def _hf_layer_types(c: dict[str, Any], n: int) -> tuple[tuple[str, ...], int, int]:
    """-> (layer kinds, CSA ratio, HCA ratio) from HF's `layer_types` or the release's `compress_ratios`."""
    rates = dict(c.get("compress_rates") or {})
    csa_ratio = int(rates.get("compressed_sparse_attention", c.get("compress_rate_csa", 4)))
    if "layer_types" in c and c["layer_types"] is not None:
        bad = [t for t in c["layer_types"] if t not in _HF_LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types entries must be one of {sorted(_HF_LAYER_TYPES)}, got {bad}")
        layer_types = tuple(_HF_LAYER_TYPES[t] for t in c["layer_types"][:n])
        hca_ratio = int(rates.get("heavily_compressed_attention", c.get("compress_rate_hca", 128)))
    elif "compress_ratios" in c:
        ratios = list(c["compress_ratios"])
        if len(ratios) < n:
            raise ValueError(f"compress_ratios has {len(ratios)} entries, need >= num_hidden_layers={n}")
        layer_types = tuple(_ratio_to_layer_type(r, csa_ratio) for r in ratios[:n])
        hca = {r for r in ratios[:n] if r not in (0, csa_ratio)}
        if len(hca) > 1:
            raise ValueError(f"compress_ratios may hold one HCA ratio, got {sorted(hca)}")
        hca_ratio = hca.pop() if hca else int(c.get("compress_rate_hca", 128))
        mtp_ratios = ratios[n:]
        if any(r != 0 for r in mtp_ratios):
            raise ValueError(f"MTP layers must be sliding-window only (ratio 0), got {mtp_ratios}")
    else:
        raise ValueError("config.json needs `layer_types` (HF form) or `compress_ratios` (official form)")
    return layer_types, csa_ratio, hca_ratio


def _hf_yarn(c: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's YaRN fields from `rope_scaling` or `rope_parameters.compress` (None: no scaling)."""
    yarn = c.get("rope_scaling")
    rp = c.get("rope_parameters")
    if yarn is None and isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        comp = rp["compress"]
        if comp.get("rope_type", comp.get("type")) == "yarn":
            yarn = comp
    yarn_kwargs: dict[str, Any] = {"yarn_factor": None}
    if yarn:
        kind = yarn.get("rope_type", yarn.get("type"))
        if kind != "yarn":
            raise ValueError(f"only YaRN rope scaling is supported, got {kind!r}")
        yarn_kwargs = {
            "yarn_factor": float(yarn["factor"]),
            "yarn_original_max_position": int(yarn["original_max_position_embeddings"]),
            "yarn_beta_fast": float(yarn.get("beta_fast") or 32),
            "yarn_beta_slow": float(yarn.get("beta_slow") or 1),
        }
    return yarn_kwargs


def _from_v41_config(c: dict[str, Any], **overrides: Any) -> ModelConfig:
    kwargs = v41_config_fields(c)
    kwargs.update(_hf_yarn(v41_text_config(c)), **overrides)
    return ModelConfig(**kwargs)


def _from_hf_config(c: dict[str, Any], **overrides: Any) -> ModelConfig:
    if not isinstance(c, dict):
        raise ValueError(f"config must be a dict, got {type(c).__name__}")
    if is_v41_config(c):
        return _from_v41_config(c, **overrides)
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in c]
    if missing:
        raise ValueError(f"config.json is missing required keys {missing}")
    n = c["num_hidden_layers"]
    layer_types, csa_ratio, hca_ratio = _hf_layer_types(c, n)
    head_dim = int(c.get("head_dim", 512))
    if "qk_rope_head_dim" in c:
        rope_head_dim = int(c["qk_rope_head_dim"])
    elif c.get("partial_rotary_factor"):
        rope_head_dim = int(head_dim * c["partial_rotary_factor"])
    else:
        rope_head_dim = 64
    if "num_hash_layers" in c:
        num_hash = int(c["num_hash_layers"])
    elif c.get("mlp_layer_types"):
        types = list(c["mlp_layer_types"])
        num_hash = sum(1 for t in types if t == "hash_moe")
        if types[:num_hash] != ["hash_moe"] * num_hash:
            raise ValueError("hash_moe layers must come first in mlp_layer_types")
    else:
        num_hash = 3
    yarn_kwargs = _hf_yarn(c)
    scoring = c.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ValueError(f"scoring_func must be 'sqrtsoftplus', got {scoring!r}")
    if c.get("num_key_value_heads", 1) != 1:
        raise ValueError("DeepSeek-V4 uses one shared K=V head; num_key_value_heads must be 1")
    kwargs = dict(
        shared_fields(c, V4_DEFAULTS),
        num_layers=int(n),
        head_dim=head_dim,
        rope_head_dim=rope_head_dim,
        layer_types=layer_types,
        csa_ratio=csa_ratio,
        hca_ratio=hca_ratio,
        num_hash_layers=num_hash,
        num_mtp_layers=int(c.get("num_nextn_predict_layers", 1)),
        bos_id=c.get("bos_token_id"),
        eos_id=token_id(c.get("eos_token_id")),
        **yarn_kwargs,
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def _flash() -> ModelConfig:
    return ModelConfig(
        vocab_size=129280, hidden_size=4096, num_layers=43, num_heads=64, head_dim=512,
        rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
        layer_types=("sliding", "sliding") + ("csa", "hca") * 20 + ("csa",),
        csa_ratio=4, hca_ratio=128, index_n_heads=64, index_head_dim=128, index_topk=512,
        n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048,
        routed_scaling_factor=1.5, num_hash_layers=3, dtype="bfloat16", bos_id=0, eos_id=1,
    )


def _pro() -> ModelConfig:
    return ModelConfig(
        vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, head_dim=512,
        rope_head_dim=64, q_lora_rank=1536, o_groups=16, o_lora_rank=1024, sliding_window=128,
        layer_types=("hca", "hca") + ("csa", "hca") * 29 + ("csa",),
        csa_ratio=4, hca_ratio=128, index_n_heads=64, index_head_dim=128, index_topk=1024,
        n_routed_experts=384, num_experts_per_tok=6, moe_intermediate_size=3072,
        routed_scaling_factor=2.5, num_hash_layers=3, dtype="bfloat16", bos_id=0, eos_id=1,
    )


# `test`: window 8, CSA 4, HCA 16 so sequences of a few dozen tokens cross every boundary.
_TEST = ModelConfig(
    vocab_size=96, hidden_size=32, num_layers=4, num_heads=4, head_dim=32, rope_head_dim=8,
    q_lora_rank=16, o_groups=2, o_lora_rank=16, sliding_window=8,
    layer_types=("sliding", "csa", "hca", "csa"), csa_ratio=4, hca_ratio=16,
    index_n_heads=4, index_head_dim=16, index_topk=3,
    yarn_factor=4.0, yarn_original_max_position=64,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1,
    max_position_embeddings=4096,
)

# `tiny`: the CPU-trainable size; window 32 and HCA 16 so a prompt + 128 new tokens crosses the
# window and several CSA and HCA blocks.
_TINY = ModelConfig(
    vocab_size=2048, hidden_size=256, num_layers=6, num_heads=8, head_dim=64, rope_head_dim=16,
    q_lora_rank=96, o_groups=2, o_lora_rank=64, sliding_window=32,
    layer_types=("sliding", "csa", "hca", "csa", "hca", "csa"), csa_ratio=4, hca_ratio=16,
    index_n_heads=4, index_head_dim=32, index_topk=8,
    yarn_factor=4.0, yarn_original_max_position=1024,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, num_hash_layers=1,
    max_position_embeddings=8192,
)

_PRESETS = {"test": _TEST, "tiny": _TINY, "v4-flash": _flash(), "v4-pro": _pro(),
            **{name: ModelConfig(**v41_preset_fields(name)) for name in ("v41-flash", "v41-test", "tiny-v41")}}
