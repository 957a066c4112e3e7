"""jaxspec: tree-structured speculative decoding for DeepSeek-V4-style models in JAX."""

from jaxspec.checkpoint import (
    Checkpoint,
    load_checkpoint,
    load_hf_checkpoint,
    load_hf_dspark,
    load_release,
    save_checkpoint,
)
from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.model.network import ModelParams, forward, init_params
from jaxspec.model.placement import memory_plan, shard_params
from jaxspec.model.runner import prefill_logits
from jaxspec.model.state import DecodeState, init_state
from jaxspec.sharding.rules import make_mesh
from jaxspec.speculation.drafter import Draft, DraftSet
from jaxspec.speculation.generate import GenerateOutput, generate, speculative_generate
from jaxspec.speculation.inputs import DecodeOptions, SamplingParams

__all__ = [
    "Checkpoint",
    "Draft",
    "DraftSet",
    "DecodeOptions",
    "DecodeState",
    "DSparkConfig",
    "GenerateOutput",
    "generate",
    "ModelConfig",
    "ModelParams",
    "forward",
    "init_params",
    "init_state",
    "load_checkpoint",
    "load_hf_checkpoint",
    "load_hf_dspark",
    "load_release",
    "make_mesh",
    "memory_plan",
    "save_checkpoint",
    "shard_params",
    "SamplingParams",
    "SpecConfig",
    "speculative_generate",
    "prefill_logits",
]
