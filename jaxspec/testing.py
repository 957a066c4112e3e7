"""Parameter transformations for tests, benchmarks and notebooks (random weights that exercise
every mechanism, and a draft that agrees with its target)."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxspec.model import network as model_lib
from jaxspec.model.network import ModelParams
from jaxspec.model.state import init_state


def long_tests() -> bool:
    """Whether this run includes the long tier (`JAXSPEC_LONG_TESTS=1`, docs/testing.md)."""
    return os.environ.get("JAXSPEC_LONG_TESTS") == "1"


def randomize(params: ModelParams, key: jax.Array, scale: float = 0.05) -> ModelParams:
    """Perturb every float leaf, so zero-initialised sinks, APE, biases and hc bases matter."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    out = []
    for leaf, k in zip(leaves, keys, strict=True):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            leaf = leaf + scale * jax.random.normal(k, leaf.shape, leaf.dtype)
        out.append(leaf)
    return jax.tree.unflatten(treedef, out)


def high_acceptance(params: ModelParams, mix: float = 0.05) -> ModelParams:
    """Params whose MTP draft agrees with the target most of the time.

    Sub-layer outputs are scaled by `mix`, so the target's next token is mostly a function of the
    current token (through the embedding) with context-dependent perturbations; the MTP block is
    made to compute the same function of the token it consumes. Every mechanism still runs and
    still moves logits, so exactness tests stay meaningful; rejections happen at every depth.
    """
    if params.mtp is None:
        raise ValueError("high_acceptance needs params with an MTP block")

    def damp(block):
        ffn = block.ffn
        shared = ffn.shared.replace(w2=ffn.shared.w2 * mix) if ffn.shared is not None else None
        ffn = ffn.replace(experts=ffn.experts.replace(w2=ffn.experts.w2 * mix), shared=shared)
        return block.replace(attn=block.attn.replace(wo_b=block.attn.wo_b * mix), ffn=ffn)

    d = params.embed.shape[1]
    mtp = params.mtp
    mtp = mtp.replace(
        inputs=mtp.inputs.replace(
            h_proj=jnp.zeros_like(mtp.inputs.h_proj),
            e_proj=jnp.eye(d, dtype=mtp.inputs.e_proj.dtype),
            enorm=jnp.ones_like(mtp.inputs.enorm),
        ),
        block=damp(mtp.block),
        hc_head=params.hc_head,
        # sharper than the target (same argmax): confident drafts make trees grow deep
        norm=params.norm * 30.0,
    )
    return params.replace(layers=tuple(damp(b) for b in params.layers), mtp=mtp)


def mixed_acceptance(params: ModelParams, mix: float = 0.05, gap: float = 0.1, skew: float = 0.5) -> ModelParams:
    """Params whose MTP draft is right about half the time at every depth, and whose second choice is
    often the target's token (sibling accepts): the case exactness claims rest on, between `params`
    (random: almost nothing accepted) and `high_acceptance` (almost everything on the first branch).

    Deterministic, on top of `high_acceptance(params, mix)` (target and draft both follow the token-only
    function rms_norm(embed[v]) * norm @ head, context moving it a little):
    - near-tied pairs: the head's odd column 2j+1 is pulled to `gap` of its distance from column 2j,
      so after any token the two tokens of the winning pair have nearly equal logits and the target
      picks between them by a small margin that the context moves;
    - a skewed draft: the draft's final norm is scaled by 1 + skew on even and 1 - skew on odd
      dimensions, so within a pair the draft ranks by a differently weighted margin; where the two
      disagree the target's token is the draft's rank-1 child.
    Everything that the target computes is unchanged in kind (only the head's values move), so the
    greedy identity and the committed state still test every mechanism.
    """
    p = high_acceptance(params, mix)
    head = p.head  # [d, V]
    pairs = head.shape[1] // 2
    even, odd = head[:, 0 : 2 * pairs : 2], head[:, 1 : 2 * pairs : 2]
    odd = even + gap * (odd - even)
    head = head.at[:, 1 : 2 * pairs : 2].set(odd.astype(head.dtype))
    d = head.shape[0]
    pattern = jnp.where(jnp.arange(d) % 2 == 0, 1.0 + skew, 1.0 - skew).astype(p.mtp.norm.dtype)
    return p.replace(head=head, mtp=p.mtp.replace(norm=p.mtp.norm * pattern))


def sharpened(params: ModelParams, factor: float = 8.0) -> ModelParams:
    """The target's logits scaled by `factor` (its final norm), the argmax kept: on `high_acceptance`
    params, whose target is near uniform at temperature 1 (top token ~2%), sampled trees then get
    accepted. The chi-square tests' `confident_params`."""
    return params.replace(norm=params.norm * factor)


def one_shot_greedy(params: ModelParams, cfg: Any, prompt: Any, max_new_tokens: int) -> np.ndarray:
    """Greedy continuation of one prompt by the one-shot program: the whole prompt in one dense
    `extend` (no chunks, no bands), then one-token decode steps -> [max_new_tokens] int32. The
    reference the chunked `generate` is held to."""
    prompt = np.asarray(prompt, np.int32)[None]
    step = jax.jit(lambda p, st, t: model_lib.extend(p, cfg, st, t, jnp.ones(t.shape, bool), banded=False))
    out, state = step(params, init_state(cfg, 1, prompt.shape[1] + max_new_tokens), jnp.asarray(prompt))
    tokens = [int(jnp.argmax(out.logits[0, -1]))]
    for _ in range(max_new_tokens - 1):
        out, state = step(params, state, jnp.asarray([[tokens[-1]]], jnp.int32))
        tokens.append(int(jnp.argmax(out.logits[0, -1])))
    return np.asarray(tokens, np.int32)


# ---- one cycle's stages on the MTP draft of `params` (tests, benchmarks, notebooks) ---------------


def mtp_models(params: ModelParams) -> Any:
    """`Models` of params holding an MTP block: the target and that block as its draft."""
    from jaxspec.model.network import Models

    if params.mtp is None:
        raise ValueError("these params have no MTP block")
    return Models(target=params.replace(mtp=None), drafter=params.mtp)


def mtp_speculator(cfg: Any, spec: Any, rule: str = "greedy", values: Any = None) -> Any:
    """The static `Speculator` of a cycle of the MTP draft (rule and values: `speculation/policy.py`)."""
    from jaxspec.core.spec import SpecConfig
    from jaxspec.speculation.cycle import Speculator
    from jaxspec.speculation.mtp import MTPDrafter
    from jaxspec.speculation.policy import Policy

    spec = SpecConfig.parse(spec) if isinstance(spec, str) else spec
    return Speculator(cfg, spec, MTPDrafter(), Policy(rule, values))


def mtp_prefill(params: ModelParams, cfg: Any, tokens: Any, lengths: Any, max_len: int, sampling: Any = None,
                spec: Any = "s1_k1_d2") -> Any:
    """The `SpecState` a speculative loop of the MTP draft starts from (jitted prefill; `spec` sizes its stats)."""
    from jaxspec.model.sampling import Sampling
    from jaxspec.speculation import stages

    sampling = Sampling.create() if sampling is None else sampling
    return stages.prefill(mtp_speculator(cfg, spec), mtp_models(params), jnp.asarray(tokens, jnp.int32),
                          jnp.asarray(lengths, jnp.int32), max_len, sampling)


def mtp_tree(params: ModelParams, cfg: Any, spec: Any, state: Any, rule: str = "greedy", values: Any = None,
             sampling: Any = None) -> Any:
    """The tree the MTP drafter grows from `state` in a cycle of `spec` (jitted `draft_stage`)."""
    from jaxspec.model.sampling import Sampling
    from jaxspec.speculation import stages

    sampling = Sampling.create() if sampling is None else sampling
    return stages.draft(mtp_speculator(cfg, spec, rule, values), mtp_models(params), state, sampling)


def agreeing_dspark(params: ModelParams, cfg: Any, dcfg: Any, key: jax.Array, sharpness: float = 30.0) -> Any:
    """DSpark parameters whose drafts agree with `high_acceptance` params most of the time.

    Those targets' next token is mostly a function of the current one: rms_norm(embed[v]) * norm @ head.
    Here the block's base logits are switched off (a zero final norm) and the Markov head computes that
    function of the previous drafted token (W1[v] = rms_norm(embed[v]) * norm * sharpness, W2 = head: rank
    = hidden width), so every position's draft follows the target's argmax up to the context's
    perturbations; the confidence head stays random. Every mechanism still runs."""
    from jaxspec.model.dspark import init_dspark_params
    from jaxspec.ops.norms import rms_norm

    if dcfg.markov_rank != cfg.hidden_size:
        raise ValueError(f"agreeing_dspark needs markov_rank = hidden_size = {cfg.hidden_size}, got {dcfg.markov_rank}")
    dp = randomize(init_dspark_params(cfg, dcfg, key), jax.random.fold_in(key, 1))
    w1 = rms_norm(params.embed.astype(jnp.float32), params.norm, cfg.rms_norm_eps) * sharpness
    return dp.replace(norm=jnp.zeros_like(dp.norm), markov_w1=w1.astype(dp.markov_w1.dtype),
                      markov_w2=params.head.astype(dp.markov_w2.dtype))


def v41_mixed_acceptance(params: Any, cfg: Any, dcfg: Any, key: jax.Array, mix: float = 0.05, gap: float = 0.1,
                         skew: float = 0.5) -> tuple[Any, Any]:
    """A V4.1 target and a V4.1 DSpark drafter that agree about half the time at every depth, with the
    target's token often the draft's second choice (`mixed_acceptance`'s recipe on V4.1).

    Target: every sub-layer's output and Engram's value scaled by `mix` (the streams stay near the
    current token's embedding in every copy, so the next token is mostly rms_norm(embed[v]) * norm @ head,
    context moving it a little), the head's odd columns pulled to `gap` of their distance from the even
    ones (near-tied pairs). Drafter: `agreeing_dspark` (its Markov head computes that function of the
    previous drafted token) with W1 scaled by 1 + skew on even and 1 - skew on odd dimensions, so within
    a pair it ranks by a differently weighted margin. -> (target params, drafter params)."""

    def damp(block):
        ffn = block.ffn
        shared = ffn.shared.replace(w2=ffn.shared.w2 * mix) if ffn.shared is not None else None
        ffn = ffn.replace(experts=ffn.experts.replace(w2=ffn.experts.w2 * mix), shared=shared)
        eng = block.engram
        if eng is not None:  # the gate's key is normalized: scaling wkv scales the value alone
            eng = eng.replace(wkv=eng.wkv * mix)
        return block.replace(attn=block.attn.replace(wo_b=block.attn.wo_b * mix), ffn=ffn, engram=eng)

    head = params.head
    pairs = head.shape[1] // 2
    even, odd = head[:, 0: 2 * pairs: 2], head[:, 1: 2 * pairs: 2]
    head = head.at[:, 1: 2 * pairs: 2].set((even + gap * (odd - even)).astype(head.dtype))
    target = params.replace(layers=tuple(damp(b) for b in params.layers), head=head)
    draft = agreeing_dspark(target, cfg, dcfg, key)
    pattern = jnp.where(jnp.arange(dcfg.markov_rank) % 2 == 0, 1.0 + skew, 1.0 - skew)
    return target, draft.replace(markov_w1=(draft.markov_w1 * pattern).astype(draft.markov_w1.dtype))


# ---- DeepSeek-V4.1: a tiny release folder in the official names and formats (tests) ---------------
# docs/v41.md describes the model, its config and its release formats. The tiny text config below runs
# on mlx-vlm 0.7.10 as written. Layer modes: 0 local, 1 local + Engram, 2 full (ratio 2, owns a
# compressor with gate, indexer, index keys), 3 reuse, 4 reuse + Engram, 5 full (ratio 1, candidate
# source), 6 reuse, 7 reindex (own indexer query, layer 5's keys, masked by its candidates). The three
# trailing ratios are the DSpark stages. Every width is a multiple of 32 (FP8 / FP4 weight blocks) and
# of 16 (the FP4 block of the compressed KV); (candidate_topk_blocks - 1) * candidate_block_size + 1 >=
# index_topk and 16 index heads keep the top-k free of ties.
V41_TINY_TEXT: dict[str, Any] = dict(
    model_type="deepseek_v41_text", vocab_size=256, hidden_size=64, moe_intermediate_size=32,
    num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16,
    q_lora_rank=32, o_lora_rank=16, o_groups=2, hidden_act="silu", swiglu_limit=10.0, rms_norm_eps=1e-20,
    max_position_embeddings=1048576, rope_theta=10000,
    rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 65536},
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, scoring_func="sqrtsoftplus",
    topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5, sliding_window=8,
    compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0], compress_rope_theta=160000,
    kv_source_layer_ids=[2, 5], index_source_layer_ids=[2, 5, 7], index_n_heads=16, index_head_dim=32,
    index_topk=6, candidate_source_layer_id=5, candidate_topk_blocks=3, candidate_block_size=4,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    engram_layer_ids=[1, 4], engram_num_embeddings=[290, 370],  # = sums of each layer's bucket primes
    engram_max_ngram_size=3, engram_vocab_size=64, engram_n_heads=2, engram_head_dim=32,
    engram_pad_token_id=2, engram_compressed_vocab_size=200,
    num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=255,
    dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=32, dspark_n_routed_experts=4,
    dspark_num_experts_per_tok=2)

V41_TINY_VISION: dict[str, Any] = {
    "model_type": "deepseek_v41_vision", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
    "intermediate_size": 32, "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3}

# config.json's quantization_config as the release writes it
V41_QUANT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                    "scale_fmt": "ue8m0", "expert_dtype": "fp4"}

# Storage formats of: FP8 e4m3 with one UE8M0 scale per 32 x 32 block, FP8 with one per row and 32
# columns (the Engram tables), MXFP4 (e2m1 pairs in I8 bytes, one UE8M0 scale per row and 32 columns).
_FP8, _FP8_ROWS, _FP4, _BF16, _F32 = "fp8", "fp8_rows", "fp4", "bf16", "f32"


def v41_engram_primes(text_config: dict[str, Any]) -> list[list[int]]:
    """Per Engram layer, its bucket primes in hash-column order (n-gram size, then head):
    layers in order, then n = 2..max; each (layer, n) restarts at engram_vocab_size - 1 and takes the
    next primes no earlier column has used."""
    def is_prime(n: int) -> bool:
        return n >= 2 and all(n % p for p in range(2, int(n**0.5) + 1))

    seen: set[int] = set()
    out = []
    for _ in text_config["engram_layer_ids"]:
        cols = []
        for _ in range(text_config["engram_max_ngram_size"] - 1):
            p = text_config["engram_vocab_size"] - 1
            for _ in range(text_config["engram_n_heads"]):
                p += 1
                while not is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                cols.append(p)
        out.append(cols)
    return out


def _v41_block(c: dict[str, Any], prefix: str, layer: int | None, experts: int,
               normal: Any, near_one: Any, small: Any) -> dict[str, tuple[str, np.ndarray]]:
    """Tensors of one block (`layers.{layer}` or `mtp.{s}` with layer None: no compressor, indexer or
    Engram) -> official key -> (format, fp32 value before quantization), [out, in] matrices."""
    d, hc, hd, heads = c["hidden_size"], c["hc_mult"], c["head_dim"], c["num_attention_heads"]
    q_rank, inter, groups, o_rank = c["q_lora_rank"], c["moe_intermediate_size"], c["o_groups"], c["o_lora_rank"]
    mix = (2 + hc) * hc  # pre 4 + post 4 + comb 16 rows of the mHC mixer
    t: dict[str, tuple[str, np.ndarray]] = {
        "attn_norm.weight": (_BF16, near_one(d, 0.1)), "ffn_norm.weight": (_BF16, near_one(d, 0.1))}
    for site in ("attn", "ffn"):
        t[f"hc_{site}_fn"] = (_F32, normal((mix, hc * d), 2 / np.sqrt(hc * d)))  # [24, 4d]
        t[f"hc_{site}_base"] = (_F32, small(mix, 0.1))
        t[f"hc_{site}_scale"] = (_F32, near_one(3, 0.2))
    t.update({
        "attn.attn_sink": (_F32, small(heads, 0.5)),
        "attn.wq_a.weight": (_FP8, normal((q_rank, d))),
        "attn.q_norm.weight": (_BF16, near_one(q_rank, 0.1)),
        "attn.wq_b.weight": (_FP8, normal((heads * hd, q_rank))),
        "attn.wkv.weight": (_FP8, normal((hd, d))),
        "attn.kv_norm.weight": (_BF16, near_one(hd, 0.1)),
        # heads 8g..: group g; [groups * o_rank, heads * hd / groups], dequantized to bf16 by the reference
        "attn.wo_a.weight": (_FP8, normal((groups * o_rank, heads * hd // groups))),
        "attn.wo_b.weight": (_FP8, normal((d, groups * o_rank))),
    })
    if layer is not None and layer in c["kv_source_layer_ids"]:
        t["attn.compressor.wkv.weight"] = (_BF16, normal((hd, d)))
        if c["compress_ratios"][layer] > 1:  # ratio 1 pools nothing: no softmax gate
            t["attn.compressor.wgate.weight"] = (_BF16, normal((hd, d)))
        t["attn.compressor.norm.weight"] = (_BF16, near_one(hd, 0.1))
        t["attn.indexer.wk.weight"] = (_BF16, normal((c["index_head_dim"], hd)))
        t["attn.indexer.k_norm.weight"] = (_BF16, near_one(c["index_head_dim"], 0.1))
    if layer is not None and layer in c["index_source_layer_ids"]:
        t["attn.indexer.wq_b.weight"] = (_FP8, normal((c["index_n_heads"] * c["index_head_dim"], q_rank)))
        t["attn.indexer.weights_proj.weight"] = (_BF16, normal((c["index_n_heads"], d)))
    t["ffn.gate.weight"] = (_BF16, normal((experts, d)))
    t["ffn.gate.bias"] = (_F32, small(experts, 0.1))
    t["ffn.gate.bias_vl"] = (_F32, small(experts, 0.1))
    for e in range(experts):
        t[f"ffn.experts.{e}.w1.weight"] = (_FP4, normal((inter, d)))
        t[f"ffn.experts.{e}.w2.weight"] = (_FP4, normal((d, inter)))
        t[f"ffn.experts.{e}.w3.weight"] = (_FP4, normal((inter, d)))
    shared = inter * c["n_shared_experts"]
    t["ffn.shared_experts.w1.weight"] = (_FP8, normal((shared, d)))
    t["ffn.shared_experts.w2.weight"] = (_FP8, normal((d, shared)))
    t["ffn.shared_experts.w3.weight"] = (_FP8, normal((shared, d)))
    if layer is not None and layer in c["engram_layer_ids"]:
        i = c["engram_layer_ids"].index(layer)
        cols = (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"]
        ed = c["engram_head_dim"]
        t["engram.embed.weight"] = (_FP8_ROWS, normal((c["engram_num_embeddings"][i], ed)))
        t["engram.wkv.weight"] = (_FP8, normal((d * (hc + 1), cols * ed)))  # 4 keys (one per copy) + 1 value
        t["engram.q_weight"] = (_BF16, near_one((hc, d), 0.1))
        t["engram.k_weight"] = (_BF16, near_one((hc, d), 0.1))
    return {f"{prefix}.{k}": v for k, v in t.items()}


def _v41_vision(vision: dict[str, Any], d: int, normal: Any, near_one: Any, small: Any
                ) -> dict[str, tuple[str, np.ndarray]]:
    """The ViT, aligner and image span markers under mlx-vlm 0.7.10's names (: not checked against the
    release), BF16."""
    w, inter, patch = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    t = {"vision.patch_embed.proj.weight": normal((w, 3 * patch * patch)),
         "vision.patch_embed.proj.bias": small(w, 0.1), "vision.norm.weight": near_one(w, 0.1)}
    for i in range(vision["num_hidden_layers"]):
        b = f"vision.blocks.{i}"
        t.update({f"{b}.norm1.weight": near_one(w, 0.1), f"{b}.norm2.weight": near_one(w, 0.1),
                  f"{b}.attn.wqkv.weight": normal((3 * w, w)), f"{b}.attn.wqkv.bias": small(3 * w, 0.1),
                  f"{b}.attn.wo.weight": normal((w, w)), f"{b}.attn.wo.bias": small(w, 0.1),
                  f"{b}.mlp.w1.weight": normal((2 * inter, w)), f"{b}.mlp.w2.weight": normal((w, inter))})
    r2 = vision["downsample_ratio"] ** 2
    t.update({"aligner.w1.weight": normal((d, w * r2)), "aligner.w1.bias": small(d, 0.1),
              "aligner.w2.weight": normal((d, d)), "aligner.w2.bias": small(d, 0.1)})
    for mark in ("image_start", "image_end", "image_newline"):
        t[mark] = small(d, 1.0)
    return {k: (_BF16, v) for k, v in t.items()}


def v41_release_tensors(text_config: dict[str, Any] = V41_TINY_TEXT, seed: int = 0,
                        vision_config: dict[str, Any] = V41_TINY_VISION) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of a V4.1 release of this config, official key -> (storage format, fp32 value
    before quantization). Matrices N(0, 1/sqrt(fan_in)); norm weights 1 ± 0.1; hc_fn N(0, 2/sqrt(4d))
    (mixer logits of unit scale); hc_scale 1 ± 0.2; hc_base, gate biases N(0, 0.1); sinks N(0, 0.5)."""
    c = text_config
    rng = np.random.default_rng(seed)

    def normal(shape, std=None):
        return rng.standard_normal(shape) * (1 / np.sqrt(shape[-1]) if std is None else std)

    def near_one(shape, spread):
        return 1 + rng.uniform(-spread, spread, shape)

    def small(shape, std):
        return rng.standard_normal(shape) * std

    d, v = c["hidden_size"], c["vocab_size"]
    t = {"embed.weight": (_BF16, normal((v, d))), "head.weight": (_BF16, normal((v, d))),
         "norm.weight": (_BF16, near_one(d, 0.1))}
    for i in range(c["num_hidden_layers"]):
        t.update(_v41_block(c, f"layers.{i}", i, c["n_routed_experts"], normal, near_one, small))
    # DSpark: blocks without compressor / indexer / Engram, their own smaller MoE; stage 0 maps
    # the taps of len(dspark_target_layer_ids) layers to d, the last stage holds the heads.
    stages, rank = c["num_nextn_predict_layers"], c["dspark_markov_rank"]
    for s in range(stages):
        t.update(_v41_block(c, f"mtp.{s}", None, c["dspark_n_routed_experts"], normal, near_one, small))
    last = f"mtp.{stages - 1}"
    t.update({
        "mtp.0.main_proj.weight": (_FP8, normal((d, len(c["dspark_target_layer_ids"]) * d))),
        "mtp.0.main_norm.weight": (_BF16, near_one(d, 0.1)),
        f"{last}.norm.weight": (_BF16, near_one(d, 0.1)),
        f"{last}.markov_head.embed.weight": (_BF16, normal((v, rank))),  # an embedding table [V, r]
        f"{last}.markov_head.head.weight": (_BF16, normal((v, rank))),  # Linear(r -> V)
        f"{last}.confidence_head.proj.weight": (_BF16, normal((1, d + rank))),  # Linear(d + r -> 1), no bias
    })
    if vision_config is not None:
        t.update(_v41_vision(vision_config, d, normal, near_one, small))
    return t


# e2m1 code (bit 3 sign, bits 2-1 exponent, bit 0 mantissa) -> value, decoded from the bits here so the
# values a fixture returns do not come from the quantizer that chose the bytes.
_E2M1 = np.array([(-1.0) ** (code >> 3) * ((code & 1) / 2 if not (code >> 1) & 3
                                           else (1 + (code & 1) / 2) * 2.0 ** (((code >> 1) & 3) - 1))
                  for code in range(16)], np.float32)


def _ue8m0(scale: np.ndarray) -> np.ndarray:
    """F8_E8M0 bytes -> 2^(byte - 127) (float64: exact for every byte but 255, NaN)."""
    return np.exp2(scale.view(np.uint8).astype(np.float64) - 127)


def _v41_store(key: str, fmt: str, a: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One tensor -> (what the release stores for it: the key and, when block-scaled, `<key minus
    .weight>.scale`; the fp32 value the stored bytes mean)."""
    from jaxspec.checkpoint.quant import quantize_fp4, quantize_fp8

    if fmt == _F32:
        a = a.astype(np.float32)
        return {key: a}, a
    if fmt == _BF16:
        b = a.astype(ml_dtypes.bfloat16)
        return {key: b}, b.astype(np.float32)
    scale_key = key.removesuffix(".weight") + ".scale"
    if fmt in (_FP8, _FP8_ROWS):
        block = (32, 32) if fmt == _FP8 else (1, 32)
        q, s = quantize_fp8(a, block)  # q [out, in] e4m3, s [ceil(out/b0), in/32] e8m0
        scale = np.repeat(np.repeat(_ue8m0(s), block[0], 0), block[1], 1)[: a.shape[0], : a.shape[1]]
        value = q.astype(np.float64) * scale
    elif fmt == _FP4:
        q, s = quantize_fp4(a)  # q [out, in/2] int8, low nibble = even column; s [out, in/32] e8m0
        codes = np.empty(a.shape, np.uint8)
        codes[:, 0::2], codes[:, 1::2] = q.view(np.uint8) & 0xF, q.view(np.uint8) >> 4
        value = _E2M1[codes].astype(np.float64) * np.repeat(_ue8m0(s), 32, 1)[:, : a.shape[1]]
    else:
        raise ValueError(fmt)
    return {key: q, scale_key: s}, value.astype(np.float32)


def write_v41_release(path: str | os.PathLike, text_config: dict[str, Any] = V41_TINY_TEXT, seed: int = 0,
                      token_map: list[int] | None = None) -> dict[str, np.ndarray]:
    """A DeepSeek-V4.1 release folder of `text_config`, in the official names and formats:
    config.json (top level as the release, `text_config`, `quantization_config`, a small
    `vision_config`), two safetensors shards + model.safetensors.index.json, and
    engram_token_map.json (mlx-vlm's shortcut for the tokenizer-derived map; default i % classes).

    FP8 / FP4 weights are stored as quantized bytes and their `.scale` (F8_E8M0) next to them; the
    values are quantized first, so -> official key -> the fp32 value each stored tensor means
    ([out, in]; FP8 / FP4 dequantized; `.scale` keys are not in it). Backbone, DSpark stages `mtp.*`,
    vision and aligner (mlx-vlm's names) are all written. Shards alternate over the sorted names, so
    layers, and a weight and its scale, are split across the two files."""
    c = text_config
    want = [sum(p) for p in v41_engram_primes(c)]
    if list(c["engram_num_embeddings"]) != want:  # else the hash ids run past the tables
        raise ValueError(f"engram_num_embeddings {c['engram_num_embeddings']} must be the prime sums {want}")
    classes, vocab = c["engram_compressed_vocab_size"], c["vocab_size"]
    token_map = [i % classes for i in range(vocab)] if token_map is None else [int(i) for i in token_map]
    if len(token_map) != vocab or min(token_map) < 0 or max(token_map) + 1 != classes:
        raise ValueError(f"token_map needs {vocab} entries in [0, {classes}) reaching {classes - 1}")

    stored: dict[str, np.ndarray] = {}
    values: dict[str, np.ndarray] = {}
    for key, (fmt, a) in v41_release_tensors(c, seed).items():
        files, values[key] = _v41_store(key, fmt, a)
        stored.update(files)

    from jaxspec.checkpoint.safetensors_io import write_index, write_safetensors

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
              "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 100000,
              "quantization_config": dict(V41_QUANT_CONFIG), "text_config": dict(c),
              "vision_config": dict(V41_TINY_VISION)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, "engram_token_map.json"), "w") as f:
        json.dump(token_map, f)
    names, weight_map = sorted(stored), {}
    for i in range(2):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        write_safetensors(os.path.join(path, file), {n: stored[n] for n in names[i::2]})
        weight_map.update(dict.fromkeys(names[i::2], file))
    write_index(path, weight_map, sum(a.nbytes for a in stored.values()))
    return values
