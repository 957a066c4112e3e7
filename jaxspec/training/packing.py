"""Training rows: BOS..EOS documents of GSM8K / MBPP / ShareGPT train splits packed into rows of T+2
tokens, held-out rows from the evaluation splits, and the texts the BPE is trained on."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxspec.training import data as data_lib
from jaxspec.training import tokenizer as tok_lib


class PackedSampler:
    """Rows of T+2 tokens packed from BOS..EOS documents of several datasets.

    Row r of batch `step` depends only on (seed, step): resumed runs see the same data. Each row
    starts at a document start (or a random offset inside a document longer than the row) and is
    filled with further documents, each drawn by the mixture weights.
    """

    def __init__(self, docs: dict[str, list[list[int]]], weights: dict[str, float], seq_len: int, seed: int = 0):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        if not docs or set(docs) != set(weights):
            raise ValueError(f"docs and weights must name the same datasets, got {sorted(docs)} / {sorted(weights)}")
        for name, d in docs.items():
            if not d:
                raise ValueError(f"dataset {name!r} has no documents")
            if weights[name] < 0:
                raise ValueError(f"weight of {name!r} must be >= 0, got {weights[name]}")
        total = sum(weights.values())
        if total <= 0:
            raise ValueError("mixture weights must not all be 0")
        self.names = sorted(docs)
        self.docs = [[np.asarray(x, np.int32) for x in docs[n]] for n in self.names]
        self.p = np.array([weights[n] / total for n in self.names])
        self.seq_len, self.seed = seq_len, seed

    def row(self, rng: np.random.Generator) -> np.ndarray:
        need = self.seq_len + 2
        parts, have, first = [], 0, True
        while have < need:
            d = self.docs[rng.choice(len(self.names), p=self.p)]
            doc = d[rng.integers(len(d))]
            if first and len(doc) > need:
                doc = doc[rng.integers(len(doc) - need + 1):]
            first = False
            parts.append(doc)
            have += len(doc)
        return np.concatenate(parts)[:need]

    def batch(self, step: int, batch: int) -> np.ndarray:  # -> [batch, T+2]
        rng = np.random.default_rng([self.seed, step])
        return np.stack([self.row(rng) for _ in range(batch)])


def unigram_loss(train_rows: np.ndarray, eval_rows: np.ndarray, vocab_size: int, alpha: float = 0.5) -> float:
    """Held-out cross-entropy (nats) of add-alpha token frequencies of the training rows' targets."""
    counts = np.bincount(train_rows[:, 1:].ravel(), minlength=vocab_size).astype(np.float64) + alpha
    logp = np.log(counts / counts.sum())
    return float(-logp[eval_rows[:, 1:-1].ravel()].mean())


def build_data(tokenizer: Any, seq_len: int, seed: int, root: str | None = None,
               weights: dict[str, float] | None = None, eval_rows_per_dataset: int = 8,
               console: Any = None) -> tuple[PackedSampler, dict[str, np.ndarray]]:
    """Training sampler over the train splits and fixed held-out rows per dataset (eval splits)."""
    weights = weights or {"gsm8k": 0.4, "mbpp": 0.2, "sharegpt": 0.4}
    train = data_lib.mixture({k: data_lib.TRAIN_SPLITS[k] for k in weights}, root=root)
    held = data_lib.mixture({k: data_lib.HELDOUT_SPLITS[k] for k in weights}, root=root)
    train_docs = {k: tok_lib.encode_batch(tokenizer, [e.text for e in v], bos=True, eos=True) for k, v in train.items()}
    held_docs = {k: tok_lib.encode_batch(tokenizer, [e.text for e in v], bos=True, eos=True) for k, v in held.items()}
    if console is not None:
        for k in train_docs:
            console.print(f"data {k}: train {len(train_docs[k])} docs {sum(map(len, train_docs[k]))} tokens, "
                          f"held-out {len(held_docs[k])} docs")
    sampler = PackedSampler(train_docs, weights, seq_len, seed)
    eval_rows = {k: PackedSampler({k: d}, {k: 1.0}, seq_len, seed + 1).batch(0, eval_rows_per_dataset)
                 for k, d in held_docs.items()}
    return sampler, eval_rows


def tokenizer_texts(root: str | None = None, sharegpt_docs: int = 3000, seed: int = 0) -> list[str]:
    """Training-split texts for the BPE: all of GSM8K and MBPP train, a sample of ShareGPT train."""
    mix = data_lib.mixture(dict(data_lib.TRAIN_SPLITS), root=root)
    rng = np.random.default_rng(seed)
    share = mix["sharegpt"]
    pick = rng.permutation(len(share))[:sharegpt_docs]
    return [e.text for e in mix["gsm8k"]] + [e.text for e in mix["mbpp"]] + [share[i].text for i in pick]
