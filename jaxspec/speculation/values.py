"""Node values: a calibrated estimate of P(node accepted | parent accepted) from the draft's own
features, the score drafting and pruning rank candidates by (docs/calibration.md).

A candidate's score is the sum of log-values along its path (the product of its ancestors'
conditional acceptance probabilities = the probability that the walk reaches it). Raw draft
log-probabilities are the uncalibrated special case (`node_log_values(None, ...)`).

Two maps, one event each:
- greedy: the node's token is the target's argmax after its accepted parent. Features: depth, rank
  among its siblings, the node's own draft probability (nondecreasing in it).
- sampling at temperature T (the target-only rule: acceptance = the target's processed probability
  of the token): depth, rank and the PARENT's top-1 draft probability only, never the node's own
  token or probability, so a sampled-draft verifier stays exact whatever the children drawn
  (rank 0 nondecreasing, later ranks nonincreasing in the parent's top-1 probability).

A "both" calibration (`Calibration.feature`, specs named `_vb`) reads two features in its greedy maps: the
node's draft probability against its siblings' (`both_first_feature`: a rank-0 child's lead over the
runner-up, 1 - q_1 / q_0; a later child's q_r / q_0, how close it comes to the top child) and the
drafter's confidence that the slot's top child survives, sigma(c) (a DSpark drafter's confidence head),
in a table with one more axis (CONFIDENCE_EDGES). Its sampling maps stay those of the draft probability.

Greedy values may also depend on the sequence's context: how much its own drafts have been accepted
so far (mean min(accepted, CONTEXT_CAP) per cycle, `context_bins`). The same draft probability is
accepted more often in a sequence the draft predicts well (docs/calibration.md, "The context
feature"); one greedy map per context bin (`Calibration.greedy_by_context`) ranks by that, the pooled
greedy map stays the value of trees too shallow to measure it (S < CONTEXT_CAP) and of callers that
pass no context.

A `Calibration` is a frozen, hashable table (static in jit). This module holds what decoding reads: the
maps, their file, which draft they belong to, and their lookup in a drafting step. Fitting them
(binning, smoothing, pool-adjacent-violators) is the harness's: harness/fit_values.py `fit_map`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.core.config import ModelConfig
from jaxspec.core.spec import VALUE_SOURCES, SpecConfig
from jaxspec.model.network import standard_layout
from jaxspec.model.sampling import select_rows

CALIBRATION_FILE = "calibration.json"  # the draft-probability values; other sources: `calibration_file`
PROB_EDGES = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # 13 bins
DEPTH_EDGES = (2, 3, 4, 5, 7, 10)  # depth bins: 1, 2, 3, 4, 5-6, 7-9, 10+
NUM_RANKS = 4  # ranks 0, 1, 2, 3+
FORMAT = "jaxspec-calibration-v1"
CONTEXT_CAP = 8  # a cycle counts min(accepted, 8) towards its sequence's context
CONTEXT_EDGES = (3.5, 5.5)  # context bins of the mean: < 3.5, 3.5-5.5, >= 5.5
CONTEXT_START = 4.5  # the mean assumed before a sequence's first cycle (the middle bin)
CONFIDENCE_EDGES = (0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9)  # 8 bins of sigma(c), the second axis of "both" maps
SAMPLED_MODES = ("sampling", "residual", "block")  # the maps fitted per sampling temperature


@dataclasses.dataclass(frozen=True)
class ValueMap:
    """P(accepted | parent accepted) per (depth bin, rank bin, probability bin), flattened."""

    # "greedy" (feature: own draft prob), "sampling" (feature: parent's top-1 draft prob), "residual"
    # (the recursive-rejection event of sampled drafts; feature: parent's processed top-1 draft prob) or
    # "block" (the same drafts under the block rule: P(the path passes the child) / P(it passes the parent))
    mode: str
    temperature: float  # 0 for greedy
    table: tuple[float, ...]  # [depth bins, NUM_RANKS, prob bins(, confidence bins)] row-major
    counts: tuple[int, ...]  # samples behind each cell (same layout)

    @property
    def two_features(self) -> bool:
        """The map of a "both" calibration's greedy values: a confidence axis after the probability's."""
        return len(self.table) == _cells() * (len(CONFIDENCE_EDGES) + 1)

    def array(self) -> np.ndarray:
        shape = (len(DEPTH_EDGES) + 1, NUM_RANKS, len(PROB_EDGES) + 1)
        return np.asarray(self.table, np.float64).reshape(*shape, *((len(CONFIDENCE_EDGES) + 1,) if self.two_features
                                                                    else ()))


def _cells() -> int:
    """Cells of a one-feature map."""
    return (len(DEPTH_EDGES) + 1) * NUM_RANKS * (len(PROB_EDGES) + 1)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The greedy map and one sampling map per fitted temperature, for one checkpoint's draft."""

    fingerprint: str  # `draft_fingerprint` of the checkpoint it was fitted for
    greedy: ValueMap
    sampling: tuple[ValueMap, ...]  # ascending temperature
    meta: tuple[tuple[str, str], ...] = ()  # provenance (datasets, prompts, spec, ...) as strings
    greedy_by_context: tuple[ValueMap, ...] = ()  # one greedy map per context bin (CONTEXT_EDGES), or none
    residual: tuple[ValueMap, ...] = ()  # sampled drafts' values (speculation/sampled.py), ascending temperature
    # the same under the block rule (harness/calibrate_block.py): what a child adds to P(the path passes it)
    block: tuple[ValueMap, ...] = ()
    feature: str = "draft"  # what the maps read: "draft" probability, "confidence" or "both" (tree.Expander)

    def __post_init__(self):
        two = self.feature == "both"
        if any(m.two_features != two for m in (self.greedy, *self.greedy_by_context)) or any(
            m.two_features for m in (*self.sampling, *self.residual, *self.block)
        ):
            raise ValueError(f"a {self.feature!r} calibration's greedy maps must {'' if two else 'not '}have the "
                             "confidence axis, its sampling and residual maps never")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "prob_edges": list(PROB_EDGES),
            "depth_edges": list(DEPTH_EDGES),
            "num_ranks": NUM_RANKS,
            "maps": [dataclasses.asdict(m) for m in (self.greedy, *self.sampling, *self.residual, *self.block)],
            "meta": dict(self.meta),
            **({"feature": self.feature} if self.feature != "draft" else {}),
            **({"confidence_edges": list(CONFIDENCE_EDGES)} if self.feature == "both" else {}),
            **({"context": {"cap": CONTEXT_CAP, "edges": list(CONTEXT_EDGES),
                            "maps": [dataclasses.asdict(m) for m in self.greedy_by_context]}}
               if self.greedy_by_context else {}),
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "calibration") -> Calibration:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{source} is not a jaxspec calibration file (format must be {FORMAT!r})")
        if (tuple(data.get("prob_edges", ())), tuple(data.get("depth_edges", ())), data.get("num_ranks")) != (
            PROB_EDGES, DEPTH_EDGES, NUM_RANKS
        ):
            raise ValueError(f"{source} uses other bins than this jaxspec version; re-run `jaxspec calibrate`")
        feature = data.get("feature", "draft")
        if feature not in VALUE_SOURCES:
            raise ValueError(f"{source}: feature must be one of {VALUE_SOURCES}, got {feature!r}")
        if feature == "both" and tuple(data.get("confidence_edges", ())) != CONFIDENCE_EDGES:
            raise ValueError(f"{source} uses other confidence bins than this jaxspec version; "
                             "re-run `jaxspec calibrate`")
        size = _cells()
        greedy_size = size * (len(CONFIDENCE_EDGES) + 1 if feature == "both" else 1)

        def value_map(m: Any) -> ValueMap:
            return ValueMap(str(m["mode"]), float(m["temperature"]), tuple(float(x) for x in m["table"]),
                            tuple(int(x) for x in m["counts"]))

        try:
            maps = [value_map(m) for m in data["maps"]]
            fingerprint = str(data["fingerprint"])
            meta = tuple(sorted((str(k), str(v)) for k, v in dict(data.get("meta", {})).items()))
            context = data.get("context")
            by_context = [] if context is None else [value_map(m) for m in context["maps"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source} has a missing or malformed field: {e}") from None
        if not maps or maps[0].mode != "greedy" or any(m.mode not in SAMPLED_MODES for m in maps[1:]):
            raise ValueError(f"{source} must hold the greedy map first, then sampling (residual, block) maps")
        if context is not None and (
            (context.get("cap"), tuple(context.get("edges", ()))) != (CONTEXT_CAP, CONTEXT_EDGES)
            or len(by_context) != len(CONTEXT_EDGES) + 1 or any(m.mode != "greedy" for m in by_context)
        ):
            raise ValueError(f"{source}: its context maps use other bins than this jaxspec version "
                             f"(cap {CONTEXT_CAP}, edges {list(CONTEXT_EDGES)}, greedy maps); "
                             "re-run `jaxspec calibrate`")
        if any(len(m.table) != (greedy_size if m.mode == "greedy" else size) or len(m.counts) != len(m.table)
               or not all(0.0 < x < 1.0 for x in m.table) for m in (*maps, *by_context)):
            raise ValueError(f"{source}: every greedy map needs {greedy_size} values in (0, 1), every other map {size}")
        by_mode = {mode: tuple(sorted((m for m in maps[1:] if m.mode == mode), key=lambda m: m.temperature))
                   for mode in SAMPLED_MODES}
        return cls(fingerprint=fingerprint, greedy=maps[0], sampling=by_mode["sampling"], meta=meta,
                   greedy_by_context=tuple(by_context), residual=by_mode["residual"], block=by_mode["block"],
                   feature=feature)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if path.is_dir():
            path = path / CALIBRATION_FILE
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def calibration_file(values: str) -> str:
    """The file a draft's folder keeps the calibration of value source `values` in: calibration.json for the
    draft probability, calibration_<source>.json for the others (a folder can hold one of each)."""
    if values not in VALUE_SOURCES:
        raise ValueError(f"values must be one of {', '.join(VALUE_SOURCES)}, got {values!r}")
    return CALIBRATION_FILE if values == "draft" else f"calibration_{values}.json"


# ---- which draft a calibration belongs to ------------------------------------------------------


def draft_fingerprint(draft: Any, cfg: ModelConfig) -> str:
    """sha256 over the architecture (dtype excluded) and a strided sample of every leaf of the draft's
    parameters (`Draft.params`), rounded to bfloat16: the same for a bf16 checkpoint and its float32 cast,
    different for another draft."""
    if draft is None:
        raise ValueError("a calibration is for a draft; these params have none")
    draft = standard_layout(draft)  # the same for a CPU layout of the same weights
    # How the model is run stays out: the run options (not in `architecture()`) and the dtype.
    arch = {k: v for k, v in cfg.architecture().items() if k != "dtype"}
    if arch["v41"] is None:  # a V4 config hashes as it did before the field existed (shipped calibrations)
        del arch["v41"]
    h = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode())
    for path, leaf in jax.tree_util.tree_flatten_with_path(draft)[0]:
        flat = jnp.ravel(leaf)
        stride = max(1, flat.shape[0] // 1024)
        sample = np.asarray(jax.device_get(flat[::stride][:1024].astype(jnp.bfloat16))).view(np.uint16)
        h.update(jax.tree_util.keystr(path).encode() + str(tuple(leaf.shape)).encode() + sample.tobytes())
    return h.hexdigest()[:16]


def load_calibration(path: str | Path, draft: Any = None, cfg: ModelConfig | None = None) -> Calibration:
    """Read calibration.json (the file or the checkpoint folder); with the draft's parameters and cfg,
    check it was fitted for them (one-line ValueError otherwise)."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / CALIBRATION_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no calibration at {str(path)!r}; run `jaxspec calibrate --checkpoint FOLDER`")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    calibration = Calibration.from_json(data, str(path))
    if draft is not None and cfg is not None:
        check_fitted(calibration, draft, cfg, str(path))
    return calibration


def check_fitted(calibration: Calibration, draft: Any, cfg: ModelConfig, source: str = "the calibration") -> None:
    """One-line ValueError unless `calibration` was fitted for this draft's parameters."""
    expected = draft_fingerprint(draft, cfg)
    if calibration.fingerprint != expected:
        raise ValueError(f"{source} was fitted for another draft (fingerprint {calibration.fingerprint}, this "
                         f"draft is {expected}); re-run `jaxspec calibrate` for it")


def resolve_scores(spec: SpecConfig, calibration: Calibration | None) -> tuple[SpecConfig, Calibration | None]:
    """-> (spec with scores "calibrated" or "draft", the node values to rank by or None).

    "draft": raw draft log-probs. "auto": `calibration` where there is one, else raw. "calibrated": like
    auto, but no calibration is an error.
    """
    if calibration is not None and not isinstance(calibration, Calibration):
        raise ValueError(f"calibration must be a Calibration, its file or a checkpoint folder, got {calibration!r}")
    if spec.scores == "draft":
        return spec, None
    if calibration is not None and calibration.feature != spec.values:
        if spec.scores == "calibrated":
            raise ValueError(f"the calibration maps the draft's {calibration.feature!r} values, the spec ranks by "
                             f"{spec.values!r}: calibrate for it (jaxspec calibrate --values {spec.values})")
        calibration = None  # "auto": raw values of the spec's own feature
    if calibration is None and spec.values == "both":
        raise ValueError(f"{spec.name}: values='both' ranks by a calibration over the draft probability and the "
                         "confidence head together and has no uncalibrated form; pass calibration= a 'both' "
                         "calibration (jaxspec calibrate --values both), or rank by 'draft' or 'confidence' (_vc)")
    if calibration is None:
        if spec.scores == "calibrated":
            raise ValueError('scores="calibrated" needs a calibration: calibration= (a Calibration or its file), '
                             "or a draft with one (load_checkpoint of a folder with calibration.json)")
        return dataclasses.replace(spec, scores="draft"), None
    return dataclasses.replace(spec, scores="calibrated"), calibration


# ---- the values in a drafting step ------------------------------------------------------------


def both_first_feature(rank: Any, own: Any, top1: Any, runner_up: Any) -> Any:
    """The probability axis of a "both" map, from a slot's draft probabilities q_0 >= q_1 >= ...: rank 0
    its lead over the runner-up, 1 - q_1 / q_0; a later rank q_r / q_0. A sibling is right only where the
    top child is wrong, and how the two compare says more about both than either's own probability
    (held-out AUC on the DSpark drafter: rank 1 0.83 against 0.69 for q_1, rank 0 0.75 against 0.65 for
    q_0; docs/calibration.md). numpy or jax arrays alike."""
    xp = jnp if isinstance(own, jax.Array) else np
    return xp.where(rank > 0, own / top1, 1.0 - runner_up / top1)


def depth_bin(depth: int) -> int:
    return int(np.searchsorted(np.asarray(DEPTH_EDGES), depth, side="right"))


def _lookup(table: np.ndarray, depth: int, rank: jax.Array, prob: jax.Array, confidence: jax.Array | None = None
            ) -> jax.Array:
    """table [depth bins, ranks, prob bins(, confidence bins)] -> values at (static depth, rank, prob(, confidence))."""
    rows = jnp.asarray(table[depth_bin(depth)], jnp.float32)  # [R, P(, C)]
    prob_index = jnp.searchsorted(jnp.asarray(PROB_EDGES, jnp.float32), prob, side="right")
    if rows.ndim == 2:
        return rows[jnp.minimum(rank, NUM_RANKS - 1), prob_index]
    confidence_index = jnp.searchsorted(jnp.asarray(CONFIDENCE_EDGES, jnp.float32), confidence, side="right")
    return rows[jnp.minimum(rank, NUM_RANKS - 1), prob_index, confidence_index]


def context_bins(
    capped_accepted: jax.Array,  # [B] sum over the sequence's cycles so far of min(accepted, CONTEXT_CAP)
    cycles: jax.Array,  # [B] int32 cycles so far
) -> jax.Array:
    """-> [B] int32 context bin of each sequence (CONTEXT_EDGES over its mean; CONTEXT_START before any cycle)."""
    mean = jnp.where(cycles > 0, capped_accepted.astype(jnp.float32) / jnp.maximum(cycles, 1), CONTEXT_START)
    return jnp.searchsorted(jnp.asarray(CONTEXT_EDGES, jnp.float32), mean, side="right").astype(jnp.int32)


def node_log_values(
    calibration: Calibration | None,
    depth: int,  # static: the depth of the children (1 = the root's)
    top_logp: jax.Array,  # [B, n, K] draft log-probs of each slot's top-K children, descending
    temperature: jax.Array | None = None,  # [] or [B] traced; > 0 uses the sampling map nearest in temperature
    context: jax.Array | None = None,  # [B] int32 context bin (`context_bins`); None = the pooled greedy map
    confidence: jax.Array | None = None,  # [B, n, K] sigma(c) of each child's slot; read by "both" calibrations only
) -> jax.Array:
    """-> [B, n, K] log P(child accepted | slot accepted): the raw draft log-probs without a calibration.
    A "both" calibration reads a slot's runner-up too: pass K >= 2 (`Expander` drafts top-2 for it)."""
    if calibration is None:
        return top_logp
    if calibration.feature == "both" and confidence is None:
        raise ValueError("a 'both' calibration reads the drafter's confidence head; this drafter has none")
    if calibration.feature == "both" and top_logp.shape[-1] < 2:
        raise ValueError("a 'both' calibration reads a slot's runner-up: pass its top-2 draft log-probs at least")
    second = confidence if calibration.feature == "both" else None
    k = top_logp.shape[-1]
    rank = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), top_logp.shape)
    own = jnp.exp(top_logp)
    greedy_prob = own if second is None else both_first_feature(rank, own, own[..., :1], own[..., 1:2])
    if context is not None and calibration.greedy_by_context:
        per_context = jnp.stack([_lookup(m.array(), depth, rank, greedy_prob, second)
                                 for m in calibration.greedy_by_context])
        value = jnp.take_along_axis(per_context, context[None, :, None, None], axis=0)[0]  # [B, n, K]
    else:
        value = _lookup(calibration.greedy.array(), depth, rank, greedy_prob, second)
    if calibration.sampling and temperature is not None:
        parent_top1 = jnp.broadcast_to(own[..., :1], own.shape)  # siblings share it
        temps = jnp.asarray([m.temperature for m in calibration.sampling], jnp.float32)
        tables = np.stack([m.array() for m in calibration.sampling])  # [M, Db, R, P]
        per_map = jnp.stack([_lookup(t, depth, rank, parent_top1) for t in tables], axis=1)  # [B, M, n, K]
        nearest = jnp.argmin(jnp.abs(temps - temperature[..., None]), axis=-1)  # [] or [B]
        chosen = jnp.take_along_axis(per_map, jnp.broadcast_to(nearest, (per_map.shape[0],))[:, None, None, None],
                                     axis=1)[:, 0]
        value = select_rows(temperature > 0, chosen, value)
    return jnp.log(value)
