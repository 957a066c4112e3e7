"""What `train` and `distill` share: the learning-rate schedule and its settings, the AdamW chain,
orbax train-state checkpoints, and the clock of a step loop (time budget, ETA, progress callback)."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Linear warmup, then cosine from lr to lr * min_lr_ratio; AdamW with a global-norm clip.
    `OptConfig` (train) and `DistillConfig` (distill) extend it with their own settings."""

    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    steps: int = 1000
    weight_decay: float = 0.1
    clip: float = 1.0

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.steps < 1:
            raise ValueError(f"need warmup_steps >= 0 and steps >= 1, got {self.warmup_steps}, {self.steps}")
        if self.clip <= 0 or self.weight_decay < 0:
            raise ValueError(f"clip must be > 0 and weight_decay >= 0, got {self.clip}, {self.weight_decay}")


def learning_rate(schedule: Schedule, step: int, progress: float | None = None) -> float:
    """The schedule at `step`; the cosine runs over `progress` in [0, 1] (default step / steps; a
    time-budgeted run passes the larger of that and elapsed / budget)."""
    if step < schedule.warmup_steps:
        return schedule.lr * (step + 1) / schedule.warmup_steps
    if progress is None:
        progress = step / schedule.steps
    p = min(max(progress, 0.0), 1.0)
    return schedule.lr * (schedule.min_lr_ratio + (1 - schedule.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def adamw(schedule: Schedule, b1: float = 0.9, b2: float = 0.95, mask: Any = None) -> optax.GradientTransformation:
    # The learning rate is applied outside (an argument of the step) so a time budget can drive it.
    return optax.chain(
        optax.clip_by_global_norm(schedule.clip),
        optax.scale_by_adam(b1=b1, b2=b2),
        optax.add_decayed_weights(schedule.weight_decay, mask=mask),
    )


# ---- train-state checkpoints --------------------------------------------------------------------


def state_manager(run_dir: str, max_to_keep: int = 2):
    """The orbax manager of `run_dir/ckpt` (a train state and its JSON metadata per saved step)."""
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(run_dir, "ckpt")),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False),
        item_names=("state", "meta"),
    )


def save_state(mgr: Any, state: Any, meta: dict[str, Any]) -> None:
    import orbax.checkpoint as ocp

    mgr.save(int(state.step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)), force=True)
    mgr.wait_until_finished()


def restore_state(mgr: Any, template: Any) -> tuple[Any, dict[str, Any]] | None:
    """Latest (state, meta) of the manager, or None when it holds none."""
    import orbax.checkpoint as ocp

    step = mgr.latest_step()
    if step is None:
        return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                    meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]


def resume_from(mgr: Any, state: Any, resume: bool, log: Callable[[str], None]) -> tuple[Any, list[Any], float]:
    """-> (state, history, seconds trained) to start a step loop from: the manager's latest saved state
    and its metadata when `resume` and it holds one (logged), else `state` from scratch. Either way the
    state is committed to one device, as a step's outputs are, so a resumed run reuses the compiled step."""
    history: list[dict[str, Any]] = []
    elapsed0 = 0.0
    restored = restore_state(mgr, state) if resume else None
    if restored is not None:
        state, meta = restored
        history, elapsed0 = list(meta.get("history", [])), float(meta.get("elapsed_s", 0.0))
        log(f"resumed at step {int(state.step)} ({elapsed0 / 60:.1f} min trained)")
    elif resume:
        log(f"no train state in {mgr.directory}; starting fresh")
    return jax.device_put(state, jax.devices()[0]), history, elapsed0


# ---- the clock of a step loop ---------------------------------------------------------------------


class StepClock:
    """Elapsed time (resumed runs included), the time budget, the schedule's progress, and the
    seconds per step (compilation excluded) behind each step's ETA and the progress callback."""

    def __init__(self, schedule: Schedule, elapsed0: float, time_budget_s: float | None,
                 on_step: Callable[[int, int], None] | None = None):
        if time_budget_s is not None and time_budget_s <= 0:
            raise ValueError(f"time budget must be > 0, got {time_budget_s}")
        self.schedule, self.elapsed0, self.budget, self.on_step = schedule, elapsed0, time_budget_s, on_step
        self.start = time.time() - elapsed0
        self.times: list[float] = []

    def elapsed(self) -> float:
        return time.time() - self.start

    def per_step(self) -> float:
        return float(np.median(self.times[-10:])) if self.times else 0.0

    def out_of_time(self) -> bool:
        return self.budget is not None and self.elapsed() + self.per_step() > self.budget

    def lr(self, step: int) -> float:
        progress = step / self.schedule.steps
        if self.budget is not None:
            progress = max(progress, self.elapsed() / self.budget)
        return learning_rate(self.schedule, step, progress)

    def record(self, step: int, seconds: float) -> None:
        """Step `step` (0-based) took `seconds`; the first step of a fresh process includes compiling."""
        if step > 0 or self.elapsed0 > 0:
            self.times.append(seconds)
        if self.on_step is not None:
            self.on_step(step + 1, self.schedule.steps)

    def eta(self, step: int) -> str:
        if not self.times:
            return ""
        left = (self.schedule.steps - step - 1) * self.per_step()
        if self.budget is not None:
            left = min(left, self.budget - self.elapsed())
        return f" {self.per_step():.2f}s/step eta {max(left, 0) / 60:.1f}min"
