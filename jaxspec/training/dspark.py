"""Train a DSpark block drafter for a frozen target: DeepSpec's recipe (docs/dspark.md, "The drafter trained
for tiny-v4") adapted to V4's drafter (a window of context rows, full V4 blocks as stages).

Frozen: the target (`ModelParams`; its embedding and head are the drafter's). Trained: everything in
`DSparkParams` (stages, main_proj / main_norm, hc_head, norm, Markov head, confidence head).

Per training block, an anchor a of a sequence x_0..x_{L-1} (a response token, its label inside the
response): the block [x_a, noise x (γ-1)] at positions a..a+γ-1 reads the context rows of positions
a-W..a-1 (W = the drafter's window) and its own γ slots, non-causally; blocks never see each other.
The forward is the inference forward itself: the window's captured rows go through
`model.dspark.commit_context` into the rings of a state whose length is a - W (what a decoding
state holds at that point: the ring keeps the last W rows only), then `block_logits` with anchor x_a;
the Markov head is teacher-forced (prev = x_a, x_{a+1}, ...) and the confidence head reads
[hh_k ; W1[prev_k]]. Labels x_{a+1..a+γ}; supervision stops at the first position past the sequence.

Losses, per position k = 0..γ-1 weighted w_k = exp(-k / decay): 0.1 CE(logits, label) +
0.9 ‖softmax(logits) - softmax(target)‖₁ + 1.0 BCE(confidence, 1 - ½ L1 detached) (the weights, and
the confidence's goal: 1[argmax == label] instead, are `DSparkTrainConfig`'s).

The target's part is computed once (`build_cache`): one stop-gradient pass over every sequence with
capture, keeping the captured rows of the positions a window can reach and the target's final
normed hidden (its logits are `hidden @ head`, recomputed in the step: V4/HAI-LLM ships the
pre-head hidden the same way). A step is then a gather of N blocks (anchors uniform over the
training sequences' valid anchors, drawn from (seed, step): a resumed run draws the same blocks).

Held-out monitoring (`evaluate`): on the target's greedy continuations the labels are the target's
argmax, so the teacher-forced block reproduces the greedy chain exactly while it is accepted: the
chain rooted at a accepts its first k drafts iff the first k teacher-forced argmaxes equal the labels.
`accept{k}` = P(chain accepts >= k drafts), tau{D} = 1 + sum_{k<D} accept{k} for a chain of D-1 drafts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.core.dspark import DSparkConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.model import dspark as dspark_model
from jaxspec.model import network as model_lib
from jaxspec.model import state as state_lib
from jaxspec.model.dspark import DSparkParams
from jaxspec.model.network import ModelParams
from jaxspec.training.optim import Schedule, StepClock, adamw, resume_from, save_state, state_manager

# ---- the training forward (the inference forward, batched over anchors) ----------------------------


def block_forward(
    params: DSparkParams,
    target: ModelParams,  # frozen: its embed and head
    cfg: ModelConfig,
    dcfg: DSparkConfig,
    window_rows: jax.Array,  # [N, W, n*d] the target's captured rows of positions a-W..a-1
    anchor_pos: jax.Array,  # [N] int32 a, the anchor's position
    tokens: jax.Array,  # [N, γ] int32 x_a .. x_{a+γ-1}: the anchor, then the teacher-forced Markov prevs
) -> tuple[jax.Array, jax.Array]:
    """-> (Markov-corrected logits [N, γ, V] fp32, raw confidence logits [N, γ] fp32) of N blocks, each
    exactly `block_logits` + `markov` over a DSparkState filled by `commit_context` with its window."""
    n, w = window_rows.shape[:2]
    if w != cfg.sliding_window or tokens.shape != (n, dcfg.block_size):
        raise ValueError(f"need window rows [N, {cfg.sliding_window}, ...] and tokens [N, {dcfg.block_size}], got "
                         f"{window_rows.shape}, {tokens.shape}")
    positions = anchor_pos[:, None] - w + jnp.arange(w, dtype=jnp.int32)[None, :]  # a-W .. a-1
    state = dspark_model.init_dspark_state(cfg, dcfg, n)
    state = state.replace(length=jnp.maximum(anchor_pos - w, 0).astype(jnp.int32))
    state = dspark_model.commit_context(params, cfg, dcfg, state, window_rows, positions, positions >= 0)
    base, hh = dspark_model.block_logits(params, target, cfg, dcfg, state, tokens[:, 0])
    e, bias = dspark_model.markov(params, tokens)
    return base + bias, dspark_model.confidence_logits(params, hh, e)


@struct.dataclass
class Blocks:
    """N training blocks (host-gathered from a `Cache`)."""

    window: jax.Array  # [N, W, n*d] fp32 context rows (zeros where the position is < 0)
    anchor_pos: jax.Array  # [N] int32
    tokens: jax.Array  # [N, γ+1] int32 x_a .. x_{a+γ}
    teacher: jax.Array  # [N, γ, d] the target's final normed hidden at positions a..a+γ-1
    valid: jax.Array  # [N, γ] bool: label x_{a+1+k} exists (a prefix of each row)


@dataclasses.dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    decay: float = 4.0  # w_k = exp(-k / decay), k = 0..γ-1 (DeepSpec's loss_decay_gamma)
    # what the confidence head learns: "l1" DeepSpec's 1 - ½ L1 (the chance a *sampled* draft survives);
    # "greedy" whether the draft's argmax is the label (what a greedy verify accepts)
    confidence_target: str = "l1"


def greedy_match(top1: jax.Array, blocks: Blocks) -> jax.Array:
    """[N, γ] bool: the draft's argmax `top1` [N, γ] is the label (what a greedy verify accepts)."""
    return (top1 == blocks.tokens[:, 1:]) & blocks.valid


def dspark_loss(
    params: DSparkParams,
    target: ModelParams,
    cfg: ModelConfig,
    dcfg: DSparkConfig,
    blocks: Blocks,
    weights: LossWeights = LossWeights(),
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DeepSpec's loss (docs/dspark.md, "The drafter trained for tiny-v4") -> (loss, metrics: the three
    terms, and per position k = 1..γ `match{k}` (draft argmax == label, teacher-forced), `sibling{k}`
    (the runner-up == label, among the blocks whose argmax missed) and `accept{k}` (the first k all
    match))."""
    g = dcfg.block_size
    logits, conf = block_forward(params, target, cfg, dcfg, blocks.window, blocks.anchor_pos, blocks.tokens[:, :g])
    teacher = jnp.einsum("ngd,dv->ngv", blocks.teacher.astype(target.head.dtype), target.head,
                         preferred_element_type=jnp.float32)  # the target's logits at a..a+γ-1
    labels = blocks.tokens[:, 1:]
    valid = blocks.valid.astype(jnp.float32)
    w = jnp.exp(-jnp.arange(g, dtype=jnp.float32) / weights.decay)[None, :] * valid
    norm = jnp.maximum(jnp.sum(w), 1e-9)
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    l1 = jnp.sum(jnp.abs(jnp.exp(logp) - jax.nn.softmax(teacher, axis=-1)), axis=-1)  # [N, γ]
    top2 = jax.lax.top_k(logits, 2)[1]  # [N, γ, 2]
    match = greedy_match(top2[..., 0], blocks)
    if weights.confidence_target == "greedy":
        goal = match.astype(jnp.float32)
    else:
        goal = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    bce = optax.sigmoid_binary_cross_entropy(conf, goal)
    terms = {"ce": jnp.sum(w * ce) / norm, "l1": jnp.sum(w * l1) / norm, "bce": jnp.sum(w * bce) / norm}
    loss = weights.ce * terms["ce"] + weights.l1 * terms["l1"] + weights.confidence * terms["bce"]
    # what a K = 2 tree's sibling adds: the runner-up is the label where the top token is not
    missed = blocks.valid & ~match
    sibling = (top2[..., 1] == labels) & missed
    accepted = jnp.cumprod(match, axis=1)  # [N, γ] the chain's first k+1 drafts all right
    full = jnp.maximum(jnp.sum(blocks.valid[:, -1]), 1)
    metrics = {"loss": loss, **terms}
    for k in range(g):
        metrics[f"match{k + 1}"] = jnp.sum(match[:, k]) / jnp.maximum(jnp.sum(blocks.valid[:, k]), 1)
        metrics[f"sibling{k + 1}"] = jnp.sum(sibling[:, k]) / jnp.maximum(jnp.sum(missed[:, k]), 1)
        # over the blocks whose γ labels all exist, so every position counts the same blocks
        metrics[f"accept{k + 1}"] = jnp.sum(accepted[:, k] * blocks.valid[:, -1]) / full
    return loss, metrics


# ---- the target's part, once --------------------------------------------------------------------


@dataclasses.dataclass
class Cache:
    """Flat rows of many sequences: for sequence i the positions lo_i..L_i-1, lo_i = max(P_i - W, 0)
    (P_i its prompt length), at rows offset_i + (pos - lo_i). Anchors are rows of positions
    P_i..L_i-2 (a response token with a response label after it)."""

    captured: np.ndarray  # [R, n*d] fp32
    teacher: np.ndarray  # [R, d] fp32 the target's final normed hidden
    tokens: np.ndarray  # [R] int32
    positions: np.ndarray  # [R] int32
    seq: np.ndarray  # [R] int32 sequence index
    anchors: np.ndarray  # [A] int64 rows

    def blocks(self, rows: np.ndarray, window: int, block_size: int) -> dict[str, np.ndarray]:
        """Host arrays of `Blocks` for anchor rows `rows` [N]."""
        r = len(self.tokens)
        offs = np.arange(-window, 0)[None, :]
        win = rows[:, None] + offs  # [N, W]
        win_ok = (self.positions[rows][:, None] + offs) >= 0
        window_rows = self.captured[np.clip(win, 0, r - 1)] * win_ok[..., None]
        ahead = rows[:, None] + np.arange(block_size + 1)[None, :]  # a .. a+γ
        ahead_c = np.clip(ahead, 0, r - 1)
        same = (ahead < r) & (self.seq[ahead_c] == self.seq[rows][:, None])
        tokens = np.where(same, self.tokens[ahead_c], 0).astype(np.int32)
        return dict(window=window_rows.astype(np.float32), anchor_pos=self.positions[rows].astype(np.int32),
                    tokens=tokens, teacher=self.teacher[ahead_c[:, :block_size]] * same[:, :block_size, None],
                    valid=same[:, 1:])

    def batches(self, rows: np.ndarray, batch: int, window: int, block_size: int):
        """-> (n, host arrays of `batch` blocks) for consecutive chunks of `rows`: one shape for every
        chunk (one program), the last padded with blocks whose labels are all invalid (count for nothing)."""
        for start in range(0, len(rows), batch):
            chunk = rows[start : start + batch]
            host = self.blocks(np.concatenate([chunk, np.full(batch - len(chunk), chunk[0])]), window, block_size)
            host["valid"][len(chunk):] = False
            yield len(chunk), host


@functools.partial(bounded_jit, static_argnums=(1, 2))
def target_rows(target: ModelParams, cfg: ModelConfig, capture: tuple[int, ...], tokens: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """The frozen target over tokens [B, T] from an empty state -> (captured [B, T, n*d], final normed
    hidden [B, T, d]: its logits are hidden @ head, `forward`'s)."""
    b, t = tokens.shape
    state = state_lib.init_state(cfg, b, t)
    out = model_lib.forward(target, cfg, state, tokens, model_lib.causal_context(state.length, jnp.ones((b, t), bool)),
                            capture=capture)
    return (jax.lax.stop_gradient(out.captured).astype(jnp.float32),
            jax.lax.stop_gradient(out.final).astype(jnp.float32))


def build_cache(
    target: ModelParams,
    cfg: ModelConfig,
    dcfg: DSparkConfig,
    seqs: Sequence[np.ndarray],
    prompt_lengths: Sequence[int],
    batch: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> Cache:
    """One target pass over `seqs` (batches of `batch`, padded to the longest, sorted by length)."""
    w = cfg.sliding_window
    order = np.argsort([len(s) for s in seqs], kind="stable")
    parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for done, start in enumerate(range(0, len(order), batch)):
        if progress is not None:
            progress(done, math.ceil(len(order) / batch))
        idx = order[start : start + batch]
        width = -(-max(len(s) for s in seqs) // 16) * 16  # one width for all: one program
        tokens = np.zeros((batch, width), np.int32)
        for j, i in enumerate(idx):
            tokens[j, : len(seqs[i])] = seqs[i]
        cap, fin = jax.device_get(target_rows(target, cfg, dcfg.target_layers, jnp.asarray(tokens)))
        for j, i in enumerate(idx):
            lo = max(int(prompt_lengths[i]) - w, 0)
            parts[int(i)] = (cap[j, lo : len(seqs[i])], fin[j, lo : len(seqs[i])])
    if progress is not None:
        progress(math.ceil(len(order) / batch), math.ceil(len(order) / batch))
    captured, teacher, tokens, positions, seq, anchors = [], [], [], [], [], []
    offset = 0
    for i, s in enumerate(seqs):
        lo, p, n = max(int(prompt_lengths[i]) - w, 0), int(prompt_lengths[i]), len(s)
        captured.append(parts[i][0])
        teacher.append(parts[i][1])
        tokens.append(np.asarray(s[lo:n], np.int32))
        positions.append(np.arange(lo, n, dtype=np.int32))
        seq.append(np.full(n - lo, i, np.int32))
        anchors.append(offset + np.arange(p - lo, n - 1 - lo))  # positions P..L-2
        offset += n - lo
    return Cache(np.concatenate(captured), np.concatenate(teacher), np.concatenate(tokens),
                 np.concatenate(positions), np.concatenate(seq), np.concatenate(anchors).astype(np.int64))


def save_cache(cache: Cache, path: str) -> None:
    tmp = path + ".tmp.npz"
    np.savez(tmp, **dataclasses.asdict(cache))
    os.replace(tmp, path)


def load_cache(path: str) -> Cache:
    with np.load(path) as z:
        return Cache(**{f.name: z[f.name] for f in dataclasses.fields(Cache)})


# ---- training -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DSparkTrainConfig(Schedule):
    """The schedule (DeepSpec: AdamW, warmup then cosine, no weight decay, clip 1), the loss weights
    and the blocks per step."""

    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    blocks: int = 256  # N anchors (blocks) per step
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    decay: float = 4.0
    confidence_target: str = "l1"  # LossWeights.confidence_target

    def __post_init__(self):
        super().__post_init__()
        if self.confidence_target not in ("l1", "greedy"):
            raise ValueError(f"confidence_target must be 'l1' or 'greedy', got {self.confidence_target!r}")
        if self.blocks < 1:
            raise ValueError(f"blocks must be >= 1, got {self.blocks}")
        if min(self.ce_weight, self.l1_weight, self.confidence_weight) < 0 or self.decay <= 0:
            raise ValueError("loss weights must be >= 0 and decay > 0")

    @property
    def weights(self) -> LossWeights:
        return LossWeights(self.ce_weight, self.l1_weight, self.confidence_weight, self.decay, self.confidence_target)


@struct.dataclass
class DSparkTrainState:
    params: DSparkParams
    opt_state: Any
    step: jax.Array  # [] int32


def init_from_target(target: ModelParams, cfg: ModelConfig, dcfg: DSparkConfig, key: jax.Array) -> DSparkParams:
    """Fresh DSpark parameters (`init_dspark_params`) whose stages start as copies of the target's last
    layers' blocks (attention projections, sink, MoE, mHC; no compressor or indexer: a window-only
    stage) and whose hc_head / norm are the target's: the stage then begins as a layer that already
    reads the target's streams. main_proj and the heads stay random."""
    params = dspark_model.init_dspark_params(cfg, dcfg, key)
    if cfg.v41 is not None:
        return _init_v41_from_target(params, target, cfg, dcfg)
    stages = []
    for s, stage in enumerate(params.stages):
        # stacked experts, as the drafter stores them (a CPU load may hand the target's unstacked)
        src = model_lib.standard_layout(target.layers[cfg.num_layers - dcfg.num_stages + s])
        if src.ffn.tid2eid is not None:  # a hash-routed layer has no score gate bias: keep the fresh one
            stages.append(stage)
            continue
        attn = src.attn.replace(compressor=None, indexer=None)
        stages.append(src.replace(attn=attn))
    return params.replace(stages=tuple(stages), hc_head=target.hc_head, norm=target.norm)


def _init_v41_from_target(params: Any, target: Any, cfg: ModelConfig, dcfg: DSparkConfig) -> Any:
    """V4.1's: the stages start as the target's last layers (attention without compressor or indexer,
    mHC, norms; the experts too where the stages' MoE has the target's size, else fresh), no Engram;
    the norm is the target's (V4.1 has no hc_head)."""
    same_moe = dcfg.stage_config(cfg).n_routed_experts == cfg.n_routed_experts
    stages = []
    for s, stage in enumerate(params.stages):
        src = target.layers[cfg.num_layers - dcfg.num_stages + s]
        stages.append(src.replace(attn=src.attn.replace(compressor=None, indexer=None), engram=None,
                                  ffn=src.ffn if same_moe else stage.ffn))
    return params.replace(stages=tuple(stages), norm=target.norm)


def init_train_state(params: DSparkParams, tc: DSparkTrainConfig) -> DSparkTrainState:
    params = jax.tree.map(lambda x: jnp.array(x, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype),
                          params)
    return DSparkTrainState(params=params, opt_state=adamw(tc).init(params), step=jnp.zeros((), jnp.int32))


@functools.partial(bounded_jit, static_argnums=(4, 5, 6), donate_argnums=(0,))
def train_step(ts: DSparkTrainState, target: ModelParams, blocks: Blocks, lr: jax.Array, cfg: ModelConfig,
               dcfg: DSparkConfig, tc: DSparkTrainConfig) -> tuple[DSparkTrainState, dict[str, jax.Array]]:
    """One optimizer step on the drafter only (no gradient reaches the target)."""
    (_, metrics), grads = jax.value_and_grad(dspark_loss, has_aux=True)(ts.params, target, cfg, dcfg, blocks,
                                                                         tc.weights)
    updates, opt_state = adamw(tc).update(grads, ts.opt_state, ts.params)
    params = jax.tree.map(lambda p, u: p - lr * u, ts.params, updates)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return DSparkTrainState(params, opt_state, ts.step + 1), metrics


@functools.partial(bounded_jit, static_argnums=(3, 4, 5))
def eval_blocks(params: DSparkParams, target: ModelParams, blocks: Blocks, cfg: ModelConfig, dcfg: DSparkConfig,
                weights: LossWeights) -> dict[str, jax.Array]:
    return dspark_loss(params, target, cfg, dcfg, blocks, weights)[1]


def to_blocks(host: dict[str, np.ndarray]) -> Blocks:
    return Blocks(**{k: jnp.asarray(v) for k, v in host.items()})


def sample_anchors(cache: Cache, step: int, n: int, seed: int) -> np.ndarray:
    """The anchor rows of step `step` (depends only on seed and step): uniform over the valid anchors."""
    rng = np.random.default_rng([seed, step])
    return cache.anchors[rng.integers(0, len(cache.anchors), n)]


def evaluate(params: DSparkParams, target: ModelParams, cfg: ModelConfig, dcfg: DSparkConfig, cache: Cache,
             tc: DSparkTrainConfig, max_blocks: int = 1024) -> dict[str, float]:
    """Held-out metrics over up to `max_blocks` anchors spread evenly over `cache` (fixed across calls):
    the loss terms, per position match{k} and accept{k}, and tau{k+1} = 1 + sum_{j<=k} accept{j}."""
    rows = cache.anchors[np.linspace(0, len(cache.anchors) - 1, min(max_blocks, len(cache.anchors))).astype(int)]
    sums: dict[str, float] = {}
    weight = 0
    for n, host in cache.batches(rows, tc.blocks, cfg.sliding_window, dcfg.block_size):
        m = jax.device_get(eval_blocks(params, target, to_blocks(host), cfg, dcfg, tc.weights))
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v) * n
        weight += n
    out = {k: v / weight for k, v in sums.items()}
    total = 1.0
    for k in range(1, dcfg.block_size + 1):
        total += out[f"accept{k}"]
        out[f"tau{k + 1}"] = total
    return out


def train_loop(
    target: ModelParams,
    cfg: ModelConfig,
    dcfg: DSparkConfig,
    tc: DSparkTrainConfig,
    train_cache: Cache,
    eval_cache: Cache,
    *,
    run_dir: str,
    export: Callable[[DSparkParams, dict[str, Any]], None] | None = None,
    init: str | DSparkParams = "target",
    resume: bool = True,
    time_budget_s: float | None = None,
    eval_every: int = 100,
    eval_blocks_max: int = 1024,
    seed: int = 0,
    log: Callable[[str], None] = print,
    on_step: Callable[[int, int], None] | None = None,
) -> tuple[DSparkTrainState, list[dict[str, Any]]]:
    """Train until tc.steps or the time budget. Train states (orbax) go to run_dir/ckpt at every
    evaluation and a rerun resumes from the latest; `export(params, record)` ships the drafter there
    too. init: "target" (`init_from_target`), "random" (`init_dspark_params`), or a drafter's
    `DSparkParams` to continue from (a fine-tune: fresh optimizer, this schedule). -> (state, history)."""
    if isinstance(init, str) and init not in ("target", "random"):
        raise ValueError(f"init must be 'target', 'random' or DSparkParams, got {init!r}")
    if eval_every < 1:
        raise ValueError(f"eval_every must be >= 1, got {eval_every}")
    if len(train_cache.anchors) == 0 or len(eval_cache.anchors) == 0:
        raise ValueError("no anchors to train or evaluate on (responses of at least 2 tokens are needed)")
    os.makedirs(run_dir, exist_ok=True)
    mgr = state_manager(run_dir)
    key = jax.random.key(seed)
    if isinstance(init, DSparkParams):
        start = init
    elif init == "target":
        start = init_from_target(target, cfg, dcfg, key)
    else:
        start = dspark_model.init_dspark_params(cfg, dcfg, key)
    ts, history, elapsed0 = resume_from(mgr, init_train_state(start, tc), resume, log)
    clock = StepClock(tc, elapsed0, time_budget_s, on_step)

    def checkpoint(final: bool) -> None:
        save_state(mgr, ts, {"elapsed_s": clock.elapsed(), "history": history, "config": dataclasses.asdict(tc)})
        if export is not None:
            export(ts.params, {"step": int(ts.step), "final": final, "elapsed_s": round(clock.elapsed(), 1),
                               "config": dataclasses.asdict(tc), "history": history})

    def do_eval() -> None:
        t0 = time.time()
        m = evaluate(ts.params, target, cfg, dcfg, eval_cache, tc, eval_blocks_max)
        history.append({"step": int(ts.step), "elapsed_s": round(clock.elapsed(), 1), "heldout": m})
        g = dcfg.block_size
        log(f"eval step {int(ts.step)}: loss {m['loss']:.4f} ce {m['ce']:.3f} l1 {m['l1']:.3f} bce {m['bce']:.3f} "
            f"accept " + "/".join(f"{m[f'accept{k}']:.2f}" for k in range(1, g + 1))
            + f" tau{g} {m[f'tau{g}']:.3f} ({time.time() - t0:.0f}s)")

    if int(ts.step) == 0 and not any("heldout" in h for h in history):
        do_eval()
    while int(ts.step) < tc.steps:
        step = int(ts.step)
        if clock.out_of_time():
            log(f"time budget reached at step {step} ({clock.elapsed() / 60:.1f} min)")
            break
        lr = clock.lr(step)
        host = train_cache.blocks(sample_anchors(train_cache, step, tc.blocks, seed), cfg.sliding_window,
                                  dcfg.block_size)
        t0 = time.time()
        ts, m = train_step(ts, target, to_blocks(host), jnp.float32(lr), cfg, dcfg, tc)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        dt = time.time() - t0
        clock.record(step, dt)
        if not all(np.isfinite(v) for v in m.values()):
            raise FloatingPointError(f"non-finite metrics at step {step}: {m}")
        history.append({"step": step + 1, "lr": lr, **{f"train_{k}": v for k, v in m.items()}})
        log(f"step {step + 1}/{tc.steps} loss {m['loss']:.4f} ce {m['ce']:.3f} l1 {m['l1']:.3f} bce {m['bce']:.3f} "
            f"match1 {m['match1']:.3f} accept{dcfg.block_size - 1} {m[f'accept{dcfg.block_size - 1}']:.3f} "
            f"lr {lr:.2e} ({dt:.2f}s){clock.eta(step)}")
        if int(ts.step) % eval_every == 0 and int(ts.step) < tc.steps:
            do_eval()
            checkpoint(final=False)
    if not history or "heldout" not in history[-1]:
        do_eval()
    checkpoint(final=True)
    mgr.close()
    return ts, history
