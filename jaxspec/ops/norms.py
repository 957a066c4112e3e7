"""RMS norms. V4 keeps norm weights in fp32 and normalises in fp32 whatever the activation dtype."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Weighted RMSNorm over the last axis.  x: [..., D], weight: [D] (fp32)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def unweighted_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """RMS normalisation without a learned weight (q per head, mHC inputs).  x: [..., D]."""
    x32 = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps).astype(x.dtype)
