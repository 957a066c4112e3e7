"""Each exact rule's acceptance at every node of the loop's own sampled chains (docs/block_verification.md §6).

The loop runs a sampled sS_k1 chain of the checkpoint's draft under `--rule` (its own K = 1 program, so
the contexts a node is reached in follow that rule's accepted paths). At every chain node whose parent
is on the accepted path it computes, from the node's processed (q, p) (q: what the node's token was
drawn from; p: the target after its parent), the exact per-node acceptance of each token-level rule:

- chain                1 - TV = sum min(p, q)
- rrs_with             recursive rejection with replacement, K = 2 (SpecInfer)
- rrs_without          recursive rejection without replacement, K = 2 (jaxspec's "residual" trees), exact
- greedy_set           {argmax q, one draw from q without it} with its maximal coupling (Hu et al. / SpecHub),
                       which is what jaxspec's `_gs` trees verify (the draw first, the argmax after it)
- argmax_alone         the greedy set's argmax kept without its sibling: p(argmax q)
- draw_then_argmax     {x ~ q, then argmax q (a second draw where x was the argmax)}, tried in that order
- ot_iid               the optimal K = 2 verifier for i.i.d. drafts: min_H p(H) + 1 - q(H)^2 over prefixes by p/q
- ot_without           the same for draws without replacement (prefix search, capped by the inclusion bound)

and, per drafted chain, the exact reach P(accepted >= d) of the token rule (prod min(1, r_j)), block
verification (1 - prod_{j >= d} (1 - h_j)) and the sequence-level ceiling sum_x min(p(x_1:d), q(x_1:d))
(estimated without bias from the drafted chain: E_q min(1, p/q)). Expected tau = 1 + sum_d reach_d.

    python experiments/block/node_probe.py --checkpoint checkpoints/tiny-v4 --temperatures 1.0,0.6 \\
        [--rule block] [--prompts 32] [--cycles 12] [--steps 7] [--draft NAME] [--out results/block/node_probe.json]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.core.programs import bounded_jit
from jaxspec.harness.calibrate import chain_cycles_in_slices, chain_speculator, sampled_chain_records
from jaxspec.model.network import Models, without_mtp
from jaxspec.model.sampling import Sampling
from jaxspec.speculation.verify import block_terms

NODE_RULES = ("chain", "rrs_with", "rrs_without", "greedy_set", "argmax_alone", "draw_then_argmax", "ot_iid",
              "ot_without")
CHAIN_RULES = ("token", "block", "ceiling")


def _covered(p2, q, c):
    """sum_x min(p2(x), c q(x)) for every c [N, M] at once: p2, q [N, V]; by p2/q sorted once per row."""
    ratio = jnp.where(q > 0, p2 / jnp.where(q > 0, q, 1.0), jnp.inf)
    order = jnp.argsort(ratio, axis=-1)
    r = jnp.take_along_axis(ratio, order, -1)
    cum_p = jnp.concatenate([jnp.zeros_like(p2[:, :1]), jnp.cumsum(jnp.take_along_axis(p2, order, -1), -1)], -1)
    cum_q = jnp.concatenate([jnp.zeros_like(q[:, :1]), jnp.cumsum(jnp.take_along_axis(q, order, -1), -1)], -1)
    k = jax.vmap(lambda row, cs: jnp.searchsorted(row, cs, side="right"))(r, c)  # [N, M] ratios <= c
    return jnp.take_along_axis(cum_p, k, -1) + c * (cum_q[:, -1:] - jnp.take_along_axis(cum_q, k, -1))


def node_rates(p, q):
    """p, q [N, V] processed target / draft at a node -> {rule: [N]} exact acceptance (NODE_RULES)."""
    overlap = jnp.minimum(p, q)
    alpha = jnp.sum(overlap, -1)
    excess = jnp.maximum(p - q, 0.0)
    tv = jnp.sum(excess, -1, keepdims=True)
    p2 = excess / jnp.where(tv > 0, tv, 1.0)
    rrs_with = alpha + tv[:, 0] * jnp.sum(jnp.minimum(p2, q), -1)
    # without replacement: the first draw x1 is rejected with mass max(q - p, 0)(x1), then q' = q / (1 - q(x1))
    scale = 1.0 / jnp.maximum(1.0 - q, 1e-12)
    rrs_without = alpha + jnp.sum(jnp.maximum(q - p, 0.0) * _covered(p2, q, scale), -1)
    hub = jnp.argmax(q, -1)[:, None]
    q_hub = jnp.take_along_axis(q, hub, -1)
    q_rest = jnp.where(jnp.arange(q.shape[-1])[None, :] == hub, 0.0, q) / jnp.maximum(1.0 - q_hub, 1e-12)
    greedy_set = jnp.take_along_axis(p, hub, -1)[:, 0] + jnp.sum(
        jnp.where(jnp.arange(q.shape[-1])[None, :] == hub, 0.0, jnp.minimum(p, q_rest)), -1)
    p_hub = jnp.take_along_axis(p, hub, -1)[:, 0]
    # x ~ q first; its rejection leaves p2 whatever x was; then the argmax (a point mass) where x was not it,
    # else a second draw from q without the argmax
    rejected_hub = jnp.maximum(q_hub[:, 0] - p_hub, 0.0)
    draw_then_argmax = (alpha + (tv[:, 0] - rejected_hub) * jnp.take_along_axis(p2, hub, -1)[:, 0]
                        + rejected_hub * jnp.sum(jnp.minimum(p2, q_rest), -1))
    order = jnp.argsort(jnp.where(q > 0, p / jnp.where(q > 0, q, 1.0), jnp.inf), axis=-1)
    ps, qs = jnp.take_along_axis(p, order, -1), jnp.take_along_axis(q, order, -1)
    cp, cq = jnp.cumsum(ps, -1), jnp.cumsum(qs, -1)
    ot_iid = jnp.minimum(1.0, jnp.min(cp + 1.0 - cq**2, -1))
    # P(both draws in H) = sum_{x in H} q(x) (q(H) - q(x)) / (1 - q(x)) = q(H) - (1 - q(H)) sum_{x in H} q / (1 - q),
    # clipped to [0, q(H)] (float32 near q(x) = 1 only loosens the bound)
    a = jnp.cumsum(qs / jnp.maximum(1.0 - qs, 1e-12), -1)
    both = jnp.clip(cq - jnp.maximum(1.0 - cq, 0.0) * a, 0.0, cq)
    ot_without = jnp.minimum(1.0, jnp.min(cp + 1.0 - both, -1))
    odds = q / jnp.maximum(1.0 - q, 1e-12)
    inclusion = q * (1.0 + jnp.sum(odds, -1, keepdims=True) - odds)  # P(x among the two draws)
    ot_without = jnp.minimum(ot_without, jnp.sum(jnp.minimum(p, inclusion), -1))
    return {"chain": alpha, "rrs_with": rrs_with, "rrs_without": rrs_without, "greedy_set": greedy_set,
            "argmax_alone": p_hub, "draw_then_argmax": draw_then_argmax, "ot_iid": ot_iid, "ot_without": ot_without}


def chain_reach(tokens, logq, logp):
    """tokens [B, S+1], logq [B, S, V], logp [B, S+1, V] -> {rule: [B, S]} exact P(accepted >= d | chain)."""
    x = tokens[:, 1:, None]
    log_r = jnp.take_along_axis(logp[:, :-1], x, -1)[..., 0] - jnp.take_along_axis(logq, x, -1)[..., 0]
    _, h, _ = block_terms(tokens, logq, logp)
    miss = jnp.cumprod((1.0 - h)[:, ::-1], axis=1)[:, ::-1]  # prod_{j >= d} (1 - h_j)
    return {"token": jnp.exp(jnp.cumsum(jnp.minimum(log_r, 0.0), 1)), "block": 1.0 - miss,
            "ceiling": jnp.exp(jnp.minimum(jnp.cumsum(log_r, 1), 0.0))}


@functools.partial(bounded_jit, static_argnums=(1, 4))
def _probe_loop(models, sp, prompt_tokens, prompt_lengths, shape, sampling):
    cycles, max_len = shape
    bb = prompt_tokens.shape[0]
    steps = sp.spec.num_steps

    def record(chain, logq, logp, acc, cycle):
        vocab = logq.shape[-1]
        rates = node_rates(jnp.exp(logp[:, :-1]).reshape(-1, vocab), jnp.exp(logq).reshape(-1, vocab))
        rates = {k: v.reshape(bb, steps) for k, v in rates.items()}
        mask = jnp.arange(1, steps + 1)[None, :] <= acc.num_accepted[:, None] + 1  # parent on the path
        reach = chain_reach(chain.tokens, logq, logp)
        return (*(rates[k] for k in NODE_RULES), *(reach[k] for k in CHAIN_RULES), mask, acc.num_accepted)

    return sampled_chain_records(sp, models, prompt_tokens, prompt_lengths, cycles, max_len, sampling, record)


def probe(cfg, params, draft, prompts, temperature, rule, steps, cycles, batch, top_p=None, seed=0) -> dict:
    sp = chain_speculator(cfg, draft, steps, rule)
    models = Models(target=without_mtp(params), drafter=draft.params)
    sampling = Sampling.create(temperature, top_p=top_p, key=jax.random.key(seed))
    nodes = {k: [] for k in NODE_RULES}
    reach = {k: [] for k in CHAIN_RULES}
    accepted = []
    for records in chain_cycles_in_slices(
        sp, prompts, cycles, batch,
        lambda tokens, lengths, max_len: _probe_loop(models, sp, tokens, lengths, (cycles, max_len), sampling),
    ):  # each [C, b, ...]
        *per_rule, mask, acc = records
        for k, v in zip(NODE_RULES, per_rule[: len(NODE_RULES)], strict=True):
            nodes[k].append(v[mask])
        for k, v in zip(CHAIN_RULES, per_rule[len(NODE_RULES):], strict=True):
            reach[k].append(v.reshape(-1, steps))
        accepted.append(np.asarray(acc).ravel())
    nodes = {k: np.concatenate(v) for k, v in nodes.items()}
    reach = {k: np.concatenate(v).mean(0) for k, v in reach.items()}
    return {"temperature": temperature, "top_p": top_p, "rule": rule, "steps": steps, "prompts": len(prompts),
            "cycles": int(np.concatenate(accepted).size), "node_samples": int(nodes["chain"].size),
            "node_mean": {k: float(v.mean()) for k, v in nodes.items()},
            "reach": {k: v.tolist() for k, v in reach.items()},
            "expected_tau": {k: float(1.0 + v.sum()) for k, v in reach.items()},
            "measured_tau": float(1.0 + np.concatenate(accepted).mean())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="checkpoints/tiny-v4")
    p.add_argument("--temperatures", default="1.0,0.6")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--rule", default="block", choices=["block", "residual"])
    p.add_argument("--prompts", type=int, default=32, help="per dataset")
    p.add_argument("--cycles", type=int, default=12)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--draft", default=None, help="a drafter under the checkpoint's drafts/ (default: its own)")
    p.add_argument("--out", default="results/block/node_probe.json")
    args = p.parse_args()
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from rsd_tau import load

    cfg, params, prompts, draft = load(args.checkpoint, args.prompts, args.draft)
    records = [probe(cfg, params, draft, prompts, float(t), args.rule, args.steps, args.cycles, args.batch, args.top_p)
               for t in args.temperatures.split(",")]
    for r in records:
        print(f"T = {r['temperature']}: {r['node_samples']} nodes, {r['cycles']} cycles; node means "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["node_mean"].items()))
        for k in CHAIN_RULES:
            print(f"  {k:8s} reach " + " ".join(f"{x:.2f}" for x in r["reach"][k])
                  + f"  expected tau {r['expected_tau'][k]:.2f}")
        print(f"  measured tau ({args.rule}) {r['measured_tau']:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1))
    print(out)


if __name__ == "__main__":
    main()
