"""mlx-vlm's DeepSeek-V4 DSpark drafter as an oracle (`mlx_vlm.speculative.drafters.deepseek_v4_dspark`,
mlx-vlm 0.7.10, mlx[cpu]; /work/notes/dspark_mlx.md has the facts behind it).

The drafter is built from a folder's config.json and its `mtp.*` tensors through mlx-vlm's own
`sanitize` / `load_weights`, bound to the folder's target embedding and LM head. It is fed the
captured target rows one per call: mlx-vlm's RotatingKVCache keeps exactly the last W rows only
when rows arrive one at a time (a multi-row update keeps W - 1 old rows plus all the new ones,
and a first multi-row update keeps all of them), and one row at a time is the reference's window.

Nothing here is jaxspec: mlx and numpy only.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_vlm.speculative.drafters.deepseek_v4_dspark import DeepseekV4DsparkDraftModel
from mlx_vlm.speculative.drafters.deepseek_v4_dspark import ModelConfig as DsparkConfig
from safetensors.numpy import load_file


def _tensors(folder: str) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def load(folder: str) -> DeepseekV4DsparkDraftModel:
    """The drafter of an F32 (unquantized) folder, bound to its target's embed / head, fp32."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    tensors = _tensors(folder)
    stages = 1 + max(int(k.split(".")[1]) for k in tensors if k.startswith("mtp."))
    # The draft config as mlx-vlm's splitter writes it (deepseek_v4_dspark/split.py, extra_config):
    # the dspark_* keys at the top level (its text config drops them).
    model = DeepseekV4DsparkDraftModel(DsparkConfig.from_dict({
        "text_config": config, "n_mtp_layers": stages, "target_layer_ids": config["dspark_target_layer_ids"],
        "mask_token_id": config["dspark_noise_token_id"], "markov_rank": config["dspark_markov_rank"],
        "block_size": config["dspark_block_size"] + 1,
    }))
    weights = model.sanitize({k: mx.array(v) for k, v in tensors.items() if k.startswith("mtp.")})
    model.load_weights(list(weights.items()), strict=True)
    v, d = tensors["embed.weight"].shape
    embed, head = nn.Embedding(v, d), nn.Linear(d, v, bias=False)
    embed.weight, head.weight = mx.array(tensors["embed.weight"]), mx.array(tensors["head.weight"])
    model.bind(SimpleNamespace(embed_tokens=embed, lm_head=head))
    model.confidence_w = tensors[f"mtp.{stages - 1}.confidence_head.proj.weight"]  # mlx-vlm drops this head
    return model


def _feed(model: DeepseekV4DsparkDraftModel, caches, rows: np.ndarray, anchor: int, gamma: int) -> None:
    """Every row but the last into the caches, one row per draft_block call (drafts discarded)."""
    for i in range(rows.shape[0] - 1):
        out = model.draft_block(anchor, mx.array(rows[None, i : i + 1]), caches, gamma + 1,
                                lambda logits: mx.argmax(logits, axis=-1))
        mx.eval(out)


def draft(model: DeepseekV4DsparkDraftModel, rows: np.ndarray, anchor: int, gamma: int) -> dict[str, np.ndarray]:
    """rows [T, n*d]: captured target rows of positions 0..T-1; anchor: the token at position T.
    -> tokens [γ] (greedy), logits [γ, V] (Markov-corrected, as the sampler saw them), corrected
    (the same from mlx-vlm's modules), base [γ, V] (before the Markov bias), conf [γ] (the
    reference's raw confidence logits wᵀ[hc_head output ; W1[prev]], pre-norm hidden)."""
    # mlx-vlm's own entry point: the tokens and the corrected logits it samples from.
    caches = model.make_cache()
    _feed(model, caches, rows, anchor, gamma)
    seen = []

    def greedy(logits):
        seen.append(np.array(logits.astype(mx.float32)))
        return mx.argmax(logits, axis=-1)

    tokens = model.draft_block(anchor, mx.array(rows[None, -1:]), caches, gamma + 1, greedy)
    tokens = np.array(tokens)[0]
    # The same pass through mlx-vlm's modules (DeepseekV4DsparkDraftModel._hidden without its final
    # norm), for the hc_head output the confidence head reads.
    caches = model.make_cache()
    _feed(model, caches, rows, anchor, gamma)
    first, last = model.stages[0], model.stages[-1]
    main_x = first.main_norm(first.main_proj(mx.array(rows[None, -1:])))
    ids = mx.array([[anchor] + [model.config.mask_token_id] * (gamma - 1)])
    h = model._input_embed(ids)
    h = mx.contiguous(mx.broadcast_to(h[:, :, None, :], (1, gamma, model.hc_mult, h.shape[-1])))
    for stage, cache in zip(model.stages, caches, strict=True):
        h = stage(h, main_x, cache)
    hh = last.hc_head(h)
    base = model._logits(last.norm(hh))
    prev = mx.array([[anchor, *tokens[:-1].tolist()]])
    e = model.markov_head.get_prev_embeddings(prev)
    corrected = np.array(base + model.markov_head.markov_w2(e))[0]
    features = np.concatenate([np.array(hh)[0], np.array(e)[0]], axis=-1)
    return {"tokens": tokens, "logits": np.stack([s[0] for s in seen]), "corrected": corrected,
            "base": np.array(base)[0], "conf": features @ model.confidence_w[0]}
