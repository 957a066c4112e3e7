"""Pallas kernels (Triton lowering on GPU, interpret mode elsewhere), one entry point each.

Selected by `ModelConfig(kernels="pallas")`: layers/attention.py calls `tree_attention`
(its jnp twin is `layers.attention.attend`), layers/compressor.py calls `chain_compress` (its jnp
twin is `ops.pooling.pool_rows`), layers/mhc.py calls `sinkhorn` (its jnp twin is `sinkhorn_reference`). The
kernels import nothing from the layers.
"""

from jaxspec.ops.pallas.chain_compress import chain_compress
from jaxspec.ops.pallas.sinkhorn import sinkhorn
from jaxspec.ops.pallas.tree_attention import tree_attention

__all__ = ["chain_compress", "sinkhorn", "tree_attention"]
