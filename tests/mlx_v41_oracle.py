"""mlx-vlm's DeepSeek-V4.1 backbone as an oracle (`mlx_vlm.models.deepseek_v41`, mlx-vlm 0.7.10,
mlx[cpu]; docs/v41.md, "Checks and measurements").

A release folder is loaded the way a user of mlx-vlm loads one (`load_model`: its `sanitize` maps the
official names, dequantizes FP8 / FP4 weights to bf16 and drops `mtp.*`; the weights load strictly),
then every floating parameter is widened to fp32: mlx's CPU `gather_mm` (the routed experts) has no
bf16 kernel. The activation fake-quants stay on (mlx-vlm's default, the release's QAT).

Engram needs the n-gram hash state, which mlx-vlm builds lazily from the folder's
engram_token_map.json; a model without it silently skips Engram, so loading builds it and
checks that it holds the folder's map.

Nothing here is jaxspec: mlx and numpy only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_vlm.models.deepseek_v41 import fakequant
from mlx_vlm.utils import load_model


def load_v41(path: str | os.PathLike, strict: bool = True):
    """mlx-vlm's `Model` of a V4.1 release folder, fp32, Engram hash state installed. `strict` False lets
    parameters the folder lacks keep mlx-vlm's initial values (a folder built elsewhere may lack some)."""
    model = load_model(Path(path), strict=strict)
    model.apply(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a)
    lm = model.language_model
    lm._ensure_engram_hash()  # what its first call would do, done now so that it can be checked
    with open(os.path.join(path, "engram_token_map.json")) as f:
        token_map = json.load(f)
    assert lm.engram_hash is not None, "mlx-vlm did not install the Engram hash state: Engram would be skipped"
    assert np.array(lm.engram_hash._token_map).tolist() == token_map
    assert not fakequant.DISABLE
    return model


def run_v41(model, tokens, chunks=None) -> np.ndarray:
    """Logits [B, S, V] fp32 of a prefill of tokens [B, S] from an empty cache: one call, or one call
    per chunk (sizes summing to S) on one cache."""
    tokens = np.asarray(tokens, np.int32)
    sizes = [tokens.shape[1]] if chunks is None else list(chunks)
    if sum(sizes) != tokens.shape[1]:
        raise ValueError(f"chunks {sizes} do not sum to {tokens.shape[1]} tokens")
    cache, start, out = model.make_cache(), 0, []
    for n in sizes:
        logits = model(mx.array(tokens[:, start : start + n]), cache=cache).logits
        out.append(np.array(logits.astype(mx.float32)))
        start += n
    return np.concatenate(out, axis=1)


def mlx_v41_logits(path: str | os.PathLike, tokens, chunks=None) -> np.ndarray:
    """mlx-vlm's logits [B, S, V] fp32 for tokens [B, S] on the release folder at `path`."""
    return run_v41(load_v41(path), tokens, chunks)
