"""Parity of the target with mlx-vlm's DeepSeek-V4 (mlx 0.32.4 CPU build, mlx-vlm 0.7.10): a second
implementation, independent of transformers and of ours, run on our own checkpoint as
`save_hf_checkpoint` exports it in the release's layout (official names, `compress_ratios` config).

mlx-vlm's config accepts only the release's ratios (CSA 4, HCA 128). Its forward without a cache is not
causal (every query sees every compressed entry: 0.7 relative error here) and its cached one-token
decode drops the overlapping half of CSA windows (issue 42), so the comparison is its cached prefill:
each prefix prefilled fresh into a new cache, every position of it against our prefill of the whole
sequence. `index_block=0` turns off mlx-vlm's HISA (an approximate hierarchical top-k it takes past
`index_block * index_keep` = 1024 compressed entries; these prefixes have at most 65).

mlx and mlx-vlm are imported, not skipped: CI fails when this oracle is missing (scripts/setup.sh
installs them). Tolerance: TOL relative to the largest |logit|, where the measured error is 1.6e-6.
"""

import glob
import json
import os

import jax
import jax.numpy as jnp
import mlx.core as mx
import numpy as np
from mlx_vlm.models.deepseek_v4.config import ModelConfig as MLXConfig
from mlx_vlm.models.deepseek_v4.language import LanguageModel

import jaxspec as js
from jaxspec.checkpoint import save_hf_checkpoint
from jaxspec.testing import randomize

TOL = 1e-5
# Prefixes ending before, on and after HCA boundaries (128, 256), mid CSA window and on one.
PREFIXES = (9, 127, 129, 258)


def test_cached_prefills_match_mlx_vlm(tmp_path):
    # the `test` widths (window 8, indexer top-3 of CSA 4) with the release's HCA ratio
    cfg = js.ModelConfig.preset("test", hca_ratio=128)
    params = randomize(js.init_params(cfg, jax.random.key(0)), jax.random.key(1), scale=0.1)
    save_hf_checkpoint(tmp_path, cfg, params, spelling="official")
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    assert config["compress_ratios"][:4] == [0, 4, 128, 4]
    model = LanguageModel(MLXConfig.from_dict({**config, "index_block": 0}))
    weights = {}
    for file in sorted(glob.glob(os.path.join(tmp_path, "*.safetensors"))):
        weights.update(mx.load(file))
    model.load_weights(list(model.sanitize(weights).items()), strict=True)

    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, max(PREFIXES)))
    ours = np.asarray(js.prefill_logits(params, cfg, jnp.asarray(tokens, jnp.int32)))[0]
    for n in PREFIXES:
        theirs = np.array(model(mx.array(tokens[:, :n]), cache=model.make_cache()).logits.astype(mx.float32))[0]
        err = float(np.max(np.abs(theirs - ours[:n])) / np.max(np.abs(ours[:n])))
        assert err <= TOL, f"prefix {n}: relative error {err:.3e}"
