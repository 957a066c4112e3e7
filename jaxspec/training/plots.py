"""Figures of a training run: how a distilled draft agrees with its target over the steps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def plot_distill_history(history: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Top-1 agreement with the target and KL(target || draft) per draft depth over a distillation run
    (`jaxspec distill`'s distill.json history): held-out evaluations as markers, the training batches'
    values as a moving average of 20 steps."""
    from matplotlib.figure import Figure

    heldout = [h for h in history if "heldout" in h]
    train = [h for h in history if "train_agree1" in h]
    rows = heldout[0]["heldout"] if heldout else {k[len("train_"):]: v for k, v in train[0].items()
                                                   if k.startswith("train_")}
    depths = sorted(int(k[len("agree"):]) for k in rows if k.startswith("agree"))
    fig = Figure(figsize=(9, 3.4))
    axes = dict(zip(("agree", "kl"), fig.subplots(1, 2), strict=True))
    for metric, ax in axes.items():
        for d in depths:
            color = f"C{d - 1}"
            if len(train) >= 20 and f"train_{metric}{d}" in train[0]:  # a one-step draft trains depth 1 only
                values = np.convolve([h[f"train_{metric}{d}"] for h in train], np.ones(20) / 20, mode="valid")
                ax.plot([h["step"] for h in train][19:], values, color=color, lw=0.8, alpha=0.6)
            if heldout:
                ax.plot([h["step"] for h in heldout], [h["heldout"][f"{metric}{d}"] for h in heldout],
                        color=color, marker="o", label=f"depth {d} (held out)")
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=7)
    axes["agree"].set_ylabel("draft top-1 == target top-1")
    axes["kl"].set_ylabel("KL(target || draft), nats")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def plot_dspark_history(history: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """A DSpark training run (`jaxspec train-dspark`): the loss terms (training batches as a moving
    average of 20 steps, held-out evaluations as markers) and, per block position k, the held-out
    P(the greedy chain accepts >= k drafts) with the chain's tau over the steps."""
    from matplotlib.figure import Figure

    heldout = [h for h in history if "heldout" in h]
    train = [h for h in history if "train_loss" in h]
    fig = Figure(figsize=(13, 3.6))
    ax_loss, ax_acc, ax_tau = fig.subplots(1, 3)
    for i, term in enumerate(("loss", "ce", "l1", "bce")):
        color = f"C{i}"
        if len(train) >= 20:
            values = np.convolve([h[f"train_{term}"] for h in train], np.ones(20) / 20, mode="valid")
            ax_loss.plot([h["step"] for h in train][19:], values, color=color, lw=0.8, alpha=0.6)
        if heldout:
            ax_loss.plot([h["step"] for h in heldout], [h["heldout"][term] for h in heldout], color=color,
                         marker="o", ms=3, label=f"{term} (held out)")
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss terms")
    positions = sorted(int(k[len("accept"):]) for k in (heldout[0]["heldout"] if heldout else {})
                       if k.startswith("accept"))
    for k in positions:
        ax_acc.plot([h["step"] for h in heldout], [h["heldout"][f"accept{k}"] for h in heldout], color=f"C{k - 1}",
                    marker="o", ms=3, label=f"k = {k}")
    ax_acc.set_ylabel("held out P(chain accepts >= k drafts)")
    ax_acc.set_ylim(0, 1)
    for d in sorted({min(positions[-1], 7) + 1, 5} if positions else ()):
        ax_tau.plot([h["step"] for h in heldout], [h["heldout"][f"tau{d}"] for h in heldout], marker="o", ms=3,
                    label=f"chain of {d - 1} drafts (D = {d})")
    ax_tau.set_ylabel("held out tau (teacher-forced greedy chain)")
    for ax in (ax_loss, ax_acc, ax_tau):
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)
