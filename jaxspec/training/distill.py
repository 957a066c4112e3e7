"""A draft that predicts the target: train the MTP block (target frozen) on the target's own
continuations, unrolled for S steps exactly as the MTP drafter's beam drafts (`speculation/mtp.py`).

Chain r of a sequence x_0..x_{T+S-1} is the draft a cycle would make with x_{r+1} as its root: its
depth-1 step sits at MTP position r and consumes the target's streams H_r and x_{r+1}; depth d sits
at position r+d-1 and consumes the MTP's own streams of depth d-1 and x_{r+d}. It reads what the
draft reads in the loop: the committed MTP ring (depth-1 rows of positions < r, which came from the
target's streams) and its own earlier depths (the draft scratch), never another chain's deeper
steps (the "training-time test" of EAGLE-3 / HASS). Depth d is judged against the target's
distribution of x_{r+d+1}: loss = sum over depths of KL(target || draft).

Data (`generate_data`): the frozen target's greedy and temperature-1 continuations of train-split
prompts, written in resumable chunks; the target's distributions are recomputed in each step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.layers.attention import AttentionContext
from jaxspec.model import network as model_lib
from jaxspec.model import state as state_lib
from jaxspec.model.network import ModelParams, MTPParams
from jaxspec.speculation.generate import generate
from jaxspec.training.optim import Schedule, StepClock, adamw, resume_from, save_state, state_manager
from jaxspec.training.plots import plot_distill_history
from jaxspec.training.train import export_checkpoint

CHUNK_FILE = "chunk_{:05d}.npz"


# ---- the unrolled draft -------------------------------------------------------------------------


def unrolled_draft_logits(
    params: ModelParams,
    cfg: ModelConfig,
    hidden: jax.Array,  # [B, T, hc, d] target streams before hc_head at positions 0..T-1
    tokens: jax.Array,  # [B, T+S] int32: x_0 .. x_{T+S-1}; chain r's depth d consumes x_{r+d}
    num_steps: int,
) -> list[jax.Array]:
    """-> per depth d = 1..S: [B, T, V] fp32 logits of chain r's depth-d draft (predicting x_{r+d+1})."""
    b, t = hidden.shape[:2]
    if tokens.shape != (b, t + num_steps):
        raise ValueError(f"tokens must be [B, T+S] = {(b, t + num_steps)}, got {tokens.shape}")
    ring = state_lib.layer_state(cfg, "sliding", b, t + num_steps)  # the MTP ring is empty: depth 1 plays it
    chains = jnp.arange(t, dtype=jnp.int32)
    zero = jnp.zeros((b,), jnp.int32)
    prior_kv, prior_pos, prior_chain, prior_depth = [], [], [], []
    streams, out = hidden, []
    for depth in range(1, num_steps + 1):
        positions = jnp.broadcast_to(chains + depth - 1, (b, t))
        if depth == 1:
            visible = chains[None, :] <= chains[:, None]  # the committed ring: rows of positions <= r
        else:
            visible = jnp.eye(t, dtype=bool)  # deeper steps of other chains are never visible
        prior: dict[str, Any] = {}
        if prior_kv:
            key_chain, key_depth = jnp.concatenate(prior_chain), jnp.concatenate(prior_depth)
            prior_visible = jnp.where(key_depth[None, :] == 1, key_chain[None, :] <= chains[:, None],
                                      key_chain[None, :] == chains[:, None])  # [T, X]
            prior = dict(prior_kv=jnp.concatenate(prior_kv, axis=1), prior_positions=jnp.concatenate(prior_pos, 1),
                         prior_visible=jnp.broadcast_to(prior_visible, (b, t, key_chain.shape[0])))
        ctx = AttentionContext(
            positions=positions, committed=zero, visible=jnp.broadcast_to(visible, (b, t, t)),
            ancestor_at_depth=jnp.zeros((b, t, t), jnp.int32), valid=jnp.ones((b, t), bool), **prior,
        )
        logits, streams, rows = model_lib.mtp_forward(params, params.mtp, cfg, ring, streams,
                                                      tokens[:, depth : t + depth], ctx)
        out.append(logits)
        prior_kv.append(rows.kv)
        prior_pos.append(positions)
        prior_chain.append(chains)
        prior_depth.append(jnp.full((t,), depth, jnp.int32))
    return out


def target_pass(params: ModelParams, cfg: ModelConfig, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The frozen target over tokens [B, T] from an empty state -> (streams [B, T, hc, d], logits [B, T, V])."""
    b, t = tokens.shape
    state = state_lib.init_state(cfg, b, t)
    out = model_lib.forward(params, cfg, state, tokens, model_lib.causal_context(state.length,
                                                                                 jnp.ones((b, t), bool)))
    return jax.lax.stop_gradient(out.hidden), jax.lax.stop_gradient(out.logits)


def distill_loss(
    mtp: MTPParams,
    params: ModelParams,  # the frozen target (its mtp is replaced by `mtp`)
    cfg: ModelConfig,
    tokens: jax.Array,  # [B, T+S] int32
    mask: jax.Array,  # [B, T+S] bool: real tokens (padding False)
    num_steps: int,
    ce_weight: float = 0.0,
    kl_weight: float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Sum over depths of `kl_weight` x the mean KL(target || draft) over the chains whose target
    exists, plus `ce_weight` x the draft's cross-entropy on the text itself. -> (loss, metrics per
    depth: KL, top-1 agreement with the target, and the cross-entropy when it is weighted).

    DeepSeek's one-step recipe is num_steps=1, kl_weight=0, ce_weight=1 on real text: the MTP
    block learns x_{r+2} from the target's streams at r, teacher-forced."""
    t = tokens.shape[1] - num_steps
    hidden, target_logits = target_pass(params, cfg, tokens[:, :t])
    draft = unrolled_draft_logits(params.replace(mtp=mtp), cfg, hidden, tokens, num_steps)
    total, metrics = 0.0, {}
    for depth, logits in enumerate(draft, start=1):
        # chain r at depth d predicts x_{r+d+1}: the target's distribution at position r+d
        teacher = jax.nn.log_softmax(target_logits[:, depth:], axis=-1)  # [B, T-d, V]
        student = jax.nn.log_softmax(logits[:, : t - depth], axis=-1)
        valid = mask[:, depth + 1 : t + 1] & mask[:, : t - depth]  # [B, T-d]
        kl = jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1)
        denom = jnp.maximum(jnp.sum(valid), 1)
        kl_mean = jnp.sum(jnp.where(valid, kl, 0.0)) / denom
        agree = jnp.sum(valid & (jnp.argmax(teacher, -1) == jnp.argmax(student, -1))) / denom
        if kl_weight > 0:
            total = total + kl_weight * kl_mean
        metrics[f"kl{depth}"], metrics[f"agree{depth}"] = kl_mean, agree
        if ce_weight > 0:
            ce = optax.softmax_cross_entropy_with_integer_labels(student, tokens[:, depth + 1 : t + 1])
            ce_mean = jnp.sum(jnp.where(valid, ce, 0.0)) / denom
            total = total + ce_weight * ce_mean
            metrics[f"ce{depth}"] = ce_mean
    metrics["loss"] = total
    return total, metrics


# ---- training -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DistillConfig(Schedule):
    """The schedule (`optim.Schedule`, with a draft's defaults), the depths unrolled, the weights of
    the KL to the target and of the cross-entropy on the text, and the depths the held-out
    evaluation unrolls (0: num_steps; a one-step draft is trained at depth 1 and judged deeper)."""

    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    num_steps: int = 4  # S: depths unrolled, as the MTP drafter drafts
    ce_weight: float = 0.0
    kl_weight: float = 1.0
    eval_steps: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.num_steps < 1:
            raise ValueError(f"num_steps (S) must be >= 1, got {self.num_steps}")
        if self.ce_weight < 0 or self.kl_weight < 0 or self.ce_weight + self.kl_weight == 0:
            raise ValueError(f"ce_weight and kl_weight must be >= 0 and not both 0, got {self.ce_weight}, "
                             f"{self.kl_weight}")
        if self.eval_steps < 0:
            raise ValueError(f"eval_steps must be >= 0, got {self.eval_steps}")

    @property
    def eval_depths(self) -> int:
        return self.eval_steps or self.num_steps


ONE_STEP = dict(num_steps=1, kl_weight=0.0, ce_weight=1.0)  # DeepSeek's MTP recipe (distill --recipe one-step)


@struct.dataclass
class DistillState:
    mtp: MTPParams
    opt_state: Any
    step: jax.Array  # [] int32


def _tx(dc: DistillConfig) -> optax.GradientTransformation:
    return adamw(dc)


def init_distill_state(params: ModelParams, dc: DistillConfig, cfg: ModelConfig | None = None,
                       fresh: jax.Array | None = None) -> DistillState:
    """The train state of the checkpoint's draft, or with `fresh` (a PRNG key; needs cfg) of a newly
    initialised MTP block (`init_params`' draw), as DeepSeek trains its MTP module."""
    start = params.mtp
    if fresh is not None:
        if cfg is None:
            raise ValueError("a fresh draft needs the ModelConfig")
        start = model_lib.init_params(cfg, fresh).mtp
    # A copy (jnp.array copies): the step donates the state, which must not free the target's arrays.
    mtp = jax.tree.map(lambda x: jnp.array(x, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype),
                       start)
    return DistillState(mtp=mtp, opt_state=_tx(dc).init(mtp), step=jnp.zeros((), jnp.int32))


@functools.partial(bounded_jit, static_argnums=(5, 6), donate_argnums=(0,))
def distill_step(ds: DistillState, params: ModelParams, tokens: jax.Array, mask: jax.Array, lr: jax.Array,
                 cfg: ModelConfig, dc: DistillConfig) -> tuple[DistillState, dict[str, jax.Array]]:
    """One optimizer step on the MTP block only (the target's gradients are never taken)."""
    (_, metrics), grads = jax.value_and_grad(distill_loss, has_aux=True)(
        ds.mtp, params, cfg, tokens, mask, dc.num_steps, dc.ce_weight, dc.kl_weight)
    updates, opt_state = _tx(dc).update(grads, ds.opt_state, ds.mtp)
    mtp = jax.tree.map(lambda p, u: p - lr * u, ds.mtp, updates)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return DistillState(mtp, opt_state, ds.step + 1), metrics


@functools.partial(bounded_jit, static_argnums=(4, 5, 6))
def distill_eval(mtp: MTPParams, params: ModelParams, tokens: jax.Array, mask: jax.Array, cfg: ModelConfig,
                 num_steps: int, ce_weight: float = 0.0) -> dict[str, jax.Array]:
    return distill_loss(mtp, params, cfg, tokens, mask, num_steps, ce_weight)[1]


# ---- data ---------------------------------------------------------------------------------------


def write_chunk(folder: str | os.PathLike, index: int, tokens: np.ndarray, lengths: np.ndarray,
                prompt_lengths: np.ndarray, meta: dict[str, Any]) -> Path:
    """One chunk of sequences (prompt + the target's continuation), atomically (tmp, then rename)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CHUNK_FILE.format(index)
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, tokens=tokens.astype(np.int32), lengths=lengths.astype(np.int32),
                        prompt_lengths=prompt_lengths.astype(np.int32), meta=json.dumps(meta))
    os.replace(tmp, path)
    return path


def generate_data(
    params: ModelParams,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    out_dir: str | os.PathLike,
    *,
    max_new_tokens: int = 128,
    chunk_size: int = 64,
    temperatures: Sequence[float] = (0.0, 1.0),
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """The target's continuations of `prompts` at each temperature, in chunks of `chunk_size` prompts;
    chunks already written (a stopped run) are kept. -> number of chunks in out_dir."""
    if chunk_size < 1 or max_new_tokens < 1 or not prompts:
        raise ValueError("need prompts, chunk_size >= 1 and max_new_tokens >= 1")
    jobs = [(temp, start) for temp in temperatures for start in range(0, len(prompts), chunk_size)]
    for index, (temp, start) in enumerate(jobs):
        if progress is not None:
            progress(index, len(jobs))
        if (Path(out_dir) / CHUNK_FILE.format(index)).is_file():
            continue
        chunk = [list(p) for p in prompts[start : start + chunk_size]]
        rng = jax.random.key(seed * 1000 + index) if temp > 0 else None
        out = generate(params, cfg, chunk, max_new_tokens=max_new_tokens, temperature=temp, rng=rng,
                       eos_id=cfg.eos_id)
        width = max(len(p) for p in chunk) + max_new_tokens
        tokens = np.zeros((len(chunk), width), np.int32)
        lengths = np.zeros((len(chunk),), np.int32)
        for i, p in enumerate(chunk):
            seq = p + out.tokens[i, : int(out.lengths[i])].tolist()
            tokens[i, : len(seq)] = seq
            lengths[i] = len(seq)
        write_chunk(out_dir, index, tokens, lengths, np.asarray([len(p) for p in chunk]),
                    {"temperature": temp, "first_prompt": start, "max_new_tokens": max_new_tokens})
    if progress is not None:
        progress(len(jobs), len(jobs))
    return len(jobs)


def load_data(folder: str | os.PathLike) -> list[np.ndarray]:
    """Every sequence of a `generate_data` folder (prompt + continuation), in chunk order."""
    paths = sorted(Path(folder).glob("chunk_*.npz"))
    paths = [p for p in paths if ".tmp" not in p.name]
    if not paths:
        raise ValueError(f"no distillation data in {str(folder)!r}; run `jaxspec distill-data` first")
    seqs = []
    for path in paths:
        with np.load(path) as z:
            seqs += [row[:n] for row, n in zip(z["tokens"], z["lengths"], strict=True)]
    return seqs


def batch_rows(seqs: Sequence[np.ndarray], step: int, batch: int, width: int, seed: int = 0
               ) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `width` tokens for training step `step` (depends only on seed and step): a random
    window of a random sequence, right-padded; -> tokens [batch, width], mask [batch, width]."""
    rng = np.random.default_rng([seed, step])
    tokens = np.zeros((batch, width), np.int32)
    mask = np.zeros((batch, width), bool)
    for i in range(batch):
        seq = seqs[int(rng.integers(len(seqs)))]
        start = int(rng.integers(max(len(seq) - width, 0) + 1))
        piece = seq[start : start + width]
        tokens[i, : len(piece)] = piece
        mask[i, : len(piece)] = True
    return tokens, mask


# ---- the loop -----------------------------------------------------------------------------------


RowFn = Callable[[int], tuple[np.ndarray, np.ndarray]]  # step -> (tokens [B, W] int32, mask [B, W] bool)


def evaluate(ds: DistillState, params: ModelParams, cfg: ModelConfig, seqs: Sequence[np.ndarray], dc: DistillConfig,
             batch: int, width: int, rows: int,
             fixed: Sequence[tuple[np.ndarray, np.ndarray]] | None = None) -> dict[str, float]:
    """Mean KL and top-1 agreement with the target per depth (dc.eval_depths unrolled) over `rows`
    fixed rows of `seqs`, or over the batches `fixed` (tokens [B, W], mask [B, W]) when given."""
    sums: dict[str, float] = {}
    count = 0
    if fixed is None:
        fixed = [batch_rows(seqs, step=10**6 + start, batch=batch, width=width, seed=1)
                 for start in range(0, rows, batch)]
    for tokens, mask in fixed:
        m = jax.device_get(distill_eval(ds.mtp, params, jnp.asarray(tokens), jnp.asarray(mask), cfg,
                                        dc.eval_depths, dc.ce_weight))
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        count += 1
    return {k: v / max(count, 1) for k, v in sums.items()}


def distill_loop(
    params: ModelParams,
    cfg: ModelConfig,
    dc: DistillConfig,
    train_seqs: Sequence[np.ndarray],
    eval_seqs: Sequence[np.ndarray],
    *,
    batch: int,
    width: int,
    run_dir: str,
    out: str | None,
    tokenizer: Any = None,
    resume: bool = False,
    time_budget_s: float | None = None,
    eval_every: int = 50,
    eval_rows: int = 32,
    seed: int = 0,
    log: Callable[[str], None] = print,
    on_step: Callable[[int, int], None] | None = None,
    train_rows: RowFn | None = None,
    eval_batches: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    fresh: jax.Array | None = None,
    export: Callable[[MTPParams, dict[str, Any]], None] | None = None,
) -> tuple[DistillState, list[dict[str, Any]]]:
    """Train the MTP block until dc.steps or the time budget; train states (orbax) go to run_dir/ckpt
    and resume from there; the shipped checkpoint (target + trained draft) is refreshed in `out` at
    every evaluation, or `export(mtp, record)` is called instead when given. -> (state, history).

    `train_rows` replaces the windows of `train_seqs` (e.g. packed text rows), `eval_batches` the
    monitoring rows of `eval_seqs`; `fresh` (a PRNG key) starts from a new MTP block."""
    if batch < 1 or width <= dc.num_steps + 1 or eval_every < 1:
        raise ValueError(f"need batch >= 1, width > S + 1 and eval_every >= 1, got {batch}, {width}, {eval_every}")
    if params.mtp is None:
        raise ValueError("the checkpoint has no MTP block to train")
    os.makedirs(run_dir, exist_ok=True)
    mgr = state_manager(run_dir)
    ds, history, elapsed0 = resume_from(mgr, init_distill_state(params, dc, cfg, fresh), resume, log)
    clock = StepClock(dc, elapsed0, time_budget_s, on_step)

    def checkpoint(final: bool) -> None:
        save_state(mgr, ds, {"elapsed_s": clock.elapsed(), "history": history, "config": dataclasses.asdict(dc)})
        record = {"step": int(ds.step), "final": final, "config": dataclasses.asdict(dc), "history": history}
        if export is not None:
            export(ds.mtp, record)
        elif out is not None:
            export_checkpoint(out, cfg, params.replace(mtp=ds.mtp), tokenizer, "auto")
            with open(os.path.join(out, "distill.json"), "w") as f:
                json.dump(record, f, indent=1)
            if history:
                plot_distill_history(history, os.path.join(out, "distill.png"))

    def do_eval() -> None:
        m = evaluate(ds, params, cfg, eval_seqs, dc, batch, width, eval_rows, eval_batches)
        history.append({"step": int(ds.step), "elapsed_s": round(clock.elapsed(), 1), "heldout": m})
        log(f"eval step {int(ds.step)}: " + "  ".join(f"{k} {v:.3f}" for k, v in sorted(m.items())))

    if int(ds.step) == 0:
        do_eval()
    while int(ds.step) < dc.steps:
        step = int(ds.step)
        if clock.out_of_time():
            log(f"time budget reached at step {step} ({clock.elapsed() / 60:.1f} min)")
            break
        lr = clock.lr(step)
        tokens, mask = train_rows(step) if train_rows is not None else batch_rows(train_seqs, step, batch, width, seed)
        t0 = time.time()
        ds, m = distill_step(ds, params, jnp.asarray(tokens), jnp.asarray(mask), jnp.float32(lr), cfg, dc)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        dt = time.time() - t0
        clock.record(step, dt)
        if not all(np.isfinite(v) for v in m.values()):
            raise FloatingPointError(f"non-finite metrics at step {step}: {m}")
        history.append({"step": step + 1, "lr": lr, **{f"train_{k}": v for k, v in m.items()}})
        log(f"step {step + 1}/{dc.steps} loss {m['loss']:.4f} "
            + " ".join(f"agree{d} {m[f'agree{d}']:.3f}" for d in range(1, dc.num_steps + 1))
            + f" lr {lr:.2e} ({dt:.2f}s){clock.eta(step)}")
        if int(ds.step) % eval_every == 0 and int(ds.step) < dc.steps:
            do_eval()
            checkpoint(final=False)
    do_eval()
    checkpoint(final=True)
    mgr.close()
    return ds, history
