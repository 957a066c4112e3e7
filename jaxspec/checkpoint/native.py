"""Our own checkpoint format: a folder holding `config.json` (`ModelConfig.architecture()`),
`params/` (an orbax PyTree checkpoint of `ModelParams`) and, optionally, `tokenizer.json`, the draft's
`calibration.json` (`jaxspec calibrate`) and `tune.json` (`jaxspec tune`), and more drafts under
`drafts/<name>/` (`checkpoint/drafts.py`). `load_checkpoint` returns all of it as one `Checkpoint` value."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.checkpoint import drafts, errors
from jaxspec.core.config import RUN_OPTIONS, ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.core.v41 import V41Layout
from jaxspec.model.dspark import abstract_dspark_params
from jaxspec.model.network import ModelParams, abstract_params, cpu_layout
from jaxspec.model.placement import param_shardings, sharded_abstract
from jaxspec.ops.quant import BlockScaled
from jaxspec.speculation.drafter import Draft, DraftSet

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
PARAMS = "params"


def leaves_by_path(tree: Any) -> dict[str, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat}


def check_structure(cfg: ModelConfig, params: Any) -> None:
    """ValueError unless `params` has exactly the structure, shapes and dtypes `cfg` implies."""
    if any(isinstance(x, BlockScaled) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, BlockScaled))):
        raise ValueError("params hold FP8 / FP4 weights (weights='fp8'); this writer takes plain params: "
                         "jaxspec.ops.quant.dequantize_params(params) first, or keep the release's safetensors")
    expected = abstract_params(cfg)
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(expected):
        raise ValueError("params do not match the pytree structure implied by cfg")
    got = leaves_by_path(params)
    for path, leaf in leaves_by_path(expected).items():
        g = got[path]
        if tuple(g.shape) != tuple(leaf.shape) or jnp.dtype(g.dtype) != jnp.dtype(leaf.dtype):
            raise ValueError(
                f"params{path} has shape {tuple(g.shape)} dtype {g.dtype}, cfg implies "
                f"{tuple(leaf.shape)} {leaf.dtype}"
            )


def _cfg_from_json(data: dict[str, Any]) -> ModelConfig:
    # Run options are the caller's, not the checkpoint's: older folders wrote them (and the kernel
    # switch once as "attention_impl"); a folder saved while running the kernels loads like any other.
    data = {k: v for k, v in data.items() if k not in (*RUN_OPTIONS, "attention_impl")}
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"config.json has unknown ModelConfig fields {unknown}")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    if isinstance(fields.get("v41"), dict):  # asdict wrote V4.1's layout as a nested dict
        fields["v41"] = V41Layout(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields["v41"].items()})
    return ModelConfig(**fields)


def save_checkpoint(path: str | os.PathLike, cfg: ModelConfig, params: ModelParams, tokenizer: Any = None,
                    overwrite: bool = False) -> None:
    """Write cfg (JSON), params (orbax) and optionally a `tokenizers.Tokenizer` into folder `path`."""
    import orbax.checkpoint as ocp

    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    check_structure(cfg, params)
    path = os.path.abspath(os.fspath(path))
    params_dir = os.path.join(path, PARAMS)
    if os.path.exists(params_dir):
        if not overwrite:
            raise ValueError(f"checkpoint {path!r} already exists (pass overwrite=True to replace it)")
        import shutil

        shutil.rmtree(params_dir)
    os.makedirs(path, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(params_dir, params)
        ckptr.wait_until_finished()
    finally:
        ckptr.close()
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(cfg.architecture(), f, indent=2)
    tok_path = os.path.join(path, TOKENIZER)
    if tokenizer is not None:
        tokenizer.save(tok_path)
    elif os.path.exists(tok_path):
        os.remove(tok_path)


@dataclasses.dataclass(frozen=True, eq=False)
class Checkpoint:
    """A loaded checkpoint and everything that belongs to it. Unpacks as `cfg, params, tokenizer`."""

    cfg: ModelConfig
    params: ModelParams  # the target (its `mtp` is the chosen draft's when that is an MTP block)
    tokenizer: Any  # a `tokenizers.Tokenizer`, or None
    draft: Draft | DraftSet | None  # what to speculate with (`speculative_generate(..., draft=ckpt.draft)`)
    path: str

    def __iter__(self):
        return iter((self.cfg, self.params, self.tokenizer))

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, {self.cfg.num_layers} layers, {self.cfg.dtype}, draft={self.draft!r})"


def load_checkpoint(
    path: str | os.PathLike, mesh: Any = None, rules: dict[str, Any] | None = None, draft: str | None = None,
    *, dtype: str | None = None, cpu_experts: bool = False,
) -> Checkpoint:
    """-> a `Checkpoint` (cfg, params, tokenizer or None, the draft, the folder) from a folder written by
    `save_checkpoint`; `cfg, params, tok = load_checkpoint(path)` still unpacks.

    `draft`: None (or "default") takes the checkpoint's own draft (its MTP block, with the folder's
    calibration.json and tune.json); a name from `checkpoint.drafts.draft_names(path)` takes
    drafts/<name>/ with its own; "all" takes every one as a `DraftSet` with the tuning across them
    (drafts/tune.json, `jaxspec tune --draft all`), for spec="auto" to choose the draft as well. A
    damaged calibration.json or tune.json does not stop the load: it is reported (one line naming the
    file) when speculation asks for it. `dtype` ("float32" / "bfloat16") casts the weights: float32
    for exact comparisons (the README's dtype condition).

    With `mesh` (see `jaxspec.make_mesh`) every leaf is restored straight into its parameter
    sharding (`placement.param_shardings(cfg, mesh, rules)`): each device reads only its slice.
    `cpu_experts`: routed experts come back one leaf per expert (`model.cpu_layout`), which the CPU path
    reads in place (the same outputs, faster on a CPU; no effect under a mesh or off a CPU).
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r} is a file; a checkpoint is a folder holding {CONFIG} and {PARAMS}/")
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint folder {path!r} does not exist")
    cfg_path, params_dir = os.path.join(path, CONFIG), os.path.join(path, PARAMS)
    if not os.path.isfile(cfg_path) or not os.path.isdir(params_dir):
        raise ValueError(f"{path!r} is not a jaxspec checkpoint (needs {CONFIG} and {PARAMS}/)")
    names = drafts.draft_names(path) if draft == drafts.ALL_DRAFTS else [draft or drafts.DEFAULT_DRAFT]
    folders = [drafts.draft_dir(path, name) for name in names]  # an unknown draft fails before any array is read
    data = errors.read_json(cfg_path)
    try:
        cfg = _cfg_from_json(data)
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{cfg_path} is not a jaxspec ModelConfig: {errors.one_line(e)}") from None
    if dtype is not None and dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be None, 'float32' or 'bfloat16', got {dtype!r}")
    abstract = abstract_params(cfg)
    placed = abstract if mesh is None else sharded_abstract(abstract, param_shardings(cfg, mesh, rules))
    params = _restore(params_dir, abstract, placed, path)
    check_structure(cfg, params)
    # Each draft's own parameters (None: the checkpoint's params/mtp) and its DSparkConfig (None: an MTP block).
    stored = [_stored_draft(folder, path, cfg, abstract, placed, mesh, rules) for folder in folders]
    if draft != drafts.ALL_DRAFTS and stored[0][0] is not None and stored[0][1] is None:
        params = params.replace(mtp=stored[0][0])  # an MTP draft takes the place of the checkpoint's own block
        check_structure(cfg, params)
        stored = [(None, None)]
    if dtype is not None and dtype != cfg.dtype:
        cfg, params = cast(cfg, params, dtype)
    tokenizer = None
    tok_path = os.path.join(path, TOKENIZER)
    if os.path.isfile(tok_path):
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(tok_path)
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"{tok_path} is damaged or not a tokenizer: {errors.one_line(e)}") from None
    found = []  # (name, params, config, sidecar values): the values are checked against the stored layout
    for name, folder, (own, config) in zip(names, folders, stored, strict=True):
        if own is None and getattr(params, "mtp", None) is None:
            continue  # no MTP block (V4.1 has none): no default draft
        if own is not None:
            expected = abstract_params(cfg).mtp if config is None else abstract_dspark_params(cfg, config)
            own = jax.tree.map(lambda x, a: x.astype(a.dtype), own, expected)
        values = drafts.sidecar_values(folder, params.mtp if own is None else own, cfg)
        found.append((name, own, config, values))
    layout = cpu_experts and mesh is None
    if layout:
        params = cpu_layout(params, cfg)
    found = [drafts.draft_of(name, params.mtp if own is None else cpu_layout(own, cfg) if layout else own, config,
                             *values) for name, own, config, values in found]
    if draft == drafts.ALL_DRAFTS:
        chosen = DraftSet(tuple(found), drafts.read_tuning(os.path.join(path, drafts.DRAFTS))) if found else None
    else:
        chosen = found[0] if found else None
    return Checkpoint(cfg=cfg, params=params, tokenizer=tokenizer, draft=chosen, path=path)


def _stored_draft(folder: str, path: str, cfg: ModelConfig, abstract: ModelParams, placed: ModelParams, mesh: Any,
                  rules: Any) -> tuple[Any, DSparkConfig | None]:
    """The parameters drafts/<name>/ stores (None for the checkpoint's own, `folder == path`) and its
    DSparkConfig (None for an MTP block), restored as stored (placed on `mesh` when given)."""
    if folder == path:
        return None, None
    if drafts.draft_kind(folder) == drafts.MTP:
        return _restore(os.path.join(folder, drafts.MTP), abstract.mtp, placed.mtp, folder), None
    config = drafts.read_dspark_config(folder)
    config.validate_for(cfg)
    dabs = abstract_dspark_params(cfg, config)
    dplaced = dabs if mesh is None else sharded_abstract(dabs, param_shardings(cfg, mesh, rules, dabs))
    return _restore(os.path.join(folder, drafts.DSPARK), dabs, dplaced, folder), config


def cast(cfg: ModelConfig, params: ModelParams, dtype: str) -> tuple[ModelConfig, ModelParams]:
    """`cfg` and `params` in another dtype: every leaf takes the dtype the new config implies (norms,
    sinks and other float32 leaves stay float32)."""
    cfg = cfg.replace(dtype=dtype)
    return cfg, jax.tree.map(lambda x, a: x.astype(a.dtype), params, abstract_params(cfg))


def _restore(params_dir: str, abstract: Any, placed: Any, path: str) -> Any:
    """The orbax tree in params_dir as `placed`, checked against `abstract` first; one-line errors."""
    import orbax.checkpoint as ocp

    errors.check_orbax_metadata(params_dir)
    ckptr = ocp.StandardCheckpointer()
    errors.quiet_orphaned_reads(params_dir)
    failure = None
    try:
        _check_stored_arrays(ckptr, params_dir, abstract, path)
        params = ckptr.restore(params_dir, placed)
    except _MismatchError as e:
        failure = ValueError(str(e))
    except Exception as e:  # TensorStore / orbax: the first failed read ends the restore
        failure = errors.damaged(params_dir, e)
    finally:
        ckptr.close()
    if failure is not None:
        # Raised out here, so it holds no reference to orbax's exception: the frames of the reads
        # still in flight are released now (finalized quietly), not at interpreter exit.
        errors.settle_orphaned_reads()
        raise failure
    return params


class _MismatchError(Exception):
    """config.json and the stored arrays disagree (raised as a ValueError by load_checkpoint)."""


def _check_stored_arrays(ckptr: Any, params_dir: str, abstract: ModelParams, path: str) -> None:
    """_MismatchError naming the first array whose name or shape config.json gets wrong (checked
    on orbax's metadata before any read; skipped where that metadata holds no shapes)."""
    read = getattr(ckptr, "metadata", None)
    with errors.quiet_absl_warnings():
        stored_tree = getattr(read(params_dir), "item_metadata", None) if callable(read) else None
    flat = jax.tree_util.tree_flatten_with_path(stored_tree)[0] if stored_tree is not None else []
    stored = {errors.dotted(p): tuple(x.shape) for p, x in flat if getattr(x, "shape", None) is not None}
    if not stored:
        return
    expected = {errors.dotted(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    problem = errors.mismatch(expected, stored)
    if problem:
        raise _MismatchError(f"checkpoint {path}: config.json does not match its arrays: {problem}")
