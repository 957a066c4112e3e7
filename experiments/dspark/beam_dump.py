"""Every candidate of a DSpark beam with the target's verdict on it, per cycle: the data for comparing
node rankings offline.

Runs the whole beam of `--spec` (default s7_k2_d27_vb: the 26 candidates a D = 8 tree prunes from, all
verified) for `--cycles` cycles per prompt and saves, per cycle and sequence, the drafter's hidden row of
every block position (what its confidence head reads), every node's columns (token, parent, depth, rank,
draft probability, the slot's sigma(c), the calibrated path score), the target's
argmax after each node, and the accepted path. A node of the beam is on the accepted path iff it and all
its ancestors match the target's argmax after their parents; a pruned tree (any ancestor-closed subset)
accepts exactly the path's nodes it kept, so any ranking's tau on these cycles is read off the dump.

    PYTHONPATH=. JAXSPEC_DATA=/path/to/data XLA_FLAGS=--xla_cpu_multi_thread_eigen=false taskset -c 0 \
      python experiments/dspark/beam_dump.py --split train --out /tmp/beam_train.npz
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec as js
from jaxspec.harness.calibrate import chain_cycles_in_slices
from jaxspec.harness.eval import encode_prompts
from jaxspec.model.dspark import block_logits
from jaxspec.model.network import Models
from jaxspec.model.sampling import Sampling
from jaxspec.speculation.cycle import (
    Speculator,
    accept_stage,
    commit_stage,
    draft_stage,
    plan_stage,
    prefill,
    verify_stage,
)
from jaxspec.speculation.policy import Policy
from jaxspec.speculation.values import resolve_scores
from jaxspec.training.data import HELDOUT_SPLITS, TRAIN_SPLITS, load_dataset


@functools.partial(jax.jit, static_argnums=(1, 4))
def beam_loop(models, sp, tokens, lengths, shape, sampling):
    cycles, max_len = shape
    state = prefill(sp, models, tokens, lengths, max_len, sampling)
    bb = tokens.shape[0]

    def body(state, _):
        draft_state, root = state.drafter, state.root
        tree = draft_stage(sp, models, state, sampling)
        out = verify_stage(sp, models, state.target, tree, plan_stage(sp, state.target, tree))
        acc = accept_stage(sp, tree, out.logits, sampling, state.stats.cycles)
        state, _ = commit_stage(sp, models, state, tree, out, acc, jnp.ones((bb,), bool))
        argmax = jnp.argmax(out.logits, -1).astype(jnp.int32)
        # the drafter's hidden row of every block position (what its confidence head reads), recomputed
        _, hh = block_logits(models.drafter, models.target, sp.cfg, sp.drafter.config, draft_state, root)
        return state, (hh, tree.tokens, tree.parent, tree.depth, tree.rank, tree.feature, tree.confidence, tree.score,
                       argmax, acc.path_nodes, acc.num_accepted)

    _, rec = jax.lax.scan(body, state, None, length=cycles)
    return rec


NAMES = ("hidden", "token", "parent", "depth", "rank", "prob", "confidence", "score", "argmax", "path", "num_accepted")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default="checkpoints/tiny-v4")
    ap.add_argument("--draft", default="dspark", help="a DSpark draft folder of the checkpoint")
    ap.add_argument("--spec", default="s7_k2_d27_vb")
    ap.add_argument("--split", choices=("train", "heldout"), default="train")
    ap.add_argument("--datasets", default="gsm8k,mbpp,sharegpt")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=192)
    ap.add_argument("--cycles", type=int, default=24)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ck = js.load_checkpoint(args.checkpoint, draft=args.draft, dtype="float32")
    draft = ck.draft
    spec = js.SpecConfig.parse(args.spec)
    spec, values = resolve_scores(spec, draft.calibration_for(spec.values))
    sp = Speculator(ck.cfg, spec, draft.drafter, Policy("greedy", values))
    models = Models(target=ck.params.replace(mtp=None), drafter=draft.params)
    sampling = Sampling.create(0.0, key=jax.random.key(0))
    splits = TRAIN_SPLITS if args.split == "train" else HELDOUT_SPLITS
    parts, dataset_of = [], []
    for name in args.datasets.split(","):
        t0 = time.time()
        examples = load_dataset(name, splits[name])[: args.num_prompts]
        prompts = encode_prompts(ck.tokenizer, examples, args.max_prompt_tokens)
        for rec in chain_cycles_in_slices(
            sp, prompts, args.cycles, args.batch,
            lambda t, l, m: [np.asarray(x) for x in beam_loop(
                models, sp, t, l, (args.cycles, m), sampling)]):  # [C, b, ...] per field
            parts.append([np.swapaxes(x, 0, 1) for x in rec])  # [b, C, ...]
            dataset_of += [name] * rec[0].shape[1]
        print(f"{name}: {len(prompts)} prompts in {time.time() - t0:.0f} s", flush=True)
    arrays = {n: np.concatenate([p[i] for p in parts]) for i, n in enumerate(NAMES)}
    np.savez_compressed(args.out, dataset=np.asarray(dataset_of), **arrays)
    tau = 1 + arrays["num_accepted"].mean()
    print(f"saved {arrays['token'].shape} to {args.out}; tau of the whole beam {tau:.2f}")


if __name__ == "__main__":
    main()
