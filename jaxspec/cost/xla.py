"""The cost model: XLA's cost analysis of each stage of a cycle, lowered on abstract shapes (no
weights allocated, so v4-flash and v4-pro fit on a laptop), and a roofline projection of those
counts onto a named accelerator.

This is a model, not a measurement. Per stage it takes XLA's FLOP and bytes-accessed counts of the
program as written (before fusion: a gather that the compiler might fuse into its matmul is
counted as written and read back), and projects max(FLOPs / peak, bytes / bandwidth) plus a fixed
overhead per forward pass. Collectives under a mesh are reported as bytes, not projected.

Deep models are costed layer kind by layer kind: the cost of a forward is additive over its layers,
so the first (hash-routed) layers are lowered once, each further layer kind once more on top of
them, and the rest is summed (`tests/test_cost.py`: FLOPs equal a full lowering's, bytes to 0.1%).

Weights kept FP8 / FP4 (`weights="fp8"`) are costed as a fused dequantize-matmul reads them: the
program with plain weights, every access of a quantized weight counted at its stored bytes instead
(`ops.quant.count_weight_reads` tallies those accesses while tracing the quantized program, less
those whose result the stage discards, which lowering removes; a pre-fusion count of the
dequantization as written would bill its float32 intermediates).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import DropVar, Var, jaxprs_in_params

from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.model.dspark import abstract_dspark_params
from jaxspec.model.network import WEIGHTS, Models, abstract_params, without_mtp
from jaxspec.model.runner import lower_program
from jaxspec.model.sampling import Sampling
from jaxspec.model.state import abstract_state
from jaxspec.ops.quant import SCOPE, count_weight_reads
from jaxspec.sharding.active import is_dynamic
from jaxspec.sharding.rules import DATA, check_mesh
from jaxspec.speculation import stages
from jaxspec.speculation.cycle import SpecState, SpecStats, Speculator
from jaxspec.speculation.dspark import DSparkDrafter
from jaxspec.speculation.mtp import MTPDrafter

STAGES = ("ar", "draft", "plan", "verify", "commit")
# Layers lowered whole up to this depth; deeper models are costed per layer kind (exact: additive).
FULL_LOWERING_MAX_LAYERS = 8


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # FLOP/s, dense bf16
    bandwidth: float  # bytes/s used for the projection (a measured copy rate)
    nominal_bandwidth: float  # bytes/s on the data sheet, for reference


ACCELERATORS = {
    # H200 SXM: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e nominal, ~4.3 TB/s measured by a device copy.
    "h200": Accelerator("NVIDIA H200", 989e12, 4.3e12, 4.8e12),
}
DEFAULT_OVERHEAD_US = 20.0  # per forward pass: kernel launches and host dispatch (a parameter)


@dataclasses.dataclass(frozen=True)
class StageCost:
    """Per device, for one call of a stage."""

    flops: float
    bytes: float
    collective_bytes: float = 0.0
    passes: int = 1  # forward passes in the stage: what the per-pass overhead multiplies

    def __add__(self, other: StageCost) -> StageCost:
        return StageCost(self.flops + other.flops, self.bytes + other.bytes,
                         self.collective_bytes + other.collective_bytes, self.passes + other.passes)

    def scaled(self, factor: float) -> StageCost:
        return StageCost(self.flops * factor, self.bytes * factor, self.collective_bytes * factor, self.passes)


def accelerator(name: str) -> Accelerator:
    if name not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; known: {sorted(ACCELERATORS)}")
    return ACCELERATORS[name]


def project_seconds(cost: StageCost, acc: Accelerator, overhead_s: float) -> float:
    """Roofline time of one stage call: the slower of compute and memory, plus per-pass overhead."""
    return max(cost.flops / acc.peak_flops, cost.bytes / acc.bandwidth) + cost.passes * overhead_s


# ---- lowering the stages on abstract shapes -----------------------------------------------------


def _abstract_inputs(cfg: ModelConfig, spec: SpecConfig | None, batch: int, context: int,
                     draft: DSparkConfig | None = None) -> dict[str, Any]:
    """ShapeDtypeStructs of every stage's arguments (the tree and verify output by eval_shape), for a
    greedy cycle of the model's MTP draft, or of a DSpark drafter (`draft`)."""
    sds = jax.ShapeDtypeStruct
    params = abstract_params(cfg)
    state = abstract_state(cfg, batch, context)
    out = {"params": params, "state": state, "last": sds((batch,), jnp.int32)}
    if spec is not None:
        sp = Speculator(cfg, spec, MTPDrafter() if draft is None else DSparkDrafter(draft))
        sp.drafter.check(cfg, spec)
        own = params.mtp if draft is None else abstract_dspark_params(cfg, draft)
        models = Models(target=without_mtp(params), drafter=own)
        draft_state = jax.eval_shape(lambda: sp.drafter.init_state(cfg, batch, context))
        full = SpecState(target=state, drafter=draft_state, root=out["last"],
                         stats=jax.eval_shape(lambda: SpecStats.zeros(spec, batch)))
        sampling = jax.eval_shape(Sampling.create)
        tree = jax.eval_shape(lambda m, s, g: stages.draft(sp, m, s, g), models, full, sampling)
        plan = jax.eval_shape(lambda s, t: stages.plan(sp, s, t), state, tree)
        verify_out = jax.eval_shape(lambda m, s, t, p: stages.verify(sp, m, s, t, p), models, state, tree, plan)
        out.update(sp=sp, models=models, full=full, sampling=sampling, tree=tree, plan=plan, verify_out=verify_out)
    return out


def _stage_call(name: str, cfg: ModelConfig, spec: SpecConfig | None, x: dict[str, Any]) -> tuple[Callable, tuple]:
    """-> (jitted stage, its arguments in order) for stage `name`."""
    if name == "ar":
        return stages.ar_step, (x["params"], cfg, x["state"], x["last"])
    if name == "draft":
        return stages.draft, (x["sp"], x["models"], x["full"], x["sampling"])
    if name == "plan":
        return stages.plan, (x["sp"], x["state"], x["tree"])
    if name == "verify":
        return stages.verify, (x["sp"], x["models"], x["state"], x["tree"], x["plan"])
    if name == "commit":
        return stages.commit, (x["sp"], x["models"], x["full"], x["tree"], x["verify_out"], x["sampling"])
    raise ValueError(f"unknown stage {name!r}; stages: {STAGES}")


_COLLECTIVE = re.compile(
    r"=\s*(\([^)]*\)|[a-z0-9]+\[[0-9,]*\][^ ]*)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
          "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def collective_bytes(hlo_text: str) -> float:
    """Bytes produced by the collectives of an HLO module (result shapes of all-reduce, all-gather,
    reduce-scatter, all-to-all, collective-permute), per device."""
    total = 0.0
    for result, _ in _COLLECTIVE.findall(hlo_text):
        for dtype, dims in _ARRAY.findall(result):
            total += _BYTES.get(dtype, 4) * float(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def _lowered_cost(fn: Callable, args: tuple, mesh: Any, batch: int, cfg: ModelConfig,
                  extra_bytes: float = 0.0) -> StageCost:
    """XLA's cost analysis of the program as written (lowered, before fusion), plus `extra_bytes`;
    under a mesh, per device: FLOPs and collectives of the partitioned program, bytes in the same
    proportion."""
    analysis = fn.lower(*args).cost_analysis()
    flops, nbytes = float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0)) + extra_bytes
    if mesh is None:
        return StageCost(flops, nbytes)
    # Per-device numbers exist only after SPMD partitioning, i.e. a compile. The CPU backend (where
    # the mesh is simulated) upcasts bf16 operands whole before a gather and counts a fused gather's
    # whole table as read, so the partitioned program is compiled for a float32 twin of the model:
    # its FLOPs are exact, its collectives are scaled back to the model's dtype, and the bytes a
    # device reads are the program's bytes in proportion to its share of the FLOPs.
    twin = cfg.replace(dtype="float32")
    twin_args = tuple(twin if a is cfg else _as_float32(a) for a in args)
    compiled = lower_program(fn, mesh, twin_args, batch=batch, cfg=twin).compile()
    partitioned = compiled.cost_analysis()
    if isinstance(partitioned, (list, tuple)):  # older jax: one dict per device program
        partitioned = partitioned[0]
    device_flops = float(partitioned.get("flops", 0.0))
    share = device_flops / flops if flops else 1.0
    dtype_scale = jnp.dtype(cfg.dtype).itemsize / 4
    return StageCost(device_flops, nbytes * share, collective_bytes(compiled.as_text()) * dtype_scale)


def _as_float32(tree: Any) -> Any:
    """ShapeDtypeStructs of a stage argument with floating leaves in float32 (other args as they are)."""
    if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree)):
        return tree
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def _truncated(cfg: ModelConfig, layer_types: Sequence[str]) -> ModelConfig:
    return cfg.replace(num_layers=len(layer_types), layer_types=tuple(layer_types),
                       num_hash_layers=min(cfg.num_hash_layers, len(layer_types)))


def stored_bytes_delta(name: str, cfg: ModelConfig, spec: SpecConfig | None, inputs: dict[str, Any],
                       experts: str = "fp4") -> int:
    """Bytes a stage reads less when the weights the release stores quantized stay FP8 / FP4: for every
    access of such a weight in the traced program, its stored bytes minus its plain bytes (<= 0)."""
    fn, args = _stage_call(name, cfg, spec, dict(inputs, params=abstract_params(cfg, "fp8", experts)))
    raw = getattr(fn, "__wrapped__", fn)  # the Python body runs (a jit cache hit would trace nothing)
    dynamic = [i for i, a in enumerate(args) if is_dynamic(a)]

    def call(*dyn):
        full = list(args)
        for i, x in zip(dynamic, dyn, strict=True):
            full[i] = x
        return raw(*full)

    with count_weight_reads() as reads:
        closed = jax.make_jaxpr(call)(*[args[i] for i in dynamic])
    live = reads.live(_live_scopes(closed.jaxpr))  # lowering drops what the stage discards; so do we
    return live.stored - live.dequantized


def _live_scopes(jaxpr: Any) -> set[str]:
    """Named scopes of the weight reads (`ops.quant.SCOPE`) with an op that reaches the outputs (or
    has an effect): a backward liveness pass over the equations, whole for those with sub-programs."""
    live = {v for v in jaxpr.outvars if isinstance(v, Var)}
    scopes: set[str] = set()

    def collect(eqn: Any) -> None:
        scopes.update(p for p in str(eqn.source_info.name_stack).split("/") if p.startswith(SCOPE))
        for sub in jaxprs_in_params(eqn.params):
            for inner in sub.eqns:
                collect(inner)

    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars if not isinstance(v, DropVar)):
            live.update(v for v in eqn.invars if isinstance(v, Var))
            collect(eqn)
    return scopes


def _layered_cost(name: str, cfg: ModelConfig, spec: SpecConfig | None, batch: int, context: int,
                  mesh: Any, weights: str = "plain", experts: str = "fp4",
                  draft: DSparkConfig | None = None) -> StageCost:
    """A stage's cost on the full config: lowered whole for shallow models, else the hash-routed
    prefix plus one lowering per further layer kind, summed over the layers (costs are additive). A
    DSpark draft reads captured layers deep in the target: its cycle is always lowered whole."""

    def lowered(c: ModelConfig) -> StageCost:
        inputs = _abstract_inputs(c, spec, batch, context, draft)
        fn, args = _stage_call(name, c, spec, inputs)
        extra = stored_bytes_delta(name, c, spec, inputs, experts) if weights == "fp8" else 0
        return _lowered_cost(fn, args, mesh, batch, c, extra)

    if cfg.num_layers <= FULL_LOWERING_MAX_LAYERS or (draft is not None and name != "ar"):
        return lowered(cfg)
    prefix = list(cfg.layer_types[: max(cfg.num_hash_layers, 1)])
    base = lowered(_truncated(cfg, prefix))
    total = base
    deltas: dict[str, StageCost] = {}
    for kind in cfg.layer_types[len(prefix):]:
        if kind not in deltas:
            with_kind = lowered(_truncated(cfg, [*prefix, kind]))
            deltas[kind] = StageCost(with_kind.flops - base.flops, with_kind.bytes - base.bytes,
                                     with_kind.collective_bytes - base.collective_bytes, 0)
        total = total + deltas[kind]
    return total


def stage_costs(cfg: ModelConfig, spec: SpecConfig | None, batch: int, context: int, mesh: Any = None,
                which: Sequence[str] = STAGES, weights: str = "plain", experts: str = "fp4",
                draft: DSparkConfig | None = None) -> dict[str, StageCost]:
    """Per device cost of one call of each stage: "ar" (one greedy decode step), and with a spec
    "draft", "plan", "verify" (the target over D nodes) and "commit" (acceptance + path commit + MTP
    refresh). The decode state holds `context` positions per sequence. weights "fp8": the weights the
    release stores quantized are read at their stored bytes (`experts`: "fp4" or "fp8" routed experts).
    `draft`: a DSpark drafter's cycle (one block pass and the Markov loop; the verify captures its
    layers; the commit writes its rings) instead of the MTP block's."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if batch < 1 or context < 2:
        raise ValueError(f"need batch >= 1 and context >= 2, got {batch}, {context}")
    if mesh is not None:
        mesh = check_mesh(mesh)
        if batch % mesh.shape[DATA]:
            raise ValueError(f"batch {batch} must divide by the mesh's data axis {mesh.shape[DATA]}")
    out = {}
    for name in which:
        if name != "ar" and spec is None:
            continue
        cost = _layered_cost(name, cfg, spec, batch, context, mesh, weights, experts, draft)
        steps = (spec.num_steps if draft is None else 1) if spec else 0  # DSpark: one block pass
        passes = {"ar": 1, "draft": steps, "plan": 0, "verify": 1, "commit": 1}[name]
        out[name] = dataclasses.replace(cost, passes=passes)
    return out


# ---- projection ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Projection:
    spec: str  # "ar" for the autoregressive step
    batch: int
    costs: dict[str, StageCost]
    seconds: dict[str, float]  # projected per stage
    step_seconds: float  # AR: one step; spec: one cycle (sum of its stages)

    def speedup(self, tau: float, ar: Projection) -> float:
        """Tokens/s over AR at mean accepted length tau: tau tokens per cycle vs one per step."""
        return tau * ar.step_seconds / self.step_seconds


def project(cfg: ModelConfig, specs: Sequence[SpecConfig], batch_sizes: Sequence[int], context: int,
            acc: Accelerator, overhead_s: float, mesh: Any = None,
            progress: Callable[[str], None] | None = None, weights: str = "plain",
            experts: str = "fp4", draft: DSparkConfig | None = None) -> list[Projection]:
    """AR and each spec's cycle per batch size, costed and projected onto `acc`."""
    out = []
    for batch in batch_sizes:
        for spec in [None, *specs]:
            if progress is not None:
                progress(f"batch {batch} {spec.name if spec else 'ar'}")
            which = ("ar",) if spec is None else STAGES[1:]
            costs = stage_costs(cfg, spec, batch, context, mesh, which, weights, experts, draft)
            seconds = {name: project_seconds(c, acc, overhead_s) for name, c in costs.items()}
            out.append(Projection("ar" if spec is None else spec.name, batch, costs, seconds, sum(seconds.values())))
    return out


@functools.lru_cache(maxsize=8)
def _cached_projection(cfg: ModelConfig, spec: SpecConfig | None, batch: int, context: int, acc_name: str,
                       overhead_s: float) -> float:
    which = ("ar",) if spec is None else STAGES[1:]
    costs = stage_costs(cfg, spec, batch, context, None, which)
    return sum(project_seconds(c, accelerator(acc_name), overhead_s) for c in costs.values())


def projected_seconds(cfg: ModelConfig, spec: SpecConfig | None, batch: int, context: int, acc_name: str,
                      overhead_s: float = DEFAULT_OVERHEAD_US * 1e-6) -> float:
    """Projected seconds of one AR step (spec None) or one cycle, unsharded (cached)."""
    return _cached_projection(cfg, spec, batch, context, acc_name, overhead_s)
