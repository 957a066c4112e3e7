"""Train a V4-style target and its MTP block jointly (CPU-sized), with orbax checkpoints and resume.

Loss per sequence of T+2 tokens x_0..x_{T+1}: the target reads x_0..x_{T-1} from an empty decode
state (every V4 mechanism on: SWA, CSA + indexer, HCA, sinks, mHC, hash + routed MoE) and predicts
x_{i+1}; the MTP step at position i consumes the target's final streams H_i (pre hc_head) and the
embedding of x_{i+1}, and predicts x_{i+2}. total = main + mtp_weight * mtp.

    jaxspec train --steps 2000 --batch 8 --seq-len 256 --out checkpoints/tiny-v4 --time-budget-minutes 80

Intermediate train states (params + AdamW moments + step + history) go to `<run-dir>/ckpt`
(orbax CheckpointManager); `--resume` continues from the latest one. At every save the shippable
checkpoint (`save_checkpoint` format + tokenizer + loss.csv / loss.png) is also refreshed in `--out`,
so a stopped run leaves something usable.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxspec.checkpoint import save_checkpoint
from jaxspec.core.config import DTYPES, ModelConfig
from jaxspec.core.programs import bounded_jit
from jaxspec.model import network as model_lib
from jaxspec.model import state as state_lib
from jaxspec.model.network import ModelParams
from jaxspec.training.optim import Schedule, StepClock, adamw, learning_rate, resume_from, save_state, state_manager

__all__ = ["OptConfig", "learning_rate", "train_loop", "init_train_state", "make_train_step", "make_eval_step"]

SHIP_LIMIT_BYTES = 60 * 10**6


# ---- optimisation ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OptConfig(Schedule):
    """The schedule (`optim.Schedule`: lr, min_lr_ratio, warmup_steps, steps, weight_decay, clip),
    AdamW's betas and the loss weights."""

    b1: float = 0.9
    b2: float = 0.95
    mtp_weight: float = 0.5
    unlikelihood_weight: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.mtp_weight < 0 or self.unlikelihood_weight < 0:
            raise ValueError("mtp_weight and unlikelihood_weight must be >= 0")


def _float_index(params: ModelParams) -> tuple[int, ...]:
    """Leaf indices of the trainable (floating) params; the hash layers' token->expert tables are ints."""
    return tuple(i for i, x in enumerate(jax.tree.leaves(params)) if jnp.issubdtype(x.dtype, jnp.floating))


def _tx(opt: OptConfig) -> optax.GradientTransformation:
    return adamw(opt, opt.b1, opt.b2, mask=lambda ps: [x.ndim >= 2 for x in ps])


@struct.dataclass
class TrainState:
    params: ModelParams
    opt_state: Any  # optax state over the list of floating leaves
    step: jax.Array  # [] int32


def init_train_state(cfg: ModelConfig, opt: OptConfig, key: jax.Array, params: Any = None) -> TrainState:
    """AdamW moments for `params` (default: fresh fp32 `init_params`)."""
    if cfg.dtype != "float32":
        raise ValueError(f"train in float32 (cfg.dtype={cfg.dtype!r}); cast to bfloat16 only when shipping")
    params = model_lib.init_params(cfg, key) if params is None else params
    leaves = jax.tree.leaves(params)
    trainable = [leaves[i] for i in _float_index(params)]
    return TrainState(params=params, opt_state=_tx(opt).init(trainable), step=jnp.zeros((), jnp.int32))


def seen_in_document(
    tokens: jax.Array,  # [B, L] int32, packed BOS..EOS documents
    vocab_size: int,
    bos_id: int | None,
) -> jax.Array:  # [B, L, V] bool
    """seen[b, i, v]: token v occurs in row b at or before position i, inside the document that holds i
    (documents start at BOS; without a BOS id the row is one document)."""
    length = tokens.shape[1]
    positions = jnp.arange(length, dtype=jnp.int32)[None, :]
    if bos_id is None:
        doc_start = jnp.zeros(tokens.shape, jnp.int32)
    else:
        doc_start = jax.lax.cummax(jnp.where(tokens == bos_id, positions, 0), axis=1)  # [B, L]
    hits = jnp.where(jax.nn.one_hot(tokens, vocab_size, dtype=bool), positions[:, :, None], -1)
    last_seen = jax.lax.cummax(hits, axis=1)  # [B, L, V]: last position of each token so far
    return last_seen >= doc_start[:, :, None]


def unlikelihood_loss(
    logits: jax.Array,  # [B, T, V]
    targets: jax.Array,  # [B, T] int32
    seen: jax.Array,  # [B, T, V] bool: tokens already in the context of each prediction
) -> jax.Array:  # []
    """Token-level unlikelihood (Welleck et al. 2019): -sum over earlier context tokens c != target of
    log(1 - p(c)), mean over positions. It pushes down the probability of repeating the context, the
    failure that makes a small model's greedy continuations loop."""
    candidates = seen & ~jax.nn.one_hot(targets, logits.shape[-1], dtype=bool)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    penalty = -jnp.log1p(-jnp.minimum(probs, 1.0 - 1e-6))
    return jnp.sum(jnp.where(candidates, penalty, 0.0), axis=-1).mean()


def loss_fn(
    params: ModelParams,
    cfg: ModelConfig,
    tokens: jax.Array,  # [B, T+2] int32
    mtp_weight: float,
    unlikelihood_weight: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """-> (main + mtp_weight * mtp [+ unlikelihood terms], {"main", "mtp", ...}); main and mtp are mean
    cross-entropies in nats. With unlikelihood_weight > 0 both heads also get the token-level
    unlikelihood term ("main_ul", "mtp_ul"), the MTP head weighted by mtp_weight like its CE, so the
    draft keeps predicting what the target will say."""
    b, t2 = tokens.shape
    t = t2 - 2
    x = tokens[:, :t]
    st = state_lib.init_state(cfg, b, t)
    valid = jnp.ones((b, t), bool)
    out = model_lib.forward(params, cfg, st, x, model_lib.causal_context(st.length, valid))
    main = optax.softmax_cross_entropy_with_integer_labels(out.logits, tokens[:, 1 : t + 1]).mean()
    aux = {"main": main}
    total = main
    if unlikelihood_weight > 0:
        seen = seen_in_document(tokens[:, : t + 1], cfg.vocab_size, cfg.bos_id)  # [B, T+1, V]
        aux["main_ul"] = unlikelihood_loss(out.logits, tokens[:, 1 : t + 1], seen[:, :t])
        total = total + unlikelihood_weight * aux["main_ul"]
    if cfg.has_mtp:
        ring = state_lib.layer_state(cfg, "sliding", b, t)  # an empty MTP ring: the chunk is the history
        mtp_logits, _, _ = model_lib.mtp_forward(
            params, params.mtp, cfg, ring, out.hidden, tokens[:, 1 : t + 1], model_lib.causal_context(st.length, valid)
        )
        mtp = optax.softmax_cross_entropy_with_integer_labels(mtp_logits, tokens[:, 2:]).mean()
        aux["mtp"] = mtp
        total = total + mtp_weight * mtp
        if unlikelihood_weight > 0:
            aux["mtp_ul"] = unlikelihood_loss(mtp_logits, tokens[:, 2:], seen[:, 1:])
            total = total + mtp_weight * unlikelihood_weight * aux["mtp_ul"]
    return total, aux


def _tx_key(opt: OptConfig) -> tuple[float, ...]:
    # What the compiled step depends on (not lr / steps / warmup): equal keys share one compilation.
    return (opt.b1, opt.b2, opt.weight_decay, opt.clip, opt.mtp_weight, opt.unlikelihood_weight)


@functools.partial(bounded_jit, static_argnums=(3, 4), donate_argnums=(0,))
def _train_step(ts: TrainState, tokens: jax.Array, lr: jax.Array, cfg: ModelConfig, key: tuple[float, ...]):
    b1, b2, wd, clip, mtp_weight, unlikelihood_weight = key
    tx = _tx(OptConfig(b1=b1, b2=b2, weight_decay=wd, clip=clip, mtp_weight=mtp_weight))
    leaves, treedef = jax.tree.flatten(ts.params)
    index = _float_index(ts.params)

    def f(trainable):
        full = list(leaves)
        for i, x in zip(index, trainable, strict=True):
            full[i] = x
        return loss_fn(jax.tree.unflatten(treedef, full), cfg, tokens, mtp_weight, unlikelihood_weight)

    trainable = [leaves[i] for i in index]
    (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(trainable)
    updates, opt_state = tx.update(grads, ts.opt_state, trainable)
    new = list(leaves)
    for i, x, u in zip(index, trainable, updates, strict=True):
        new[i] = x - lr * u
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
    return TrainState(jax.tree.unflatten(treedef, new), opt_state, ts.step + 1), metrics


def make_train_step(cfg: ModelConfig, opt: OptConfig) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """-> step(state, tokens [B, T+2], lr []) -> (state, metrics); one jitted program, donates `state`."""
    if not isinstance(cfg, ModelConfig) or not isinstance(opt, OptConfig):
        raise ValueError("make_train_step needs a ModelConfig and an OptConfig")
    key = _tx_key(opt)
    return lambda ts, tokens, lr: _train_step(ts, tokens, lr, cfg, key)


@functools.partial(bounded_jit, static_argnums=(2,))
def _eval_step(params: ModelParams, tokens: jax.Array, cfg: ModelConfig) -> dict[str, jax.Array]:
    return loss_fn(params, cfg, tokens, 1.0)[1]


def make_eval_step(cfg: ModelConfig) -> Callable[..., dict[str, jax.Array]]:
    """-> eval(params, tokens [B, T+2]) -> {"main", "mtp"} (jitted)."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    return lambda params, tokens: _eval_step(params, tokens, cfg)


# ---- checkpoints -------------------------------------------------------------------------------


def ship_params(cfg: ModelConfig, params: ModelParams, dtype: str) -> tuple[ModelConfig, ModelParams]:
    """Cast to `dtype` ("float32" / "bfloat16") the way `init_params` lays a model of that dtype out."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out_cfg = cfg.replace(dtype=dtype)
    abstract = model_lib.abstract_params(out_cfg)
    return out_cfg, jax.tree.map(lambda x, a: jnp.asarray(x).astype(a.dtype), params, abstract)


def param_bytes(params: ModelParams) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def export_checkpoint(out: str, cfg: ModelConfig, params: ModelParams, tokenizer: Any, ship_dtype: str,
                      extra_files: dict[str, str] | None = None) -> str:
    """Write the `save_checkpoint` folder atomically enough (tmp folder, then swap); -> dtype used.
    ship_dtype "auto" stores float32 unless that exceeds SHIP_LIMIT_BYTES, else bfloat16."""
    if ship_dtype == "auto":
        ship_dtype = "float32" if param_bytes(params) <= SHIP_LIMIT_BYTES else "bfloat16"
    scfg, sparams = ship_params(cfg, params, ship_dtype)
    out = os.path.abspath(out)
    tmp = out + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    save_checkpoint(tmp, scfg, sparams, tokenizer=tokenizer)
    for src_name, src in (extra_files or {}).items():
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(tmp, src_name))
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(tmp, out)
    return ship_dtype


# ---- logging -----------------------------------------------------------------------------------

CSV_FIELDS = ("step", "elapsed_s", "lr", "train_loss", "train_main", "train_mtp", "heldout_main", "heldout_mtp",
              "unigram", "train_main_ul")


def write_curve(history: Sequence[dict[str, Any]], csv_path: str, png_path: str | None) -> None:
    """History rows -> CSV (CSV_FIELDS; empty cells where a row has no value) and a small PNG."""
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for row in history:
            w.writerow({k: ("" if row.get(k) is None else row[k]) for k in CSV_FIELDS})
    if png_path is None:
        return
    try:
        from matplotlib.figure import Figure  # not pyplot: the caller's backend (a notebook's inline) is left alone
    except ImportError:
        return
    fig = Figure(figsize=(6, 3.6), dpi=100)
    ax = fig.subplots()
    tr = [r for r in history if r.get("train_main") is not None]
    ev = [r for r in history if r.get("heldout_main") is not None]
    if tr:
        ax.plot([r["step"] for r in tr], [r["train_main"] for r in tr], lw=0.8, alpha=0.6, label="train (next token)")
        if any(r.get("train_mtp") is not None for r in tr):
            ax.plot([r["step"] for r in tr], [r["train_mtp"] for r in tr], lw=0.8, alpha=0.6, label="train (MTP, +2)")
    if ev:
        ax.plot([r["step"] for r in ev], [r["heldout_main"] for r in ev], "o-", ms=3, label="held-out (next token)")
        if any(r.get("heldout_mtp") is not None for r in ev):
            ax.plot([r["step"] for r in ev], [r["heldout_mtp"] for r in ev], "s-", ms=3, label="held-out (MTP, +2)")
    uni = next((r["unigram"] for r in history if r.get("unigram") is not None), None)
    if uni is not None:
        ax.axhline(uni, color="gray", ls="--", lw=1, label=f"unigram held-out ({uni:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path)


# ---- loop --------------------------------------------------------------------------------------


def evaluate(eval_fn: Callable[..., Any], params: ModelParams, eval_rows: dict[str, np.ndarray],
             batch: int) -> dict[str, float]:
    """Mean held-out losses per dataset ("<name>/main", "<name>/mtp") and over datasets ("main", "mtp")."""
    out: dict[str, float] = {}
    for name, rows in eval_rows.items():
        sums: dict[str, float] = {}
        n = 0
        for i in range(0, len(rows) - batch + 1, batch):
            m = jax.device_get(eval_fn(params, jnp.asarray(rows[i : i + batch])))
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            n += 1
        for k, v in sums.items():
            out[f"{name}/{k}"] = v / max(n, 1)
    for k in ("main", "mtp"):
        vals = [v for kk, v in out.items() if kk.endswith("/" + k)]
        if vals:
            out[k] = float(np.mean(vals))
    return out


def _check_loop_arguments(eval_rows: dict[str, np.ndarray], batch: int, eval_every: int, ship_dtype: str) -> None:
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if eval_every < 1:
        raise ValueError(f"eval_every must be >= 1, got {eval_every}")
    if ship_dtype not in (*DTYPES, "auto"):
        raise ValueError(f"ship_dtype must be one of {(*DTYPES, 'auto')}, got {ship_dtype!r}")
    for name, rows in eval_rows.items():
        if rows.ndim != 2 or len(rows) < batch:
            raise ValueError(f"eval rows of {name!r} must be [n >= batch={batch}, T+2], got shape {rows.shape}")


def train_loop(
    cfg: ModelConfig,
    opt: OptConfig,
    sampler: Any,  # .batch(step, batch) -> [batch, T+2]
    eval_rows: dict[str, np.ndarray],  # name -> [n, T+2]
    *,
    batch: int,
    run_dir: str,
    out: str | None = None,
    tokenizer: Any = None,
    resume: bool = False,
    time_budget_s: float | None = None,
    eval_every: int = 25,
    save_every: int | None = None,
    seed: int = 0,
    unigram: float | None = None,
    ship_dtype: str = "auto",
    log: Callable[[str], None] = print,
    extra_meta: dict[str, Any] | None = None,
    on_step: Callable[[int, int], None] | None = None,
    init: Any = None,
) -> tuple[TrainState, list[dict[str, Any]]]:
    """Run until opt.steps or the time budget; -> (final state, history). Saves and exports on the
    way; `on_step(done, total)` after every step (a progress bar); `init`: the params a fresh run
    starts from (default `init_params(cfg, key(seed))`)."""
    _check_loop_arguments(eval_rows, batch, eval_every, ship_dtype)
    save_every = save_every or eval_every
    os.makedirs(run_dir, exist_ok=True)
    mgr = state_manager(run_dir)
    ts, history, elapsed0 = resume_from(mgr, init_train_state(cfg, opt, jax.random.key(seed), init), resume, log)
    step_fn = make_train_step(cfg, opt)
    eval_fn = make_eval_step(cfg)
    clock = StepClock(opt, elapsed0, time_budget_s, on_step)
    curve_csv = os.path.join(run_dir, "loss.csv")
    curve_png = os.path.join(run_dir, "loss.png")

    def checkpoint(final: bool = False) -> None:
        meta = {"elapsed_s": clock.elapsed(), "history": history, "unigram": unigram,
                "opt": dataclasses.asdict(opt), **(extra_meta or {})}
        save_state(mgr, ts, meta)
        write_curve(history, curve_csv, curve_png)
        if out is not None:
            used = export_checkpoint(out, cfg, ts.params, tokenizer, ship_dtype,
                                     {"loss.csv": curve_csv, "loss.png": curve_png})
            with open(os.path.join(out, "training.json"), "w") as f:
                last = next((r for r in reversed(history) if r.get("heldout_main") is not None), {})
                json.dump({"step": int(ts.step), "final": final, "ship_dtype": used, "unigram_heldout": unigram,
                           "last_eval": last, "opt": dataclasses.asdict(opt), **(extra_meta or {})}, f, indent=2)

    def do_eval() -> None:
        m = evaluate(eval_fn, ts.params, eval_rows, batch)
        history.append({"step": int(ts.step), "elapsed_s": round(clock.elapsed(), 1), "heldout_main": m.get("main"),
                        "heldout_mtp": m.get("mtp"), "unigram": unigram, "heldout": m})
        per = "  ".join(f"{k}={v:.3f}" for k, v in m.items() if "/" in k)
        log(f"eval step {int(ts.step)}: held-out main {m.get('main', float('nan')):.4f} "
            f"mtp {m.get('mtp', float('nan')):.4f} (unigram {unigram})  {per}")

    if int(ts.step) == 0:
        do_eval()
    while int(ts.step) < opt.steps:
        step = int(ts.step)
        if clock.out_of_time():
            log(f"time budget reached at step {step} ({clock.elapsed() / 60:.1f} min)")
            break
        lr = clock.lr(step)
        t0 = time.time()
        ts, m = step_fn(ts, jnp.asarray(sampler.batch(step, batch)), jnp.float32(lr))
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        dt = time.time() - t0
        clock.record(step, dt)
        if not all(math.isfinite(v) for v in m.values()):
            raise FloatingPointError(f"non-finite metrics at step {step}: {m}")
        history.append({"step": step + 1, "elapsed_s": round(clock.elapsed(), 1), "lr": lr,
                        "train_loss": m["loss"], "train_main": m["main"], "train_mtp": m.get("mtp"),
                        "train_main_ul": m.get("main_ul")})
        log(f"step {step + 1}/{opt.steps} loss {m['loss']:.4f} main {m['main']:.4f} mtp {m.get('mtp', 0):.4f} "
            + (f"ul {m['main_ul']:.4f} " if "main_ul" in m else "")
            + f"gnorm {m['grad_norm']:.3f} lr {lr:.2e} ({dt:.2f}s){clock.eta(step)}")
        done = int(ts.step) >= opt.steps
        if int(ts.step) % eval_every == 0 and not done:
            do_eval()
        if int(ts.step) % save_every == 0 and not done:
            checkpoint()
    if not history or history[-1].get("heldout_main") is None:
        do_eval()
    checkpoint(final=True)
    mgr.close()
    return ts, history
