"""jaxspec: tree-structured speculative decoding for DeepSeek-V4-style models in JAX."""

from jaxspec.config import ModelConfig
from jaxspec.model import ModelParams, forward, init_params, prefill_logits
from jaxspec.state import DecodeState, init_state

__all__ = [
    "DecodeState",
    "ModelConfig",
    "ModelParams",
    "forward",
    "init_params",
    "init_state",
    "prefill_logits",
]
