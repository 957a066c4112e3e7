"""The analytic stage table: each stage of a cycle as a sum of named terms a person can check by
hand (docs/cost_model.md), per device.

A pass runs `tokens` tokens per sequence through a list of units (main layers, the MTP block, the
head; a DSpark drafter's stages, `dspark_table`). Bytes: every unit's whole weights once (at stored
precision), the routed experts its tokens touch (expected distinct, `routing`), the gathered rows
(embedding, hash table), the decode state it reads and the rows it commits. FLOPs: 2 x tokens x matmul elements, 2 x
assignments x expert elements, attention over the window + compressed entries (+ the indexer).
Collectives per layer from the mesh. The context is assumed full (the state holds `context`
positions and every compressed entry exists), the worst case a decode step meets.
"""

from __future__ import annotations

import dataclasses

from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.core.spec import SpecConfig
from jaxspec.cost import routing
from jaxspec.cost.inventory import LayerState, Unit, layout_units, state_layers

STAGES = ("ar", "draft", "plan", "verify", "commit")
COLLECTIVES = ("all_reduce", "all_to_all", "all_gather")


@dataclasses.dataclass(frozen=True)
class Costs:
    """Per device, one call of a stage: named byte and FLOP terms, collectives, launch units."""

    bytes: dict[str, float]  # mean device
    busiest_bytes: float  # the device a step waits for (its routed experts at the expected maximum)
    flops: dict[str, float]
    collectives: dict[str, tuple[int, float]]  # kind -> (count, bytes per device)
    layer_passes: dict[str, int]  # unit kind -> passes (what the launch term multiplies)
    passes: int  # forward passes

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())

    @property
    def total_flops(self) -> float:
        return sum(self.flops.values())

    def __add__(self, o: Costs) -> Costs:
        def add(a, b):
            return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {**a, **b}}

        coll = {k: (self.collectives.get(k, (0, 0.0))[0] + o.collectives.get(k, (0, 0.0))[0],
                    self.collectives.get(k, (0, 0.0))[1] + o.collectives.get(k, (0, 0.0))[1])
                for k in {**self.collectives, **o.collectives}}
        passes = {k: self.layer_passes.get(k, 0) + o.layer_passes.get(k, 0)
                  for k in {**self.layer_passes, **o.layer_passes}}
        return Costs(add(self.bytes, o.bytes), self.busiest_bytes + o.busiest_bytes, add(self.flops, o.flops), coll,
                     passes, self.passes + o.passes)


EMPTY = Costs({}, 0.0, {}, {}, {}, 0)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything a stage's terms depend on besides the stage."""

    cfg: ModelConfig
    mesh: tuple[int, int, int]  # (data, tensor, expert)
    batch: int
    context: int
    weights: str = "plain"
    experts: str = "fp4"
    overlap: float = 0.0  # routing overlap of learned routers (hash layers stay independent)
    layout: str = "rules"  # "rules" (jaxspec's sharding) or "even" (every weight split evenly)
    mtp_weights: str | None = None  # the MTP block's own stored precision (None: as `weights`)
    moe_groups: int | None = None  # even layout: expert-parallel groups, each expert tensor-split (None: EP only)

    @property
    def rows(self) -> int:  # sequences on one data shard
        return -(-self.batch // self.mesh[0])

    @property
    def act_bytes(self) -> int:
        return 2 if self.cfg.dtype == "bfloat16" else 4

    def units(self, draft: DSparkConfig | None = None) -> dict[str, Unit]:
        """The target's units (and its MTP block's); with `draft` a DSpark drafter's too ("dspark.*")."""
        units = layout_units(self.cfg, self.mesh, self.weights, self.experts, self.layout, self.moe_groups, draft)
        if self.mtp_weights is None:
            return units
        mtp = layout_units(self.cfg, self.mesh, self.mtp_weights, self.experts, self.layout, self.moe_groups)
        return {**units, **{name: mtp[name] for name in ("mtp", "mtp_kv", "mtp_head")}}

    def state(self) -> dict[str, LayerState]:
        return state_layers(self.cfg, self.mesh, self.batch, self.context)


def check_setup(cfg: ModelConfig, mesh: tuple[int, int, int], batch: int, context: int) -> None:
    """ValueError (one line) unless the mesh divides the model and the batch."""
    data, tensor, expert = mesh
    if min(mesh) < 1:
        raise ValueError(f"mesh must be three positive ints, got {mesh}")
    if cfg.num_heads % tensor or cfg.o_groups % tensor:
        raise ValueError(f"mesh tensor={tensor} must divide num_heads={cfg.num_heads} and o_groups={cfg.o_groups}")
    if cfg.n_routed_experts % (tensor * expert):
        raise ValueError(f"mesh tensor x expert = {tensor * expert} must divide "
                         f"n_routed_experts={cfg.n_routed_experts}")
    if batch < 1 or batch % data:
        raise ValueError(f"batch {batch} must be >= 1 and divide by the mesh's data axis {data}")
    if not 2 <= context <= cfg.max_position_embeddings:
        raise ValueError(f"context must be in [2, {cfg.max_position_embeddings}], got {context}")


def selection(cfg: ModelConfig, name: str) -> tuple[bool, bool]:
    """-> (the unit's attention reads top-k picked entries, it scores the index keys itself). V4: a CSA
    layer does both, HCA reads every entry. V4.1: every compressed layer reads the top-k of its owner's
    pool; only the index sources score (the layers after one reuse its picks); a DSpark stage neither."""
    if not name.startswith("layers."):
        return False, False
    layer = int(name.split(".")[1])
    if cfg.v41 is not None:
        return cfg.v41.ratios[layer] > 0, layer in cfg.v41.index_sources
    indexed = cfg.geometry(cfg.layer_types[layer]).indexed
    return indexed, indexed


def _attention_keys(cfg: ModelConfig, name: str, tokens: int, prior: int, st: LayerState) -> tuple[float, float]:
    """-> (keys one token's heads read, index keys it scores) on unit `name`."""
    keys = cfg.sliding_window + tokens + prior  # committed ring + the new (and scratch) tokens
    picks, scores = selection(cfg, name)
    if picks:
        keys += min(cfg.index_topk, st.entries + tokens) + tokens
        return keys, (st.entries + tokens) if scores else 0.0
    if st.entries:
        keys += st.entries + tokens  # every committed entry + branch-local candidates
    return keys, 0.0


def kv_pass(s: Setup, tokens: int, commit: int) -> Costs:
    """The MTP refresh of the commit stage: only the window kv rows of the MTP block are kept
    (e/h projections, the attention-side hyper-connection, wkv), written for `commit` tokens."""
    u, st = s.units()["mtp_kv"], s.state()["mtp"]
    n = s.rows * tokens
    nbytes = {"weights": u.dense_bytes, "state_write": s.rows * commit * st.write_row_bytes}
    return Costs(nbytes, sum(nbytes.values()), {"matmul": 2.0 * n * u.dense_elems}, {}, {"mtp_kv": 1}, 0)


def layer_pass(s: Setup, name: str, tokens: int, prior: int = 0, commit: int = 0,
               draft: DSparkConfig | None = None) -> Costs:
    """One pass of `tokens` tokens per sequence through unit `name` ("layers.i", "mtp" or, with
    `draft`, a DSpark stage "dspark.stage.i" over its context ring); `prior` scratch keys a draft step
    also reads; `commit` tokens per sequence written to its state."""
    cfg, u = s.cfg, s.units(draft)[name]
    st = s.state()["ring" if name.startswith("dspark.") else name]
    kind = launch_kind(cfg, name)
    n = s.rows * tokens  # tokens on this device's data shard
    moe = draft.stage_config(cfg) if name.startswith("dspark.") else cfg  # V4.1's stages: their own MoE
    e, k = moe.n_routed_experts, moe.num_experts_per_tok
    overlap = 0.0 if u.hash_routed else s.overlap
    mean = routing.expected_mean_per_device(e, k, n, u.expert_groups, overlap)
    busiest = routing.expected_max_per_device(e, k, n, u.expert_groups, overlap)
    keys, index_keys = _attention_keys(cfg, name, tokens, prior, st)
    selected = 0.0
    if selection(cfg, name)[0]:  # top-k layers read only the entries their tokens pick (at most all of them)
        selected = s.rows * min(st.entries, tokens * min(cfg.index_topk, st.entries)) * st.entry_bytes
    nbytes = {
        "weights": u.dense_bytes,
        "experts": mean * u.expert_bytes,
        "rows": n * u.row_bytes,
        "state_read": st.read_bytes + selected,
        "state_write": s.rows * commit * st.write_row_bytes,
    }
    ci, hi = cfg.index_head_dim, cfg.index_n_heads
    flops = {
        "matmul": 2.0 * n * u.dense_elems,
        "experts": 2.0 * n * k / u.expert_groups * u.expert_elems,
        "attention": 4.0 * n * u.heads * cfg.head_dim * keys,
        "indexer": 2.0 * n * hi * (ci + 1) * index_keys,
    }
    d, t, g = cfg.hidden_size, s.mesh[1], u.expert_groups
    coll: dict[str, tuple[int, float]] = {}
    if t > 1:  # the head-split attention output is summed over "tensor"
        coll["all_reduce"] = (1, 2.0 * (t - 1) / t * n * d * s.act_bytes)
    if s.moe_groups is not None and t * s.mesh[2] > 1:  # tokens replicated: partial sums all-reduced
        count, sent = coll.get("all_reduce", (0, 0.0))
        coll["all_reduce"] = (count + 1, sent + 2.0 * (t - 1) / t * n * d * s.act_bytes)
    elif g > 1:  # dispatch + combine of the routed assignments over the expert devices
        coll["all_to_all"] = (2, 2.0 * (g - 1) / g * n * k * d * s.act_bytes)
    busy = nbytes["weights"] + busiest * u.expert_bytes + nbytes["rows"] + nbytes["state_read"] + nbytes["state_write"]
    passes = {kind: 1}
    if cfg.v41 is not None and name.startswith("layers."):
        layer = int(name.split(".")[1])
        if layer in cfg.v41.engram_layers:  # its own kernels beside the attention's and the MoE's
            passes["engram"] = 1
        if layer == cfg.v41.candidate_source:  # the block maxima, the block top-k and the candidate mask
            passes["candidates"] = 1
    return Costs(nbytes, busy, flops, coll, passes, 0)


def launch_kind(cfg: ModelConfig, name: str) -> str:
    """The kernel-count kind of unit `name` (`latency.DEFAULT_KERNELS`): a main layer's kind, V4.1's
    compressed layers by role ("owner": compressor and indexer, "reindex": an indexer over the owner's
    keys, "reuse": the owner's pool through the last picks), "sliding" for a draft block."""
    if not name.startswith("layers."):
        return "sliding"
    layer = int(name.split(".")[1])
    v = cfg.v41
    if v is None or not v.ratios[layer]:
        return cfg.layer_types[layer]
    return "owner" if layer in v.kv_sources else "reindex" if layer in v.index_sources else "reuse"


def head_pass(s: Setup, tokens: int, mtp: bool = False, draft: DSparkConfig | None = None) -> Costs:
    """The hc head and final norm (the MTP block's own with `mtp`, the DSpark drafter's with `draft`)
    and the shared vocab head over `tokens` tokens per sequence."""
    units = s.units(draft)
    n = s.rows * tokens
    own = "dspark.head" if draft is not None else "mtp_head" if mtp else "head"
    parts = [units[own], units["vocab"]]
    nbytes = {"weights": sum(p.dense_bytes for p in parts)}
    coll = {}
    t = s.mesh[1]
    if t > 1:  # vocab-split logits gathered (fp32)
        coll["all_gather"] = (1, (t - 1) / t * n * s.cfg.vocab_size * 4.0)
    flops = {"matmul": 2.0 * n * sum(p.dense_elems for p in parts)}
    return Costs(nbytes, nbytes["weights"], flops, coll, {"head": 1}, 0)


def embed_rows(s: Setup, tokens: int) -> Costs:
    b = s.rows * tokens * s.units()["embed"].row_bytes
    return Costs({"rows": b}, b, {}, {}, {}, 0)


def main_pass(s: Setup, tokens: int, commit: int, capture: tuple[int, ...] = ()) -> Costs:
    """The target model over `tokens` tokens per sequence (+ head), committing `commit` of them;
    `capture`: the layers whose output streams are averaged over hc for a DSpark draft (`capture_term`)."""
    total = embed_rows(s, tokens)
    for i in range(s.cfg.num_layers):
        total = total + layer_pass(s, f"layers.{i}", tokens, commit=commit)
    total = total + head_pass(s, tokens) + capture_term(s, tokens, capture)
    return dataclasses.replace(total, passes=1)


def capture_term(s: Setup, tokens: int, layers: tuple[int, ...]) -> Costs:
    """A DSpark draft's context rows taken during the verify: per captured layer the mean over the hc
    streams of its output, [rows, tokens, hc, d] read, [rows, tokens, d] written (activations, which the
    model otherwise leaves out: counted here because the capture is the draft's), hc x d adds per token;
    one kernel per layer ("capture")."""
    if not layers:
        return EMPTY
    n, d, hc = s.rows * tokens, s.cfg.hidden_size, s.cfg.hc_mult
    b = len(layers) * n * (hc + 1) * d * s.act_bytes
    return Costs({"capture": b}, b, {"capture": float(len(layers) * n * hc * d)}, {}, {"capture": len(layers)}, 0)


def mtp_pass(s: Setup, tokens: int, prior: int, commit: int, head: bool) -> Costs:
    """The MTP block (e/h projections + one sliding layer) over `tokens` per sequence."""
    # its own input kernels: the embedding gather, hnorm, h_proj, enorm, e_proj ("mtp_in")
    inputs = Costs({}, 0.0, {}, {}, {"mtp_in": 1}, 0)
    total = embed_rows(s, tokens) + inputs + layer_pass(s, "mtp", tokens, prior=prior, commit=commit)
    if head:
        total = total + head_pass(s, tokens, mtp=True)
    return dataclasses.replace(total, passes=1)


def target_row_bytes(s: Setup) -> float:
    """Bytes one committed token writes into the target's state, all layers (ring rows; entries every ratio)."""
    return sum(layer.write_row_bytes for name, layer in s.state().items() if name.startswith("layers."))


def stage_table(s: Setup, spec: SpecConfig | None, draft: DSparkConfig | None = None) -> dict[str, Costs]:
    """{"ar"} or {"draft", "plan", "verify", "commit"}: one call of each, per device. The draft is the
    model's MTP block, or with `draft` a DSpark drafter (`dspark_table`)."""
    check_setup(s.cfg, s.mesh, s.batch, s.context)
    if spec is None:
        return {"ar": main_pass(s, 1, commit=1)}
    if draft is not None:
        return dspark_table(s, spec, draft)
    if not s.cfg.has_mtp:
        raise ValueError("this model has no MTP block (V4.1 drafts with DSpark): give the DSpark drafter "
                         "(--draft dspark)")
    slots = 1 + (spec.num_steps - 1) * spec.topk
    draft = EMPTY
    for step in range(1, spec.num_steps + 1):
        n = 1 if step == 1 else spec.topk
        # the step's own selection kernels beyond the head: "draft_sample" (log-softmax, top-k of the
        # vocab, the scratch kv / position scatters) every step, "draft_expand" (top-k of the step's
        # candidates, the gathers of the next inputs) before every step but the first
        select = {"draft_sample": 1, **({"draft_expand": 1} if step < spec.num_steps else {})}
        draft = draft + mtp_pass(s, n, prior=slots, commit=0, head=True) + Costs({}, 0.0, {}, {}, select, 0)
    plan = Costs({}, 0.0, {}, {}, {}, 0)  # index arithmetic on [B, D]: no weights, no state
    path = spec.num_steps + 1  # commit: the accepted path's rows (at most S + 1) and the MTP refresh
    commit = embed_rows(s, path) + dataclasses.replace(kv_pass(s, path, commit=path), passes=1)
    writes = target_row_bytes(s) * s.rows * path
    commit = commit + Costs({"state_write": writes}, writes, {}, {}, {}, 0)
    return {"draft": draft, "plan": plan, "verify": main_pass(s, spec.num_draft_tokens, commit=0), "commit": commit}


def default_dspark(cfg: ModelConfig) -> DSparkConfig:
    """The DSpark drafter DeepSeek ships for a V4 / V4.1 target (docs/dspark.md, "What a release holds"), sized to
    `cfg`: block 5, 3 stages, the target's last three layers captured (V4-Flash 40-42 outputs, V4-Pro 58-60,
    V4.1-Flash 37-39 inputs; V4.1's stages with their own 128-expert top-3 MoE), Markov rank 256
    (512 at V4-Pro's width; at most the hidden size on toy configs), noise token 128799 (the last id on
    vocabularies smaller than V4's)."""
    rank = 512 if cfg.hidden_size >= 7168 else min(256, cfg.hidden_size)
    layers = tuple(range(max(cfg.num_layers - 3, 0), cfg.num_layers))
    noise = 128799 if cfg.vocab_size > 128799 else cfg.vocab_size - 1
    # V4.1's stages run their own MoE, 128 experts top-3 (where the target has at least that many)
    own = cfg.v41 is not None and cfg.n_routed_experts >= 128
    return DSparkConfig(block_size=5, noise_token_id=noise, target_layers=layers, markov_rank=rank, num_stages=3,
                        n_routed_experts=128 if own else None, num_experts_per_tok=3 if own else None)


def check_dspark(cfg: ModelConfig, spec: SpecConfig, draft: DSparkConfig) -> None:
    """ValueError (one line) unless `draft` fits `cfg` and `spec` drafts within its block."""
    if not isinstance(draft, DSparkConfig):
        raise ValueError(f"draft must be a DSparkConfig (or None for the MTP block), got {type(draft).__name__}")
    draft.validate_for(cfg)
    if spec.num_steps > draft.block_size:
        raise ValueError(f"num_steps={spec.num_steps} drafts deeper than the DSpark block of {draft.block_size} "
                         f"positions: allowed 1..{draft.block_size}")


def markov_step(s: Setup, draft: DSparkConfig, slots: int, expand: bool) -> Costs:
    """One step of the Markov loop over the `slots` nodes it expands (per sequence): each a W1 row
    ([r], gathered) times W2 [r, V] added to the base logits of its position, plus the confidence head
    ([hh ; W1 row] . w). W2 and w are read once per step (the steps are serial: a step's parents are the
    previous step's picks). Kernels: "markov" (W1 gather, rank-r product with the base add, log-softmax
    max and sum, vocab top-k, confidence) and, before every step but the last, "draft_expand" (top-k of the
    step's candidates, gathers of the next parents). In `rules` the vocab-split W2 gives split logits:
    one all-gather of them (fp32) per step; `even` keeps the head whole on every device (none)."""
    units = s.units(draft)
    markov, conf = units["dspark.markov"], units["dspark.confidence"]
    n, v, r = s.rows * slots, s.cfg.vocab_size, draft.markov_rank
    nbytes = {"weights": markov.dense_bytes + conf.dense_bytes, "rows": n * markov.row_bytes}
    flops = {"markov": 2.0 * n * markov.dense_elems, "confidence": 2.0 * n * conf.dense_elems}
    coll = {}
    split = r * v / markov.dense_elems  # devices W2 is split over
    if split > 1:
        coll["all_gather"] = (1, (split - 1) / split * n * v * 4.0)
    passes = {"markov": 1, **({"draft_expand": 1} if expand else {})}
    return Costs(nbytes, sum(nbytes.values()), flops, coll, passes, 0)


def dspark_table(s: Setup, spec: SpecConfig, draft: DSparkConfig) -> dict[str, Costs]:
    """A DSpark cycle (docs/dspark.md, "How a cycle drafts"; `speculation/dspark.py`), per device:

    draft   one pass of the stages over the block [anchor, noise x (gamma-1)], gamma = block_size rows:
            each stage a full V4 block (hyper-connections, attention over its ring's W rows + the gamma block
            keys, MoE with the expected distinct experts of rows x gamma tokens), the block's embedding rows
            ("dspark_in"), the drafter's hc_head and norm and the target's head over the gamma positions;
            then the Markov loop (`markov_step`) over the beam's slots: 1 at step one, then K per step
            (1 + (S-1)K in all; a chain S).
    plan    index arithmetic (nothing).
    verify  the target over D rows plus the capture of `draft.target_layers` (`capture_term`).
    commit  the path's S + 1 rows written into every target layer's state; for them main_proj + main_norm
            (once, "dspark_ctx"; its tensor-split input summed by one all-reduce) and each stage's wkv +
            kv_norm + RoPE with its ring write ("dspark_kv")."""
    check_dspark(s.cfg, spec, draft)
    units, ring = s.units(draft), s.state()["ring"]
    gamma = draft.block_size
    draft_cost = embed_rows(s, gamma) + Costs({}, 0.0, {}, {}, {"dspark_in": 1}, 0)
    for i in range(draft.num_stages):
        draft_cost = draft_cost + layer_pass(s, f"dspark.stage.{i}", gamma, draft=draft)
    draft_cost = draft_cost + head_pass(s, gamma, draft=draft)
    for step in range(1, spec.num_steps + 1):
        draft_cost = draft_cost + markov_step(s, draft, 1 if step == 1 else spec.topk, step < spec.num_steps)
    draft_cost = dataclasses.replace(draft_cost, passes=1)
    plan = Costs({}, 0.0, {}, {}, {}, 0)
    verify = main_pass(s, spec.num_draft_tokens, commit=0, capture=draft.target_layers)
    path = spec.num_steps + 1
    n, d = s.rows * path, s.cfg.hidden_size
    ctx = units["dspark.context"]
    coll = {"all_reduce": (1, 2.0 * (s.mesh[1] - 1) / s.mesh[1] * n * d * s.act_bytes)} if s.mesh[1] > 1 else {}
    commit = Costs({"weights": ctx.dense_bytes}, ctx.dense_bytes, {"matmul": 2.0 * n * ctx.dense_elems}, coll,
                   {"dspark_ctx": 1}, 1)
    for i in range(draft.num_stages):
        kv = units[f"dspark.kv.{i}"]
        nbytes = {"weights": kv.dense_bytes, "state_write": n * ring.write_row_bytes}
        commit = commit + Costs(nbytes, sum(nbytes.values()), {"matmul": 2.0 * n * kv.dense_elems}, {},
                                {"dspark_kv": 1}, 0)
    writes = target_row_bytes(s) * n
    commit = commit + Costs({"state_write": writes}, writes, {}, {}, {}, 0)
    return {"draft": draft_cost, "plan": plan, "verify": verify, "commit": commit}
