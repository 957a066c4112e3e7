"""DeepSeek-V4.1's layer roles and config fields (docs/v41.md): the part of `ModelConfig` only V4.1 has.

`ModelConfig.v41` holds a `V41Layout`; a V4 config has None there and behaves as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.core.checks import positive_int
from jaxspec.core.hf_fields import V41_DEFAULTS, shared_fields, token_id

ENGRAM_ROW_PAD = 64


@dataclasses.dataclass(frozen=True)
class V41Layout:
    """DeepSeek-V4.1's layer roles (docs/v41.md). Layer i compresses every `ratios[i]` tokens (0: window
    only); only the kv sources own a compressor (pool and index keys), the layers after one read its
    pool; only the index sources run an indexer, the others reuse the last one's top-k; the candidate
    source keeps `candidate_topk_blocks` blocks of `candidate_block_size` entries that the index sources
    after it choose inside (the two-level top-k); Engram layers add hashed n-gram rows to the stream."""

    ratios: tuple[int, ...]  # per main layer: 0, 2 or 1
    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    candidate_source: int = -1  # -1: no two-level top-k
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    engram_layers: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()  # table rows per Engram layer (the sum of its bucket primes)
    engram_max_ngram: int = 4  # n-grams of 2 .. max tokens
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16_000_000  # the bucket primes are the first ones above this
    engram_compressed_vocab: int = 99092  # classes of the tokenizer-normalized id map
    engram_pad_id: int = 2  # token whose class pads n-grams before the sequence start
    # The QAT roundings of activations, KV, pools and index q / k (the released model: on). Off: the
    # continuous model, for checks of the decode machinery to float32 precision (docs/v41.md).
    qat: bool = True

    def kind(self, layer: int) -> str:
        return {0: "sliding", 2: "pool2", 1: "pool1"}[self.ratios[layer]]

    def owner(self, layer: int) -> int:
        """The kv source whose pool a compressed layer reads (its own id on a kv source)."""
        return max(s for s in self.kv_sources if s <= layer)

    def index_source(self, layer: int) -> int:
        """The indexer whose top-k a compressed layer reads (its own id on an index source)."""
        return max(s for s in self.index_sources if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        """An index source after the candidate source chooses only inside its candidate blocks."""
        return 0 <= self.candidate_source < layer and layer in self.index_sources

    def engram_table_rows(self, layer: int) -> int:
        """Rows of Engram layer `layer`'s table as held: the config's count padded to a multiple of
        ENGRAM_ROW_PAD, so that the rows split evenly over any mesh of up to that many devices (the
        counts are sums of primes; padding rows are never read)."""
        n = self.engram_num_embeddings[self.engram_layers.index(layer)]
        return -(-n // ENGRAM_ROW_PAD) * ENGRAM_ROW_PAD

    @property
    def engram_hash_columns(self) -> int:  # table rows one token reads per Engram layer
        return (self.engram_max_ngram - 1) * self.engram_n_heads


def validate_v41(v: V41Layout, num_layers: int) -> None:
    if len(v.ratios) != num_layers or any(r not in (0, 1, 2) for r in v.ratios):
        raise ValueError(f"V4.1 compress ratios must be {num_layers} entries of 0, 2 or 1, got {v.ratios}")
    compressed = [i for i, r in enumerate(v.ratios) if r]
    for name, ids in (("kv_source_layer_ids", v.kv_sources), ("index_source_layer_ids", v.index_sources)):
        bad = [i for i in ids if not (0 <= i < num_layers and v.ratios[i])]
        if bad or list(ids) != sorted(set(ids)):
            raise ValueError(f"{name} must be increasing ids of compressed layers, got {list(ids)}")
    missing = [i for i in v.kv_sources if i not in v.index_sources]
    if missing:
        raise ValueError(f"every kv source publishes index keys, so it must be an index source; not: {missing}")
    for i in compressed:
        if not any(s <= i for s in v.kv_sources):
            raise ValueError(f"compressed layer {i} has no kv source at or before it")
        owner = max(s for s in v.kv_sources if s <= i)
        if v.ratios[owner] != v.ratios[i]:
            raise ValueError(
                f"layer {i} (ratio {v.ratios[i]}) reads the pool of layer {owner} (ratio {v.ratios[owner]})")
        if max(s for s in v.index_sources if s <= i) < owner:
            raise ValueError(f"layer {i} would reuse a top-k over another pool than its owner {owner}'s")
    if v.candidate_source != -1:
        if v.candidate_source not in v.index_sources:
            raise ValueError(f"candidate_source_layer_id {v.candidate_source} must be an index source")
        positive_int("candidate_topk_blocks", v.candidate_topk_blocks)
        positive_int("candidate_block_size", v.candidate_block_size)
    if len(v.engram_num_embeddings) != len(v.engram_layers):
        raise ValueError("engram_num_embeddings needs one entry per Engram layer")
    bad = [i for i in v.engram_layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"engram_layer_ids must be main layers, got {bad}")
    if v.engram_layers:
        for name in ("engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab"):
            positive_int(name, getattr(v, name))
        if v.engram_max_ngram < 2:
            raise ValueError(f"engram_max_ngram_size must be >= 2, got {v.engram_max_ngram}")
        if v.engram_compressed_vocab >= 1 << 24:
            raise ValueError("engram_compressed_vocab_size must be < 2^24 (the hash's exact 32-bit limbs)")


def is_v41_config(c: dict[str, Any]) -> bool:
    """Whether a config.json dict is DeepSeek-V4.1's (its own model_type, or V4.1-only fields)."""
    kind = str(c.get("model_type", ""))
    return kind.startswith("deepseek_v41") or "kv_source_layer_ids" in c or "text_config" in c


# DeepSeek's reference (`inference/config.json`, ModelArgs) names some fields its own way; a file may use
# either spelling (release -> reference).
REFERENCE_NAMES = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
    "moe_intermediate_size": "moe_inter_dim", "num_experts_per_tok": "n_activated_experts",
    "routed_scaling_factor": "route_scale", "scoring_func": "score_func", "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps", "sliding_window": "window_size", "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers", "candidate_source_layer_id": "candidate_source_layer",
    "num_nextn_predict_layers": "n_mtp_layers", "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "engram_pad_token_id": "engram_pad_id",
}


def v41_text_config(c: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields of a V4.1 `config.json` (under `text_config`, or the dict itself) in the
    release's spelling: a field given only under the reference's name is read from it, and the reference's
    YaRN fields (`rope_factor`, `original_seq_len`, `beta_fast`, `beta_slow`) become `rope_scaling` when the
    file has none. A field spelled both ways with two values is a one-line error."""
    text = dict(c.get("text_config") or c)
    for name, ref in REFERENCE_NAMES.items():
        if ref in text:
            if name in text and text[name] != text[ref]:
                raise ValueError(f"config.json gives {name}={text[name]!r} and its reference spelling "
                                 f"{ref}={text[ref]!r}")
            text.setdefault(name, text[ref])
    if "rope_scaling" not in text and "rope_factor" in text and float(text["rope_factor"]) > 1:
        if "original_seq_len" not in text:
            raise ValueError("config.json has rope_factor but no original_seq_len (the reference's YaRN fields)")
        text["rope_scaling"] = {"rope_type": "yarn", "factor": float(text["rope_factor"]),
                                "original_max_position_embeddings": int(text["original_seq_len"]),
                                "beta_fast": text.get("beta_fast", 32), "beta_slow": text.get("beta_slow", 1)}
    return text


def v41_config_fields(c: dict[str, Any]) -> dict[str, Any]:
    """`ModelConfig` fields (all but YaRN's) of a DeepSeek-V4.1 release `config.json` (the text model under
    `text_config`, top-level ids) or its text_config alone; the reference's field names are read too
    (`v41_text_config`)."""
    text = v41_text_config(c)
    top = c if "text_config" in c else {}
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids") if k not in text]
    if missing:
        raise ValueError(f"V4.1 config.json (text_config) is missing required keys {missing}")
    n = int(text["num_hidden_layers"])
    ratios = tuple(int(r) for r in text["compress_ratios"][:n])
    if len(ratios) < n:
        raise ValueError(f"compress_ratios has {len(ratios)} entries, need >= num_hidden_layers={n}")
    if any(r != 0 for r in text["compress_ratios"][n:]):
        raise ValueError("the DSpark stages after the main layers must be window-only (ratio 0)")
    if text.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ValueError(f"scoring_func must be 'sqrtsoftplus', got {text.get('scoring_func')!r}")
    if text.get("num_key_value_heads", 1) != 1:
        raise ValueError("DeepSeek-V4.1 uses one shared K=V head; num_key_value_heads must be 1")
    if float(text.get("gate_temp", 1.0)) != 1.0:
        raise ValueError(f"gate_temp other than 1.0 is not supported, got {text['gate_temp']}")
    engram_layers = tuple(int(i) for i in text.get("engram_layer_ids", ()))
    layout = V41Layout(
        ratios=ratios,
        kv_sources=tuple(int(i) for i in text["kv_source_layer_ids"]),
        index_sources=tuple(int(i) for i in text["index_source_layer_ids"]),
        candidate_source=int(text.get("candidate_source_layer_id", -1)),
        candidate_topk_blocks=int(text.get("candidate_topk_blocks", 2048)),
        candidate_block_size=int(text.get("candidate_block_size", 8)),
        engram_layers=engram_layers,
        engram_num_embeddings=tuple(int(x) for x in text.get("engram_num_embeddings", ())),
        engram_max_ngram=int(text.get("engram_max_ngram_size", 4)),
        engram_n_heads=int(text.get("engram_n_heads", 8)),
        engram_head_dim=int(text.get("engram_head_dim", 256)),
        engram_vocab_size=int(text.get("engram_vocab_size", 16_000_000)),
        engram_compressed_vocab=int(text.get("engram_compressed_vocab_size", 99092)),
        engram_pad_id=int(text.get("engram_pad_token_id", 2)),
    )
    validate_v41(layout, n)
    kwargs = dict(
        shared_fields(text, V41_DEFAULTS),
        num_layers=n,
        head_dim=int(text.get("head_dim", 512)),
        rope_head_dim=int(text.get("qk_rope_head_dim", 64)),
        layer_types=tuple(layout.kind(i) for i in range(n)),
        num_hash_layers=0,
        num_mtp_layers=0,
        bos_id=token_id(top.get("bos_token_id", text.get("bos_token_id"))),
        eos_id=token_id(top.get("eos_token_id", text.get("eos_token_id"))),
        v41=layout,
    )
    return kwargs


def _v41_flash() -> dict[str, Any]:
    ratios = (0, 0) + (2,) * 18 + (1,) * 20
    layout = V41Layout(
        ratios=ratios, kv_sources=(2, 8, 14, 20), index_sources=(2, 8, 14, 20, 24, 28, 32, 36),
        candidate_source=20, candidate_topk_blocks=2048, candidate_block_size=8,
        engram_layers=(1, 14), engram_num_embeddings=(384006168, 384016682),
    )
    return dict(
        vocab_size=129280, hidden_size=5120, num_layers=40, num_heads=64, head_dim=512,
        rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024, sliding_window=128,
        layer_types=tuple(layout.kind(i) for i in range(40)),
        index_n_heads=32, index_head_dim=128, index_topk=512,
        n_routed_experts=384, num_experts_per_tok=6, moe_intermediate_size=2304,
        routed_scaling_factor=1.5, num_hash_layers=0, rms_norm_eps=1e-20, num_mtp_layers=0,
        dtype="bfloat16", bos_id=0, eos_id=1, v41=layout,
    )


# `v41-test`: every V4.1 layer kind in 8 layers (window, window + Engram, ratio-2 owner, reuse,
# reuse + Engram, ratio-1 owner and candidate source, reuse, re-indexing inside the candidates);
# window 8, top-6 of 3 candidate blocks of 4, 2- and 3-grams in 2 heads. The index heads are 16
# because all-zero (ReLU) scores tie with probability 2^-heads and a tie is implementation-defined.
_V41_TEST_LAYOUT = V41Layout(
    ratios=(0, 0, 2, 2, 2, 1, 1, 1), kv_sources=(2, 5), index_sources=(2, 5, 7),
    candidate_source=5, candidate_topk_blocks=3, candidate_block_size=4,
    engram_layers=(1, 4), engram_num_embeddings=(290, 370), engram_max_ngram=3, engram_n_heads=2,
    engram_head_dim=32, engram_vocab_size=64, engram_compressed_vocab=200, engram_pad_id=2,
)
_V41_TEST = dict(
    vocab_size=256, hidden_size=64, num_layers=8, num_heads=4, head_dim=64, rope_head_dim=16,
    q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
    layer_types=tuple(_V41_TEST_LAYOUT.kind(i) for i in range(8)),
    index_n_heads=16, index_head_dim=32, index_topk=6,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=0,
    rms_norm_eps=1e-20, num_mtp_layers=0, max_position_embeddings=1 << 20, bos_id=0, eos_id=1,
    v41=_V41_TEST_LAYOUT,
)



# `tiny-v41`: the CPU-trainable V4.1, `tiny`'s widths (vocab, d, heads, window 32, 8 experts top-2) in
# v41-test's 8-layer plan (every layer kind), so a prompt + 128 new tokens crosses the window, many
# ratio-2 pairs and candidate blocks. Top-16 of 6 candidate blocks of 8 (V4.1-Flash: 512 of 2,048 x 8);
# 2- to 4-grams as released, 4 heads of 32 over ~4.1K-row buckets (a few n-grams share a row, as at
# scale). Continuous (no QAT roundings): trained and checked in float32. `jaxspec train` sets the
# Engram classes from its tokenizer (`engram_compressed_vocab` below is a placeholder).
_TINY_V41_LAYOUT = dataclasses.replace(
    _V41_TEST_LAYOUT, candidate_topk_blocks=6, candidate_block_size=8, engram_num_embeddings=(49796, 50980),
    engram_max_ngram=4, engram_n_heads=4, engram_vocab_size=4096, engram_compressed_vocab=2048, qat=False,
)
_TINY_V41 = dict(
    _V41_TEST, vocab_size=2048, hidden_size=256, num_heads=8, q_lora_rank=96, o_lora_rank=64, sliding_window=32,
    index_n_heads=8, index_topk=16, moe_intermediate_size=256, max_position_embeddings=8192, bos_id=None,
    eos_id=None, v41=_TINY_V41_LAYOUT,
)


def v41_preset_fields(name: str) -> dict[str, Any]:
    """`ModelConfig` fields of the V4.1 presets: "v41-flash" (the release's numbers), "v41-test" (every
    layer kind at test size), "tiny-v41" (CPU-trainable)."""
    return {"v41-flash": _v41_flash, "v41-test": lambda: dict(_V41_TEST),
            "tiny-v41": lambda: dict(_TINY_V41)}[name]()
