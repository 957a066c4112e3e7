"""Extra drafts beside a checkpoint: `<checkpoint>/drafts/<name>/` holds one draft's parameters (orbax,
the draft's own only: the target, its embedding and head stay the checkpoint's) with its own
calibration.json and tune.json: an MTP block (`mtp/`) or a DSpark drafter (`dspark/` + `dspark.json`,
its `DSparkConfig`). `load_checkpoint(path, draft=name)` takes it; the checkpoint's own draft
(params/mtp) is `DEFAULT_DRAFT`, what `draft=None` loads; `draft="all"` takes every draft, with the
choice among them that `jaxspec tune --draft all` wrote to drafts/tune.json.

    checkpoints/tiny-v4/drafts/one-step/
        mtp/              orbax PyTree of MTPParams, in the checkpoint's config.json dtypes
        draft.json        how it was trained (recipe, schedule, held-out history)
        calibration.json  `jaxspec calibrate --draft one-step`
        calibration_both.json  (DSpark drafts) `jaxspec calibrate --draft dspark --values both`: `_vb` specs
        tune.json         the budget chooser's result for this draft
    checkpoints/tiny-v4/drafts/tune.json  the chooser's result across every draft ("dspark/s5_k1_d6")
    checkpoints/tiny-v4/drafts/dspark/
        dspark/           orbax PyTree of DSparkParams
        dspark.json       its DSparkConfig
        ...
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.checkpoint.errors import one_line, read_json
from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.core.spec import VALUE_SOURCES
from jaxspec.model.dspark import DSparkParams, abstract_dspark_params
from jaxspec.model.dspark_v41 import V41DSparkParams
from jaxspec.model.network import MTPParams, abstract_params
from jaxspec.speculation.auto import TUNING_FILE, Tuning, load_tuning
from jaxspec.speculation.drafter import Draft, Unreadable
from jaxspec.speculation.dspark import dspark_draft
from jaxspec.speculation.mtp import MTPDrafter
from jaxspec.speculation.values import Calibration, calibration_file, check_fitted, load_calibration

DRAFTS = "drafts"
DEFAULT_DRAFT = "default"  # the checkpoint's own params/mtp
ALL_DRAFTS = "all"  # every draft, as one DraftSet
MTP = "mtp"
DSPARK = "dspark"
DSPARK_CONFIG = "dspark.json"
INFO = "draft.json"


def draft_kind(folder: str) -> str | None:
    """What a drafts/<name>/ folder holds: "mtp", "dspark" or None."""
    for kind in (MTP, DSPARK):
        if os.path.isdir(os.path.join(folder, kind)):
            return kind
    return None


def draft_names(path: str | os.PathLike) -> list[str]:
    """The drafts a checkpoint folder offers: DEFAULT_DRAFT first, then drafts/<name>/ holding a draft."""
    root = os.path.join(os.fspath(path), DRAFTS)
    found = []
    if os.path.isdir(root):
        found = sorted(n for n in os.listdir(root) if draft_kind(os.path.join(root, n)))
    return [DEFAULT_DRAFT, *found]


def read_dspark_config(folder: str) -> DSparkConfig:
    """The DSparkConfig of a drafts/<name>/ folder (its dspark.json); one-line errors naming the file."""
    path = os.path.join(folder, DSPARK_CONFIG)
    data = read_json(path)
    try:
        return DSparkConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a DSparkConfig: {one_line(e)}") from None


def draft_dir(path: str | os.PathLike, name: str | None) -> str:
    """The folder holding draft `name`'s sidecar files (calibration.json, tune.json): the checkpoint
    itself for the default draft; a one-line ValueError listing the drafts for an unknown name."""
    path = os.fspath(path)
    if name is None or name == DEFAULT_DRAFT:
        return path
    names = draft_names(path)
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"checkpoint {path!r} has no draft {name!r}; drafts: {', '.join(names)}")
    return os.path.join(path, DRAFTS, name)


def sidecar_values(folder: str, draft: Any, cfg: ModelConfig) -> tuple[
    Calibration | Unreadable | None, Tuning | Unreadable | None, dict[str, Calibration | Unreadable]
]:
    """The calibration.json, tune.json and other value sources' calibration_<source>.json a draft's folder
    holds -> (calibration, tuning, {source: calibration}) (None / absent where there is no file). A
    calibration fitted for another draft or for another value source than its name says is an error here;
    a file that cannot be read is kept as `Unreadable` (its one-line error raised when speculation uses it,
    with a warning now)."""
    found: dict[str, Calibration | Unreadable] = {}
    for values in VALUE_SOURCES:
        path = os.path.join(folder, calibration_file(values))
        if not os.path.isfile(path):
            continue
        try:
            found[values] = load_calibration(path)
        except (ValueError, OSError) as e:
            found[values] = _unreadable(path, e)
            continue
        check_fitted(found[values], draft, cfg, path)  # fitted for this draft, or a one-line error now
        if found[values].feature != values:
            raise ValueError(f"{path} holds a calibration of the {found[values].feature!r} values; this file is "
                             f"for {values!r} (`jaxspec calibrate --values {values}` writes it)")
    return found.pop("draft", None), read_tuning(folder), found


def read_tuning(folder: str) -> Tuning | Unreadable | None:
    """The tune.json `folder` holds (None where absent; `Unreadable` with a warning where damaged)."""
    path = os.path.join(folder, TUNING_FILE)
    if not os.path.isfile(path):
        return None
    try:
        return load_tuning(path)
    except (ValueError, OSError) as e:
        return _unreadable(path, e)


def _unreadable(path: str, error: Exception) -> Unreadable:
    import warnings

    message = one_line(error).removeprefix(f"{path}: ").removeprefix(f"{path} ")
    warnings.warn(f"{path} is unreadable ({message}); speculation will not use it", stacklevel=3)
    return Unreadable(path, message)


def draft_of(name: str, params: Any, config: DSparkConfig | None, calibration: Any, tuning: Any,
             value_calibrations: Any = None) -> Draft:
    """The Draft of an MTP block (a checkpoint's own, or drafts/<name>/mtp) or of a DSpark drafter."""
    if isinstance(params, (DSparkParams, V41DSparkParams)):
        return dspark_draft(params, config, name, calibration, tuning, value_calibrations)
    return Draft(name, MTPDrafter(), params, calibration, tuning, dict(value_calibrations or {}))


def abstract_mtp(cfg: ModelConfig) -> MTPParams:
    mtp = abstract_params(cfg).mtp
    if mtp is None:
        raise ValueError("this config has no MTP block (num_mtp_layers=0): it takes no draft")
    return mtp


def save_draft(path: str | os.PathLike, name: str, cfg: ModelConfig,
               params: MTPParams | DSparkParams | V41DSparkParams,
               info: dict[str, Any] | None = None, config: DSparkConfig | None = None) -> str:
    """Write a draft's parameters (an MTP block, or a DSpark drafter with its `config`), cast to the dtypes
    of `cfg` (the checkpoint's config.json), as draft `name` of the checkpoint folder `path`, replacing an
    older one (its calibration.json / tune.json are kept: they name the draft they were fitted for, so a
    stale one is refused at load); -> its folder."""
    import orbax.checkpoint as ocp

    if not name or name in (DEFAULT_DRAFT, ALL_DRAFTS) or os.sep in name or name.startswith("."):
        raise ValueError(f"a draft name must be a plain folder name other than {DEFAULT_DRAFT!r} and {ALL_DRAFTS!r}, "
                         f"got {name!r}")
    if isinstance(params, (DSparkParams, V41DSparkParams)):
        if config is None:
            raise ValueError("a DSpark draft needs its DSparkConfig (config=)")
        kind, expected = DSPARK, abstract_dspark_params(cfg, config)
    else:
        kind, expected = MTP, abstract_mtp(cfg)
    if jax.tree.structure(params) != jax.tree.structure(expected):
        raise ValueError(f"the parameters do not match the {kind} draft implied by cfg")
    params = jax.tree.map(lambda x, a: jnp.asarray(x).astype(a.dtype), params, expected)
    for x, a in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        if x.shape != a.shape:
            raise ValueError(f"a {kind} leaf has shape {x.shape}, cfg implies {a.shape}")
    folder = os.path.abspath(os.path.join(os.fspath(path), DRAFTS, name))
    os.makedirs(folder, exist_ok=True)
    target, tmp = os.path.join(folder, kind), os.path.join(folder, kind + ".tmp")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(tmp, params)
        ckptr.wait_until_finished()
    finally:
        ckptr.close()
    for other in (MTP, DSPARK):
        if os.path.exists(os.path.join(folder, other)):
            shutil.rmtree(os.path.join(folder, other))
    os.replace(tmp, target)
    if kind == DSPARK:
        with open(os.path.join(folder, DSPARK_CONFIG), "w") as f:
            json.dump(dataclasses.asdict(config), f, indent=1)
    if info is not None:
        with open(os.path.join(folder, INFO), "w") as f:
            json.dump(info, f, indent=1)
    return folder
