"""How the target forward's cost grows with the tokens it verifies, at batch 1 on this CPU.

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
    PYTHONPATH=. taskset -c 0 python experiments/break_even/verify_scaling.py [T ...] [--experts]

The shipped checkpoint (fp32), a 32-token random prompt prefilled, then `model.forward` over T new
tokens (a causal chain: the verify of a D = T chain reads the same weights) for each T, compiled
once each and timed round-robin (30 rounds; min and median ms). XLA's cost analysis of each
compiled program gives its FLOPs and bytes. --experts also times the same forwards with the routed
experts computed other ways (module functions swapped before tracing), to see whether another
formulation of the dense-experts path makes the T-token forward cheaper on this CPU:
  barrier   the shipped dense path with an optimization barrier between the expert up and down
            projections (XLA's CPU backend fuses both matmuls and the SwiGLU into one library call)
  loop      one plain [T, d] x [d, I] matmul per expert
  flat      einsum over a [d, E, I] view, the down projection as one [T, E*I] x [E*I, d] matmul
  capacity  each expert over at most C = 6 of its assigned rows (a static capacity; the dense path
            under `lax.cond` when an expert has more)
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec as js
from jaxspec.harness import stages as st
from jaxspec.layers import moe
from jaxspec.model.network import causal_context, forward

PER_EXPERT = (((2,), (1,)), ((0,), (0,)))  # contract the feature axis, batch over experts


def _combine(n, num_experts, indices, weights):  # -> [N, E] routing weight of each (token, expert)
    rows = jnp.zeros((n, num_experts + 1), jnp.float32)
    return rows.at[jnp.arange(n)[:, None], jnp.minimum(indices, num_experts)].add(weights)[:, :num_experts]


def barrier(experts, cfg, x, indices, weights):
    n, e = x.shape[0], experts.w1.shape[0]
    rows = jnp.broadcast_to(x, (e, *x.shape))
    gate = jax.lax.dot_general(rows, experts.w1, PER_EXPERT)
    up = jax.lax.dot_general(rows, experts.w3, PER_EXPERT)
    hidden = moe.clamped_swiglu(gate, up, cfg.swiglu_limit) * _combine(n, e, indices, weights).T[:, :, None]
    out = jax.lax.dot_general(jax.lax.optimization_barrier(hidden), experts.w2, PER_EXPERT,
                              preferred_element_type=jnp.float32)
    return jnp.sum(out, axis=0)


def loop(experts, cfg, x, indices, weights):
    n, e = x.shape[0], experts.w1.shape[0]
    combine = _combine(n, e, indices, weights)
    out = jnp.zeros(x.shape, jnp.float32)
    for i in range(e):
        hidden = moe.clamped_swiglu(x @ experts.w1[i], x @ experts.w3[i], cfg.swiglu_limit) * combine[:, i:i + 1]
        out = out + hidden @ experts.w2[i]
    return out


def flat(experts, cfg, x, indices, weights):
    (n, d), (e, _, i) = x.shape, experts.w1.shape
    gate = jnp.einsum("nd,edi->nei", x, experts.w1)
    up = jnp.einsum("nd,edi->nei", x, experts.w3)
    hidden = moe.clamped_swiglu(gate, up, cfg.swiglu_limit) * _combine(n, e, indices, weights)[:, :, None]
    return jnp.dot(hidden.reshape(n, e * i), experts.w2.reshape(e * i, d), preferred_element_type=jnp.float32)


def capacity(experts, cfg, x, indices, weights, cap: int = 6):
    (n, d), e, k = x.shape, experts.w1.shape[0], indices.shape[1]
    ids = jnp.minimum(indices.reshape(-1), e)  # [A]
    onehot = ids[:, None] == jnp.arange(e)[None, :]  # [A, E]
    slot = jnp.sum(jnp.where(onehot, jnp.cumsum(onehot, axis=0) - 1, 0), axis=1)  # [A]

    def grouped(_):
        dest = jnp.where(ids < e, ids * cap + slot, e * cap)
        src = jnp.full((e * cap + 1,), n, jnp.int32).at[dest].set(jnp.arange(n * k) // k)[:-1]
        scale = jnp.zeros((e * cap + 1,), jnp.float32).at[dest].set(
            jnp.where(ids < e, weights.reshape(-1), 0.0))[:-1]
        rows = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])[src].reshape(e, cap, d)
        gate = jax.lax.dot_general(rows, experts.w1, PER_EXPERT)
        up = jax.lax.dot_general(rows, experts.w3, PER_EXPERT)
        hidden = moe.clamped_swiglu(gate, up, cfg.swiglu_limit) * scale.reshape(e, cap, 1)
        out = jax.lax.dot_general(hidden, experts.w2, PER_EXPERT, preferred_element_type=jnp.float32)
        return jnp.zeros((n + 1, d), jnp.float32).at[src].add(out.reshape(e * cap, d))[:n]

    return jax.lax.cond(jnp.max(jnp.sum(onehot, axis=0)) <= cap, grouped,
                        lambda _: SHIPPED(experts, cfg, x, indices, weights), None)


SHIPPED = moe.dense_experts
VARIANTS = {"shipped": SHIPPED, "barrier": barrier, "loop": loop, "flat": flat, "capacity": capacity}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    sizes = [int(t) for t in args] or [1, 2, 4, 8, 16]
    variants = VARIANTS if "--experts" in sys.argv else {"shipped": SHIPPED}
    cfg, params, _ = js.load_checkpoint("checkpoints/tiny-v4", dtype="float32", cpu_experts=True)
    prompt = jax.random.randint(jax.random.key(0), (1, 32), 2, cfg.vocab_size).astype(jnp.int32)
    state, _, _ = st.prefill(params, cfg, prompt, jnp.full((1,), 32, jnp.int32), 128)

    programs = {}
    for name, fn in variants.items():
        moe.dense_experts = fn  # read by `sparse_experts` when it is traced

        def fwd(params, state, tokens):  # tokens [1, T]; a new function per variant: jit caches traces
            ctx = causal_context(state.length, jnp.ones(tokens.shape, bool))
            return forward(params, cfg, state, tokens, ctx).logits

        for t in sizes:
            tokens = jax.random.randint(jax.random.key(t), (1, t), 2, cfg.vocab_size).astype(jnp.int32)
            programs[name, t] = (jax.jit(fwd).lower(params, state, tokens).compile(), tokens)
    moe.dense_experts = SHIPPED
    times = {key: [] for key in programs}
    for _ in range(30):
        for key, (program, tokens) in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(program(params, state, tokens))
            times[key].append(time.perf_counter() - start)
    base = float(np.min(times["shipped", 1])) if 1 in sizes else None
    print("variant   T   min ms  median ms  x T=1   MFLOP   MB accessed  max |logit diff| vs shipped")
    for (name, t), (program, tokens) in programs.items():
        cost = program.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        shipped = programs["shipped", t][0](params, state, tokens)
        diff = float(jnp.max(jnp.abs(program(params, state, tokens) - shipped)))
        ms = 1e3 * np.min(times[name, t])
        ratio = f"{np.min(times[name, t]) / base:5.2f}" if base else "    -"
        print(f"{name:9s} {t:2d} {ms:8.2f} {1e3 * np.median(times[name, t]):10.2f}  {ratio} "
              f"{cost.get('flops', 0) / 1e6:7.1f} {cost.get('bytes accessed', 0) / 1e6:12.1f}  {diff:.1e}")


if __name__ == "__main__":
    main()
