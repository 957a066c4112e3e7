"""Extra drafts beside a checkpoint: `<checkpoint>/drafts/<name>/` holds one MTP block (orbax, the
MTP parameters only: the target, its embedding and head stay the checkpoint's) with its own
calibration.json and tune.json. `load_checkpoint(path, draft=name)` swaps it in; the checkpoint's
own draft (params/mtp) is `DEFAULT_DRAFT`, what `draft=None` loads.

    checkpoints/tiny-v4/drafts/one-step/
        mtp/              orbax PyTree of MTPParams, in the checkpoint's config.json dtypes
        draft.json        how it was trained (recipe, schedule, held-out history)
        calibration.json  `jaxspec calibrate --draft one-step`
        tune.json         the budget chooser's result for this draft
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.checkpoint.errors import one_line
from jaxspec.core.config import ModelConfig
from jaxspec.model.network import MTPParams, abstract_params
from jaxspec.speculation.auto import TUNING_FILE, Tuning, load_tuning
from jaxspec.speculation.drafter import Draft, Unreadable
from jaxspec.speculation.mtp import MTPDrafter
from jaxspec.speculation.values import CALIBRATION_FILE, Calibration, check_fitted, load_calibration

DRAFTS = "drafts"
DEFAULT_DRAFT = "default"  # the checkpoint's own params/mtp
MTP = "mtp"
INFO = "draft.json"


def draft_names(path: str | os.PathLike) -> list[str]:
    """The drafts a checkpoint folder offers: DEFAULT_DRAFT first, then drafts/<name>/ with an mtp/."""
    root = os.path.join(os.fspath(path), DRAFTS)
    found = []
    if os.path.isdir(root):
        found = sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n, MTP)))
    return [DEFAULT_DRAFT, *found]


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


def sidecar_values(folder: str, draft: Any, cfg: ModelConfig
                   ) -> tuple[Calibration | Unreadable | None, Tuning | Unreadable | None]:
    """The calibration.json and tune.json a draft's folder holds (None where absent). A calibration fitted
    for another draft is an error here; a file that cannot be read is kept as `Unreadable` (its one-line
    error raised when speculation uses it, with a warning now)."""
    calibration = tuning = None
    path = os.path.join(folder, CALIBRATION_FILE)
    if os.path.isfile(path):
        try:
            calibration = load_calibration(path)
        except (ValueError, OSError) as e:
            calibration = _unreadable(path, e)
        else:
            check_fitted(calibration, draft, cfg, path)  # fitted for this draft, or a one-line error now
    path = os.path.join(folder, TUNING_FILE)
    if os.path.isfile(path):
        try:
            tuning = load_tuning(path)
        except (ValueError, OSError) as e:
            tuning = _unreadable(path, e)
    return calibration, tuning


def _unreadable(path: str, error: Exception) -> Unreadable:
    import warnings

    message = one_line(error).removeprefix(f"{path}: ").removeprefix(f"{path} ")
    warnings.warn(f"{path} is unreadable ({message}); speculation will not use it", stacklevel=3)
    return Unreadable(path, message)


def mtp_draft(name: str, mtp: MTPParams, calibration: Any, tuning: Any) -> Draft:
    """The Draft of an MTP block (a checkpoint's own, or drafts/<name>/mtp)."""
    return Draft(name, MTPDrafter(), mtp, calibration, tuning)


def abstract_mtp(cfg: ModelConfig) -> MTPParams:
    mtp = abstract_params(cfg).mtp
    if mtp is None:
        raise ValueError("this config has no MTP block (num_mtp_layers=0): it takes no draft")
    return mtp


def save_draft(path: str | os.PathLike, name: str, cfg: ModelConfig, mtp: MTPParams,
               info: dict[str, Any] | None = None) -> str:
    """Write `mtp` (cast to the dtypes of `cfg`, i.e. the checkpoint's config.json) as draft `name`
    of the checkpoint folder `path`, replacing an older one (its calibration.json / tune.json are
    kept: they name the draft they were fitted for, so a stale one is refused at load); -> its folder."""
    import orbax.checkpoint as ocp

    if not name or name == DEFAULT_DRAFT or os.sep in name or name.startswith("."):
        raise ValueError(f"a draft name must be a plain folder name other than {DEFAULT_DRAFT!r}, got {name!r}")
    expected = abstract_mtp(cfg)
    if jax.tree.structure(mtp) != jax.tree.structure(expected):
        raise ValueError("mtp does not match the MTP block implied by cfg")
    mtp = jax.tree.map(lambda x, a: jnp.asarray(x).astype(a.dtype), mtp, expected)
    for x, a in zip(jax.tree.leaves(mtp), jax.tree.leaves(expected), strict=True):
        if x.shape != a.shape:
            raise ValueError(f"an MTP leaf has shape {x.shape}, cfg implies {a.shape}")
    folder = os.path.abspath(os.path.join(os.fspath(path), DRAFTS, name))
    os.makedirs(folder, exist_ok=True)
    target, tmp = os.path.join(folder, MTP), os.path.join(folder, MTP + ".tmp")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(tmp, mtp)
        ckptr.wait_until_finished()
    finally:
        ckptr.close()
    if os.path.exists(target):
        shutil.rmtree(target)
    os.replace(tmp, target)
    if info is not None:
        with open(os.path.join(folder, INFO), "w") as f:
            json.dump(info, f, indent=1)
    return folder
