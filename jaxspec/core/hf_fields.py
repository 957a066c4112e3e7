"""The config.json fields DeepSeek-V4 and V4.1 read the same way: key, `ModelConfig` field, type. Each
family gives its own defaults (its release's numbers) for keys a file leaves out."""

from __future__ import annotations

from typing import Any

SHARED = (
    ("vocab_size", "vocab_size", int), ("hidden_size", "hidden_size", int),
    ("num_attention_heads", "num_heads", int), ("q_lora_rank", "q_lora_rank", int), ("o_groups", "o_groups", int),
    ("o_lora_rank", "o_lora_rank", int), ("sliding_window", "sliding_window", int),
    ("index_n_heads", "index_n_heads", int), ("index_head_dim", "index_head_dim", int),
    ("index_topk", "index_topk", int), ("rope_theta", "rope_theta", float),
    ("compress_rope_theta", "compress_rope_theta", float), ("n_routed_experts", "n_routed_experts", int),
    ("num_experts_per_tok", "num_experts_per_tok", int), ("moe_intermediate_size", "moe_intermediate_size", int),
    ("n_shared_experts", "n_shared_experts", int), ("routed_scaling_factor", "routed_scaling_factor", float),
    ("swiglu_limit", "swiglu_limit", float), ("hc_mult", "hc_mult", int),
    ("hc_sinkhorn_iters", "hc_sinkhorn_iters", int), ("hc_eps", "hc_eps", float),
    ("rms_norm_eps", "rms_norm_eps", float), ("max_position_embeddings", "max_position_embeddings", int),
)
V4_DEFAULTS = dict(q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, index_n_heads=64,
                   index_head_dim=128, index_topk=512, rope_theta=10000.0, compress_rope_theta=160000.0,
                   n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048, n_shared_experts=1,
                   routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
                   rms_norm_eps=1e-6, max_position_embeddings=1 << 20)
V41_DEFAULTS = {**V4_DEFAULTS, "q_lora_rank": 1280, "index_n_heads": 32, "n_routed_experts": 384,
                "moe_intermediate_size": 2304, "rms_norm_eps": 1e-20}


def shared_fields(c: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields of `SHARED` read from config.json `c` (`defaults` for the keys it lacks)."""
    return {field: cast(c[key] if key in c else defaults[field]) for key, field, cast in SHARED}


def token_id(value: Any) -> int | None:
    """bos / eos as config.json may write it: an id, a list of ids (the first one), or None."""
    return value if isinstance(value, int) or value is None else int(value[0])
