"""Pallas kernels (Triton lowering on GPU, interpret mode elsewhere), each beside its jnp reference.

Selected by `ModelConfig(attention_impl="pallas")`: layers/attention.py calls `tree_attention`,
layers/compressor.py calls `chain_compress`.
"""

from jaxspec.pallas.chain_compress import chain_compress, chain_compress_reference
from jaxspec.pallas.tree_attention import attention_from_context, tree_attention, tree_attention_reference

__all__ = [
    "attention_from_context",
    "chain_compress",
    "chain_compress_reference",
    "tree_attention",
    "tree_attention_reference",
]
