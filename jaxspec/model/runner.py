"""Sharded programs: a jitted function run on a ("data", "tensor", "expert") mesh.

Programs (`run_sharded`) are `jax.jit` with explicit in/out shardings: parameters keep their
placement, batch-leading arrays are split over "data". Inside, "data" is a manual `jax.shard_map`
axis: each data shard runs its own sequences (its own while loop), so the decode state, the verify
scratch and the commit can never be resharded across the batch. "tensor" and "expert" are
partitioned by the compiler (GSPMD) from the parameter placement, except where the collective is
explicit (`sharding.active`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.core import programs
from jaxspec.core.config import ModelConfig
from jaxspec.model.network import ModelParams, Models, check_logits_inputs
from jaxspec.model.placement import param_shardings, shard_params
from jaxspec.model.prefill import chunked_logits, jitted_chunked_logits, prefill_chunk
from jaxspec.model.v41 import V41Params
from jaxspec.sharding.active import activate, is_dynamic
from jaxspec.sharding.rules import DATA, check_mesh, check_rules

PARAMS = (ModelParams, V41Params, Models)  # arguments placed by their parameter shardings, not split by rows

# The owner of the sharded programs in `jaxspec.core.programs`' bounded LRU (their compile count).
SHARDED = "jaxspec.model.runner"


def _program(
    jitted: Any, mesh: Any, args: Sequence[Any], batch: int, cfg: ModelConfig, rules: Mapping[str, Any] | None
) -> tuple[Any, Any, list[Any], Any]:
    """-> (its key in `jaxspec.core.programs`, jitted program over the dynamic args, those args placed,
    output post-processing)."""
    mesh = check_mesh(mesh)
    rules = check_rules(rules)
    raw = getattr(jitted, "__wrapped__", jitted)
    args = list(args)
    static = tuple(i for i, a in enumerate(args) if not is_dynamic(a))
    dynamic = [i for i in range(len(args)) if i not in static]
    data_split = mesh.shape[DATA] > 1 and batch % mesh.shape[DATA] == 0
    rows = NamedSharding(mesh, P(DATA))
    for i in dynamic:
        if isinstance(args[i], PARAMS):
            args[i] = shard_params(args[i], cfg, mesh, rules)
        elif data_split:
            # Batch rows go to their data shard before the call (an explicit-axis reshard); inside,
            # the loop never moves them again.
            args[i] = jax.tree.map(
                lambda x: jax.reshard(x, rows) if np.ndim(x) and np.shape(x)[0] == batch else x, args[i]
            )
    dyn_args = [args[i] for i in dynamic]
    avals = tuple(
        (jax.tree.structure(a), tuple((np.shape(x), str(x.dtype)) for x in jax.tree.leaves(a))) for a in dyn_args
    )
    key = (raw, mesh, tuple(sorted(rules.items())), tuple((i, args[i]) for i in static), avals, batch)

    def build():
        jitted, post = _build_program(raw, mesh, rules, cfg, args, static, batch)
        return jitted, (jitted, post)

    jitted, post = programs.program(key, build, owner=SHARDED)
    return key, jitted, dyn_args, post


def _build_program(raw, mesh, rules, cfg, args, static, batch):
    """jit(shard_map over "data" of the loop) with explicit in/out shardings; of a function object
    made here, so freeing this program frees no other (`jaxspec.core.programs`).

    The batch is split by a manual "data" axis: every data shard runs its own sequences (its own
    while loop, no per-step cross-shard collective), so nothing batch-indexed can be resharded;
    "tensor" and "expert" stay automatic inside, plus the explicit MoE shard_map.
    """
    dyn_args = [a for i, a in enumerate(args) if i not in static]
    static_values = {i: args[i] for i in static}  # the program must not keep the arrays alive
    num_args = len(args)

    def fn(*dyn):
        it = iter(dyn)
        return raw(*[static_values[i] if i in static_values else next(it) for i in range(num_args)])

    def batch_spec(x):
        shape = np.shape(x)
        return P(DATA) if shape and shape[0] == batch else P()

    data_manual = mesh.shape[DATA] > 1 and batch % mesh.shape[DATA] == 0
    # Global shapes, as traced without a mesh (the unsharded types: no data-split inputs).
    out_shapes = jax.eval_shape(fn, *jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), dyn_args))
    if data_manual:
        in_specs = tuple(P() if isinstance(a, PARAMS) else jax.tree.map(batch_spec, a) for a in dyn_args)
        # Scalars (step counters) come back per shard, [data], and are reduced by `post`.
        out_specs = jax.tree.map(lambda s: P(DATA) if s.ndim == 0 else batch_spec(s), out_shapes)

        def local(*dyn):
            with activate(mesh, rules, cfg, data_manual=True):
                return jax.tree.map(lambda x: x[None] if x.ndim == 0 else x, fn(*dyn))

        body = jax.shard_map(local, in_specs=in_specs, out_specs=out_specs, axis_names={DATA}, check_vma=False)

        def post(out):
            return jax.tree.map(lambda x, s: x.max() if s.ndim == 0 else x, out, out_shapes)
    else:
        out_specs = jax.tree.map(lambda s: P(), out_shapes)
        body = fn

        def post(out):
            return out

    in_shardings = tuple(
        param_shardings(cfg, mesh, rules, a) if isinstance(a, PARAMS)
        else jax.tree.map(lambda x: NamedSharding(mesh, batch_spec(x) if data_manual else P()), a)
        for a in dyn_args
    )
    out_shardings = jax.tree.map(lambda sp: NamedSharding(mesh, sp), out_specs, is_leaf=lambda x: isinstance(x, P))
    return jax.jit(body, in_shardings=in_shardings, out_shardings=out_shardings,
                   compiler_options=programs.compiler_options()), post


def run_sharded(
    jitted: Any,
    mesh: jax.sharding.Mesh,
    args: Sequence[Any],
    *,
    batch: int,
    cfg: ModelConfig,
    rules: Mapping[str, Any] | None = None,
) -> Any:
    """Call the program of `jitted` (a `jax.jit` function) on `mesh` with explicit in/out shardings.

    Arguments that hold arrays are dynamic, everything else (configs, python ints) is static.
    ModelParams (V4.1's too) keep their parameter shardings (call `shard_params` once to avoid a transfer per
    call); other arrays, and outputs, whose leading dim is `batch` are split over "data" (when it
    divides `batch`); the rest is replicated, and scalar outputs are per-shard counters reduced by
    max. One jitted program per (function, mesh, rules, static args, argument shapes).
    """
    key, program, dyn_args, post = _program(jitted, mesh, args, batch, cfg, rules)
    with activate(mesh, check_rules(rules), cfg):
        out = program(*dyn_args)
    programs.called(key)
    return post(out)


def lower_program(
    jitted: Any,
    mesh: jax.sharding.Mesh,
    args: Sequence[Any],
    *,
    batch: int,
    cfg: ModelConfig,
    rules: Mapping[str, Any] | None = None,
) -> Any:
    """The `jax.stages.Lowered` program `run_sharded` runs for these arguments, from their shapes
    only (arrays or ShapeDtypeStructs: nothing is allocated or placed): its HLO, and per-device
    costs of a model too large for this machine."""
    mesh = check_mesh(mesh)
    rules = check_rules(rules)
    raw = getattr(jitted, "__wrapped__", jitted)
    args = list(args)
    static = tuple(i for i, a in enumerate(args) if not is_dynamic(a))
    program, _ = _build_program(raw, mesh, rules, cfg, args, static, batch)
    def shape(x):
        return x if isinstance(x, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(np.shape(x), x.dtype)

    shapes = [jax.tree.map(shape, a) for i, a in enumerate(args) if i not in static]
    with activate(mesh, rules, cfg):
        return program.lower(*shapes)


def pad_batch(batch: Any, mesh: jax.sharding.Mesh | None) -> Any:
    """A PromptBatch whose bucket is padded up to a multiple of the mesh's "data" size."""
    if mesh is None:
        return batch
    data = check_mesh(mesh).shape[DATA]
    rows = batch.tokens.shape[0]
    target = -(-rows // data) * data
    if target == rows:
        return batch
    tokens = np.zeros((target, batch.tokens.shape[1]), batch.tokens.dtype)
    tokens[:rows] = batch.tokens
    lengths = np.ones((target,), batch.lengths.dtype)
    lengths[:rows] = batch.lengths
    return dataclasses.replace(batch, tokens=tokens, lengths=lengths)


def on_mesh(jitted: Any, mesh: jax.sharding.Mesh | None, batch: int, rules: Mapping[str, Any] | None = None) -> Any:
    """`jitted` itself without a mesh; else a callable running it through `run_sharded` (the
    ModelConfig among the call's arguments supplies head / expert counts)."""
    if mesh is None:
        return jitted

    def call(*args):
        cfgs = (a if isinstance(a, ModelConfig) else getattr(a, "cfg", None) for a in args)
        cfg = next((c for c in cfgs if isinstance(c, ModelConfig)), None)
        if cfg is None:
            raise ValueError("a sharded program needs a ModelConfig among its arguments")
        return run_sharded(jitted, mesh, args, batch=batch, cfg=cfg, rules=rules)

    return call


def _check_prefill_tokens(cfg: ModelConfig, tokens: Any) -> Any:
    """`tokens` as an integer array after the checks a [B, S] array cannot make itself: equal-length
    rows (a list of lists may be ragged) and every id inside the vocabulary (XLA would clamp it)."""
    if isinstance(tokens, (list, tuple)) and tokens and all(isinstance(r, (list, tuple, np.ndarray)) for r in tokens):
        lengths = sorted({len(r) for r in tokens})
        if len(lengths) > 1:
            raise ValueError(f"tokens must be [B, S] rows of one length, got rows of {lengths[0]}..{lengths[-1]} tokens"
                             " (pad them to one length, or use generate with prompt_lengths=)")
    if isinstance(cfg, ModelConfig) and not isinstance(tokens, jax.core.Tracer):
        ids = np.asarray(tokens)
        if ids.size and np.issubdtype(ids.dtype, np.integer) and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
    return tokens


def prefill_logits(params: Any, cfg: ModelConfig, tokens: Any, mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """`prefill.chunked_logits` (equal to the one-shot `model.one_shot_logits`), on `mesh`
    when given: tokens [B, S] -> logits [B, S, V] (rows padded to a multiple of "data" inside, cut
    back after). Ragged rows and ids outside [0, vocab_size) are one-line ValueErrors."""
    tokens = _check_prefill_tokens(cfg, tokens)
    if mesh is None:
        return chunked_logits(params, cfg, tokens)
    tokens = np.asarray(check_logits_inputs(params, cfg, tokens))
    data = check_mesh(mesh).shape[DATA]
    b = tokens.shape[0]
    padded = np.zeros((-(-b // data) * data, tokens.shape[1]), np.int32)
    padded[:b] = tokens
    cfg = cfg.replace(prefill_chunk=prefill_chunk(cfg))
    logits = run_sharded(jitted_chunked_logits, mesh, (params, cfg, jax.numpy.asarray(padded)), batch=len(padded),
                         cfg=cfg)
    if b == len(padded):
        return logits
    # rows split over an explicit "data" axis: gathered before the padding rows are cut
    return jax.reshard(logits, NamedSharding(mesh, P()))[:b]
