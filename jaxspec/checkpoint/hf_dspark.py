"""Load a DeepSeek-V4 folder that carries a DSpark drafter (V4-Flash-DSpark, -0731, Pro-0813): the
target as `load_hf_checkpoint` reads it, plus `mtp.0..S-1.*` into `model.dspark.DSparkParams` and
config.json's flat `dspark_*` keys into a `DSparkConfig` (docs/dspark.md, "What a release holds").

The draft's tensors go through the target's reader: the same name checks, FP8 / FP4 block-scaled
formats (weights "fp8" keeps them stored), region reads and placement on a mesh.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxspec.checkpoint import errors
from jaxspec.checkpoint.drafts import sidecar_values
from jaxspec.checkpoint.errors import one_line
from jaxspec.checkpoint.hf_load import (
    WEIGHTS,
    HFCheckpoint,
    LoadStats,
    load_hf_checkpoint,
    open_hf_checkpoint,
    read_params,
    table_sources,
)
from jaxspec.checkpoint.keys import draft_stages, dspark_key_table
from jaxspec.checkpoint.native import Checkpoint, leaves_by_path
from jaxspec.checkpoint.v41_load import load_v41
from jaxspec.core.config import ModelConfig, is_v41_config
from jaxspec.core.dspark import DSparkConfig
from jaxspec.model.dspark import DSparkParams, abstract_dspark_params
from jaxspec.model.network import ModelParams
from jaxspec.speculation.drafter import Draft
from jaxspec.speculation.dspark import dspark_draft
from jaxspec.speculation.mtp import MTPDrafter


def open_hf_dspark(path: str | os.PathLike, dtype: str | None = None
                   ) -> tuple[HFCheckpoint, HFCheckpoint | None, DSparkConfig | None]:
    """Check a folder (headers only) -> (the target's checkpoint, the drafter's or None, its config
    or None). One-line ValueError if the folder holds the April MTP block instead, or a damaged drafter."""
    target = open_hf_checkpoint(path, dtype, draft="none")
    if target.draft == "mtp":
        raise ValueError(f"{target.path!r} holds the April MTP block (mtp.0.e_proj / h_proj), not a DSpark drafter: "
                         "load it with load_hf_checkpoint")
    if target.draft is None:
        return target, None, None
    where = target.where
    stages = draft_stages(where)
    if not stages:
        raise ValueError(f"config.json of {target.path!r} declares a DSpark drafter (dspark_block_size="
                         f"{target.config.get('dspark_block_size')}) but the folder holds no mtp.* tensors")
    w1 = where.get(f"mtp.{stages - 1}.markov_head.markov_w1.weight")
    rank = int(w1.shape[1]) if w1 is not None and len(w1.shape) == 2 else None
    dcfg = DSparkConfig.from_hf_config(target.config, stages, rank)
    dcfg.validate_for(target.cfg)
    abstract = abstract_dspark_params(target.cfg, dcfg)
    leaves = leaves_by_path(abstract)
    draft_keys = {k: v for k, v in where.items() if k.startswith("mtp.")}
    sources = table_sources(target.folder, draft_keys, dspark_key_table(target.cfg, stages), leaves, target.config,
                            lambda key: False)
    draft = HFCheckpoint(target.path, target.cfg, leaves, sources, target.reader, abstract, target.config, where,
                         "dspark", target.folder)
    return target, draft, dcfg


def load_hf_dspark(
    path: str | os.PathLike,
    dtype: str | None = None,
    mesh: Any = None,
    rules: dict[str, Any] | None = None,
    stats: LoadStats | None = None,
    weights: str = "plain",
) -> tuple[ModelConfig, ModelParams, DSparkParams | None, DSparkConfig | None]:
    """Read a V4 folder -> (cfg, target params with mtp=None, DSpark params or None, DSparkConfig
    or None): None, None for a folder without a drafter; a one-line ValueError for one holding the
    April MTP block (`load_hf_checkpoint` reads that). The drafter's stage count is the number of
    `mtp.<s>` prefixes; markov_rank comes from config.json or else from `markov_w1`.
    dtype, mesh, rules, stats and weights as in `load_hf_checkpoint` (weights "fp8" keeps the
    drafter's FP8 / FP4 weights stored too: main_proj, the stages' attention and experts)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    target, draft, dcfg = open_hf_dspark(path, dtype)
    checkpoints = [target] if draft is None else [target, draft]
    if weights == "fp8" and not any(ck.stored for ck in checkpoints):
        raise ValueError(f"weights='fp8' keeps the FP8 / FP4 weights of a release, but {target.path!r} stores none of "
                         "the quantizable weights quantized; load it with weights='plain'")
    params = read_params(target, weights, mesh, rules)
    dparams = None if draft is None else read_params(draft, weights, mesh, rules)
    if stats is not None:
        parts = [ck.stats() for ck in checkpoints]
        stats.bytes_read = dict(target.reader.bytes_read)  # one reader: both trees' reads
        stats.bytes_in_files = sum(p.bytes_in_files for p in parts)
    return target.cfg, params, dparams, dcfg


def load_release(
    path: str | os.PathLike,
    dtype: str | None = None,
    mesh: Any = None,
    rules: dict[str, Any] | None = None,
    weights: str = "plain",
    *,
    draft: str = "auto",
) -> Checkpoint:
    """A DeepSeek-V4 release folder as a `Checkpoint`: the target, the folder's tokenizer.json, and its draft
    ready to speculate with: the DSpark drafter of V4-Flash-DSpark / 0731 / Pro-0813 folders, or the April MTP
    block. `draft`: "auto" (whichever the folder holds, None without one), "dspark" or "mtp" (a one-line
    ValueError saying which draft the folder holds otherwise), "none". dtype, mesh, rules and weights as in
    `load_hf_checkpoint`. The draft carries the calibration.json and tune.json the folder holds, as
    `load_checkpoint`'s does."""
    if draft not in ("auto", "dspark", "mtp", "none"):
        raise ValueError(f"draft must be 'auto', 'dspark', 'mtp' or 'none', got {draft!r}")
    config = _release_config(path)
    if config is not None and is_v41_config(config):
        if draft == "mtp":
            raise ValueError("a V4.1 release holds a DSpark draft or none (draft='auto', 'dspark' or 'none')")
        cfg, params, loaded = load_v41(path, config, dtype, with_draft=draft != "none", mesh=mesh, rules=rules,
                                       weights=weights)
        if draft == "dspark" and loaded is None:
            raise ValueError(f"{os.fspath(path)!r} holds no draft, not a dspark draft")
        found = None if loaded is None else dspark_draft(*loaded)
    else:
        cfg, params, found = _load_v4(path, dtype, mesh, rules, weights, draft)
    if found is not None:  # what `jaxspec calibrate / tune --checkpoint RELEASE` wrote beside the weights
        calibration, tuning, others = sidecar_values(os.fspath(path), found.params, cfg)
        found = dataclasses.replace(found, calibration=calibration, tuning=tuning, value_calibrations=others)
    return Checkpoint(cfg=cfg, params=params, tokenizer=release_tokenizer(path), draft=found,
                      path=os.path.abspath(os.fspath(path)))


def _load_v4(path: str | os.PathLike, dtype: str | None, mesh: Any, rules: dict[str, Any] | None, weights: str,
             draft: str) -> tuple[ModelConfig, ModelParams, Draft | None]:
    holds = open_hf_checkpoint(path, dtype, draft="none").draft  # "mtp", "dspark" or None, from headers only
    if draft in ("dspark", "mtp") and holds != draft:
        raise ValueError(f"{os.fspath(path)!r} holds {'no draft' if holds is None else f'a {holds} draft'}, "
                         f"not a {draft} draft")
    found = None
    if holds == "dspark" and draft != "none":
        cfg, params, dparams, dcfg = load_hf_dspark(path, dtype, mesh, rules, weights=weights)
        found = dspark_draft(dparams, dcfg)
    else:
        cfg, params = load_hf_checkpoint(path, dtype, mesh, rules, weights=weights,
                                         draft="none" if draft == "none" else "auto")
        if params.mtp is not None:
            found = Draft("default", MTPDrafter(), params.mtp)
    return cfg, params, found


def _release_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """config.json of a folder, None when there is none (open_hf_checkpoint says what is missing)."""
    cfg_path = os.path.join(os.fspath(path), "config.json")
    return errors.read_json(cfg_path) if os.path.isfile(cfg_path) else None


def release_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer.json of a release folder (HF `tokenizers`), or None without one. Its special tokens are
    the release's own (DeepSeek-V4: bos 0, eos 1, from config.json)."""
    tok_path = os.path.join(os.fspath(path), "tokenizer.json")
    if not os.path.isfile(tok_path):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(tok_path)
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{tok_path} is damaged or not a tokenizer: {one_line(e)}") from None
