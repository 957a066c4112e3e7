"""Write ModelParams as a DeepSeek-V4 safetensors checkpoint: official or HF spelling, plain or in
the official release's quantized layout (FP8 block-scaled matrices, FP4 or FP8 routed experts)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import ml_dtypes
import numpy as np

from jaxspec.checkpoint.keys import Spec, hf_key, key_table, official_config, scale_key, to_ckpt
from jaxspec.checkpoint.native import CONFIG, check_structure, leaves_by_path
from jaxspec.checkpoint.quant import FP8_BLOCK, quantize_fp4, quantize_fp8
from jaxspec.checkpoint.safetensors_io import write_index, write_safetensors
from jaxspec.core.config import ModelConfig
from jaxspec.model.network import ModelParams

QUANTIZE = (None, "fp4", "fp8")


def _stored(key: str, spec: Spec, x: np.ndarray, quantize: str | None) -> Iterator[tuple[str, np.ndarray]]:
    """One checkpoint tensor (and its scale) as the official release stores it.

    quantize "fp4" (instruct checkpoints): FP8 e4m3 + UE8M0 scales per 128 x 128 block for the
    attention, indexer-query, shared-expert and MTP projections, FP4 e2m1 + UE8M0 per 1 x 32 for
    the routed experts; "fp8" (Base checkpoints): routed experts FP8 with float32 scales. Other
    `.weight` tensors (embedding, head, norms, router, compressors) are BF16; hyper-connections,
    APE, sinks and router biases fp32, the hash table int64.
    """
    if quantize is None:
        yield key, x
        return
    if spec.quant is None:
        yield key, x.astype(ml_dtypes.bfloat16) if key.endswith(".weight") else x
        return
    if spec.quant == "expert" and quantize == "fp4":
        q, scale = quantize_fp4(x)
    else:
        q, scale = quantize_fp8(x, FP8_BLOCK, "float32" if spec.quant == "expert" else "e8m0")
    yield key, q
    yield scale_key(key), scale


def _ckpt_tensors(
    cfg: ModelConfig, params: ModelParams, quantize: str | None
) -> Iterator[list[tuple[str, np.ndarray]]]:
    """Groups of tensors that stay in one shard (a weight and its scale)."""
    leaves = leaves_by_path(params)
    for key, spec in key_table(cfg).items():
        x = np.asarray(leaves[spec.ours])
        if spec.slot is not None:
            x = x[spec.slot]
        yield list(_stored(key, spec, to_ckpt(spec.kind, x), quantize))


def save_hf_checkpoint(path: str | os.PathLike, cfg: ModelConfig, params: ModelParams, spelling: str = "official",
                       max_shard_bytes: int | None = None, quantize: str | None = None) -> None:
    """Inverse of `load_hf_checkpoint`: config.json + model(-0000k-of-0000n).safetensors in `path`
    (with `model.safetensors.index.json` when there are several shards).

    spelling "official" writes DeepSeek's names and the `compress_ratios` config; "hf" writes the
    names of `DeepseekV4ForCausalLM.save_pretrained` and the `layer_types` config (MTP tensors, which
    transformers does not model, keep the official `mtp.0.*` names). quantize "fp4" / "fp8" writes
    the layout of DeepSeek's instruct / Base release (see `_stored`; power-of-two UE8M0 scales,
    round to nearest even) plus its `quantization_config` and `expert_dtype`; None writes every
    leaf in its own dtype.
    """
    if spelling not in ("official", "hf"):
        raise ValueError(f"spelling must be 'official' or 'hf', got {spelling!r}")
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    check_structure(cfg, params)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    rename: Callable[[str], str] = (lambda k: k) if spelling == "official" else hf_key
    config = official_config(cfg) if spelling == "official" else cfg.to_hf_config()
    config["dtype"] = cfg.dtype
    if quantize is not None:
        config["dtype"] = config["torch_dtype"] = "bfloat16"
        config["expert_dtype"] = quantize
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "scale_fmt": "ue8m0", "weight_block_size": list(FP8_BLOCK)}
    if cfg.bos_id is not None:
        config["bos_token_id"] = cfg.bos_id
    if cfg.eos_id is not None:
        config["eos_token_id"] = cfg.eos_id
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for group in _ckpt_tensors(cfg, params, quantize):
        nbytes = sum(x.nbytes for _, x in group)
        if max_shard_bytes is not None and size and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        for key, x in group:
            shards[-1][rename(key)] = x
        size += nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for name, tensors in zip(names, shards, strict=True):
        write_safetensors(os.path.join(path, name), tensors)
    if n > 1:
        weight_map = {k: name for name, t in zip(names, shards, strict=True) for k in t}
        write_index(path, weight_map, sum(x.nbytes for t in shards for x in t.values()))
