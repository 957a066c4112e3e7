"""The DeepSeek-V4.1 test fixture (`jaxspec.testing.write_v41_release`) against mlx-vlm 0.7.10, the oracle
of docs/v41.md (`tests/mlx_v41_oracle.py`): the folder loads strictly, every weight
mlx-vlm holds is the value the writer returned, and mlx-vlm's prefill of it is chunk-invariant and
uses Engram. mlx and mlx-vlm are imported, not skipped: CI installs them.

Exactness of the weights: every value the writer returns is exact in bf16 (FP8 e4m3 and e2m1 codes
times a power-of-two scale have at most 4 significant bits; BF16 tensors are bf16 values) or stored as
F32, so mlx-vlm's bf16 dequantization and the fp32 widening lose nothing: compared bitwise.
"""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_v41_oracle import load_v41, run_v41

from jaxspec.checkpoint.safetensors_io import open_folder
from jaxspec.testing import V41_TINY_TEXT, write_v41_release

C = V41_TINY_TEXT
TOKENS = np.random.default_rng(1).integers(0, C["vocab_size"], (2, 40))  # B 2, S 40


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v41"))
    return path, write_v41_release(path)


@pytest.fixture(scope="module")
def model(release):
    return load_v41(release[0])


@pytest.fixture(scope="module")
def full_logits(model):
    return run_v41(model, TOKENS)


def _mlx_name(key: str) -> tuple[str, int | None]:
    """Official key -> (mlx-vlm parameter, expert index into its stack or None)."""
    for old, new in (("embed.", "embed_tokens."), ("head.", "head."), ("norm.", "norm."), ("layers.", "layers.")):
        if key.startswith(old):
            key = "language_model." + new + key[len(old):]
            break
    parts = key.split(".")
    if "shared_experts" in parts:
        parts[-2] = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[parts[-2]]
    if "experts" in parts:
        i = parts.index("experts")
        expert = int(parts[i + 1])
        parts[i : i + 3] = ["switch_mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[parts[i + 2]]]
        return ".".join(parts), expert
    return ".".join(parts), None


def test_folder_layout(release):
    """Two shards + index; every returned key stored, FP8 / FP4 ones with an F8_E8M0 `.scale`."""
    path, values = release
    folder = open_folder(path)
    assert folder.indexed and not folder.unlisted
    assert len({os.path.basename(i.file) for i in folder.tensors.values()}) == 2
    scales = {k for k in folder.tensors if k.endswith(".scale")}
    assert set(folder.tensors) - scales == set(values)
    for k in scales:
        weight = folder.tensors[k.removesuffix(".scale") + ".weight"]
        assert folder.tensors[k].dtype == "F8_E8M0" and weight.dtype in ("F8_E4M3", "I8"), k
    d, inter = C["hidden_size"], C["moe_intermediate_size"]
    assert folder.tensors["layers.0.ffn.experts.0.w2.weight"].shape == (d, inter // 2)  # two e2m1 per byte
    assert folder.tensors["layers.0.ffn.experts.0.w2.scale"].shape == (d, inter // 32)
    assert folder.tensors["layers.1.engram.embed.scale"].shape == (C["engram_num_embeddings"][0], 1)
    assert any(k.startswith("mtp.2.markov_head.") for k in folder.tensors)
    with open(os.path.join(path, "engram_token_map.json")) as f:
        assert max(json.load(f)) + 1 == C["engram_compressed_vocab_size"]


def test_mlx_holds_the_returned_values(release, model):
    """Strict load (load_v41), then every mlx-vlm parameter is the writer's value, bitwise; `mtp.*` are
    the only returned keys mlx-vlm does not hold (its sanitize drops them)."""
    _, values = release
    params = dict(tree_flatten(model.parameters()))
    seen = set()
    for key, want in values.items():
        if key.startswith("mtp."):
            continue
        if key.endswith(".engram.embed.weight"):  # kept FP8, rows dequantized (to bf16) on lookup
            layer = model.language_model.layers[int(key.split(".")[1])]
            got = np.array(layer.engram.embed(mx.arange(want.shape[0])).astype(mx.float32))
            seen |= {f"language_model.{key}", f"language_model.{key.removesuffix('weight')}scales"}
        else:
            name, expert = _mlx_name(key)
            got = np.array(params[name].astype(mx.float32))
            got = got.reshape(-1, got.shape[-1]) if key.endswith("wo_a.weight") else got  # [groups, rank, in]
            got = got[expert] if expert is not None else got
            seen.add(name)
        np.testing.assert_array_equal(got, want, err_msg=key)
    assert set(params) == seen


def test_chunked_prefill_matches(model, full_logits):
    """Prefill of 40 tokens = 16 + 24 one-token steps = chunks 5, 7, 3, 9, 16 (bitwise on CPU fp32)."""
    scale = np.abs(full_logits).max()
    for chunks in ([16] + [1] * 24, [5, 7, 3, 9, 16]):
        err = np.abs(run_v41(model, TOKENS, chunks) - full_logits).max() / scale
        assert err <= 1e-6, (chunks, err)


def test_engram_is_active(tmp_path, release, full_logits):
    """Finite logits, moved by the Engram token map alone (same seed: the same weights)."""
    assert np.isfinite(full_logits).all()
    classes = C["engram_compressed_vocab_size"]
    other = write_v41_release(str(tmp_path), token_map=[(7 * i + 3) % classes for i in range(C["vocab_size"])])
    assert all(np.array_equal(other[k], v) for k, v in release[1].items())
    moved = run_v41(load_v41(str(tmp_path)), TOKENS)
    assert np.isfinite(moved).all()
    assert np.abs(moved - full_logits).max() / np.abs(full_logits).max() > 0.05
