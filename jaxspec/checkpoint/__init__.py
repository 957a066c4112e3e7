"""Checkpoints: our own orbax format, and DeepSeek-V4 safetensors checkpoints.

* `native`: `save_checkpoint` / `load_checkpoint`, a folder with config.json, orbax params/ and
  optionally tokenizer.json.
* `hf_dspark`: `load_hf_dspark`, a V4 folder with its DSpark drafter (target + draft params + DSparkConfig).
* `hf_load` / `hf_save`: `load_hf_checkpoint` / `save_hf_checkpoint`, DeepSeek-V4 checkpoints in
  the official spelling (DeepSeek's release, e.g. deepseek-ai/DeepSeek-V4-Flash) or HF
  transformers' `save_pretrained` spelling, plain or FP8 / FP4 block-scaled, sharded with
  `model.safetensors.index.json`, loaded slice by slice into a (multi-process) mesh.
* `keys` (names), `safetensors_io` (headers, memory-mapped reads, writer), `quant` (the formats).
"""

from jaxspec.checkpoint.hf_dspark import load_hf_dspark, load_release, open_hf_dspark
from jaxspec.checkpoint.hf_load import HFCheckpoint, LoadStats, load_hf_checkpoint, open_hf_checkpoint
from jaxspec.checkpoint.hf_save import save_hf_checkpoint
from jaxspec.checkpoint.native import Checkpoint, load_checkpoint, save_checkpoint

__all__ = [
    "Checkpoint", "HFCheckpoint", "LoadStats", "load_checkpoint", "load_hf_checkpoint", "load_hf_dspark",
    "load_release", "open_hf_checkpoint", "open_hf_dspark", "save_checkpoint", "save_hf_checkpoint",
]
