"""DeepSeek-V4 MoE FFN: sqrt(softplus) scores, selection bias (or a fixed token->expert hash table
in the first layers), normalised top-k weights times routed_scaling_factor, clamped SwiGLU experts
and one shared expert (docs/architecture.md §5)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.core.config import ModelConfig
from jaxspec.ops import quant
from jaxspec.ops.pallas.grouped_matmul import grouped_matmul
from jaxspec.ops.quant import Weight
from jaxspec.sharding.active import routed_experts
from jaxspec.sharding.rules import axes, stacked


@struct.dataclass
class MLPParams:
    w1: Weight = axes("embed", "expert_hidden", quant="fp8")  # [d, I] gate
    w3: Weight = axes("embed", "expert_hidden", quant="fp8")  # [d, I] up
    w2: Weight = axes("expert_hidden", "embed", quant="fp8")  # [I, d] down


@struct.dataclass
class MoEParams:
    gate: jax.Array = axes("embed", "router")  # [d, E]
    gate_bias: jax.Array | None = axes("router")  # [E] fp32, selection only (None on hash layers)
    tid2eid: jax.Array | None = axes("hash_vocab", "topk")  # [V, k] int32 on hash layers
    experts: MLPParams = stacked("experts", quant="expert")  # w1/w3: [E, d, I], w2: [E, I, d]
    shared: MLPParams | None  # w1/w3: [d, I], w2: [I, d]


def init_moe(cfg: ModelConfig, key: jax.Array, hash_routed: bool, std: float = 0.02) -> MoEParams:
    d, e, i, k = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    dtype = jnp.dtype(cfg.dtype)
    keys = jax.random.split(key, 8)

    def normal(kk, shape):
        return (std * jax.random.normal(kk, shape, jnp.float32)).astype(dtype)

    tid2eid = None
    if hash_routed:
        # A fixed random table: each token gets k distinct experts.
        scores = jax.random.uniform(keys[7], (cfg.vocab_size, e))
        tid2eid = jnp.argsort(scores, axis=-1)[:, :k].astype(jnp.int32)
    shared = None
    if cfg.n_shared_experts:
        shared = MLPParams(w1=normal(keys[4], (d, i)), w3=normal(keys[5], (d, i)), w2=normal(keys[6], (i, d)))
    return MoEParams(
        gate=normal(keys[0], (d, e)),
        gate_bias=None if hash_routed else jnp.zeros((e,), jnp.float32),
        tid2eid=tid2eid,
        experts=MLPParams(
            w1=normal(keys[1], (e, d, i)), w3=normal(keys[2], (e, d, i)), w2=normal(keys[3], (e, i, d))
        ),
        shared=shared,
    )


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def route(
    p: MoEParams, cfg: ModelConfig, x: jax.Array, token_ids: jax.Array  # x: [N, d], ids: [N]
) -> tuple[jax.Array, jax.Array]:
    """-> expert indices [N, k] int32, weights [N, k] fp32."""
    logits = (x @ p.gate).astype(jnp.float32)
    scores = jnp.sqrt(jax.nn.softplus(logits))
    if p.tid2eid is not None:
        indices = p.tid2eid[token_ids]
    else:
        _, indices = jax.lax.top_k(scores + p.gate_bias, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return indices.astype(jnp.int32), weights * cfg.routed_scaling_factor


def dense_experts(
    experts: MLPParams,
    cfg: ModelConfig,
    x: jax.Array,  # [N, d]
    indices: jax.Array,  # [N, k] int32 expert of each assignment (>= E: not on this device)
    weights: jax.Array,  # [N, k] fp32
) -> jax.Array:
    """Every expert on every token, unselected ones weighted 0 -> [N, d] fp32: ~E/k times the work a
    token needs. The reference the sparse paths are tested against; the model runs it only where the
    backend has no grouped matmul (see `sparse_experts`)."""
    num_experts = experts.w1.shape[0]
    combine = combine_weights(indices, weights, num_experts)
    # One matmul per expert (the expert axis as the batch axis) reads each weight in its stored
    # [E, d, I] layout; a single [N, d] x [d, E*I] matmul would copy every weight transposed first.
    per_expert = (((2,), (1,)), ((0,), (0,)))  # contract the feature axis, batch over experts
    rows = jnp.broadcast_to(x, (num_experts, *x.shape))  # [E, N, d]
    gate = jax.lax.dot_general(rows, quant.dequantize(experts.w1), per_expert)  # [E, N, I]
    up = jax.lax.dot_general(rows, quant.dequantize(experts.w3), per_expert)
    hidden = clamped_swiglu(gate, up, cfg.swiglu_limit) * combine.T[:, :, None].astype(x.dtype)
    out = jax.lax.dot_general(hidden, quant.dequantize(experts.w2), per_expert,
                              preferred_element_type=jnp.float32)  # [E, N, d]
    return jnp.sum(out, axis=0)


def gathered_experts(
    experts: MLPParams, cfg: ModelConfig, x: jax.Array, indices: jax.Array, weights: jax.Array
) -> jax.Array:
    """Few assignments (decode, draft, verify): gather each assignment's expert weights and contract
    per assignment, so only the N*k selected experts are read -> [N, d] fp32."""
    n, d = x.shape
    k = indices.shape[1]
    num_experts = experts.w1.shape[0]
    flat = indices.reshape(-1)
    here = flat < num_experts
    expert = jnp.where(here, flat, 0)
    tokens = jnp.repeat(x, k, axis=0)  # [N*k, d]
    # BlockScaled experts are gathered still quantized (values and scales of the selected experts),
    # so the copy is as small as the stored weights; each is dequantized right before its einsum.
    gate = quant.einsum("ad,adi->ai", tokens, quant.take(experts.w1, expert))
    up = quant.einsum("ad,adi->ai", tokens, quant.take(experts.w3, expert))
    hidden = clamped_swiglu(gate, up, cfg.swiglu_limit)
    out = quant.einsum("ai,aid->ad", hidden, quant.take(experts.w2, expert), preferred_element_type=jnp.float32)
    scale = jnp.where(here, weights.reshape(-1), 0.0)
    return jnp.sum((out * scale[:, None]).reshape(n, k, d), axis=1)


def grouped_experts(
    experts: MLPParams, cfg: ModelConfig, x: jax.Array, indices: jax.Array, weights: jax.Array
) -> jax.Array:
    """Many assignments (prefill, training): sort them by expert and run one grouped matmul per
    projection (`jax.lax.ragged_dot`, no token dropping) -> [N, d] fp32. Assignments of experts not
    on this device sort last, outside every group, and cost nothing."""
    n, d = x.shape
    num_experts = experts.w1.shape[0]
    flat, order, token, group_sizes = sorted_assignments(indices, num_experts)
    rows = x[token]  # [N*k, d] in expert order
    gate = jax.lax.ragged_dot(rows, quant.dequantize(experts.w1), group_sizes)
    up = jax.lax.ragged_dot(rows, quant.dequantize(experts.w3), group_sizes)
    hidden = clamped_swiglu(gate, up, cfg.swiglu_limit)
    out = jax.lax.ragged_dot(hidden, quant.dequantize(experts.w2), group_sizes, preferred_element_type=jnp.float32)
    scale = jnp.where(flat[order] < num_experts, weights.reshape(-1)[order], 0.0)
    return jnp.zeros((n, d), jnp.float32).at[token].add(out * scale[:, None])


def sorted_assignments(indices: jax.Array, num_experts: int):
    """[N, k] expert ids -> flat ids (E = not here), their expert order, token of each sorted row and
    the group sizes [E] (assignments not on this device sort last, outside every group)."""
    k = indices.shape[1]
    flat = jnp.minimum(indices.reshape(-1), num_experts)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return flat, order, order // k, group_sizes


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 5))
def kernel_experts(
    experts: MLPParams, cfg: ModelConfig, x: jax.Array, indices: jax.Array, weights: jax.Array,
    interpret: bool | None = None,
) -> jax.Array:
    """`grouped_experts` on the Pallas grouped matmul (pallas/grouped_matmul.py): each selected
    expert's weights read once per tile of its rows, FP8 / FP4 experts dequantized inside the
    kernel -> [N, d] fp32. The GPU path: XLA's GPU backend would run `ragged_dot` as every expert
    on every row. Gradients are those of `grouped_experts` (the same function)."""
    n, d = x.shape
    num_experts = experts.w1.shape[0]
    flat, order, token, group_sizes = sorted_assignments(indices, num_experts)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes).astype(jnp.int32)])
    rows = x[token]  # [N*k, d] in expert order
    gmm = functools.partial(grouped_matmul, offsets=offsets, interpret=interpret)
    gate, up = gmm(rows, experts.w1).astype(x.dtype), gmm(rows, experts.w3).astype(x.dtype)
    out = gmm(clamped_swiglu(gate, up, cfg.swiglu_limit), experts.w2)  # [N*k, d] fp32
    here = flat[order] < num_experts  # rows past the last group were never written: select, not scale
    contrib = jnp.where(here[:, None], out * weights.reshape(-1)[order][:, None], 0.0)
    return jnp.zeros((n, d), jnp.float32).at[token].add(contrib)


def _kernel_experts_fwd(experts, cfg, x, indices, weights, interpret):
    return kernel_experts(experts, cfg, x, indices, weights, interpret), (experts, x, indices, weights)


def _kernel_experts_bwd(cfg, interpret, res, g):
    _, vjp = jax.vjp(lambda *a: grouped_experts(a[0], cfg, *a[1:]), *res)
    return vjp(g)


kernel_experts.defvjp(_kernel_experts_fwd, _kernel_experts_bwd)


UNION_MAX_EXPERTS = 64  # beyond this many experts a branch per expert would bloat the CPU program


def _expert(w: Weight | tuple[Weight, ...], e: int) -> Weight:
    """Expert `e` of a stacked weight (a static slice) or of an unstacked one (its own leaf)."""
    if isinstance(w, tuple):
        return w[e]
    return quant.index(w, e)


def num_experts_of(experts: MLPParams) -> int:
    return len(experts.w1) if isinstance(experts.w1, tuple) else experts.w1.shape[0]


def unstack_experts(experts: MLPParams) -> MLPParams:
    """The same experts with each weight a tuple of E per-expert leaves ([d, I] / [I, d]): what
    `union_experts` reads on a CPU, where a static slice of a stacked [E, d, I] weight is copied
    before XLA's dot reads it (one extra read and write of every selected expert) but a leaf of its
    own is read in place. Run outside jit, once per params (`model.cpu_layout`)."""
    if isinstance(experts.w1, tuple):
        return experts
    e = experts.w1.shape[0]
    return MLPParams(*(tuple(_expert(w, i) for i in range(e)) for w in (experts.w1, experts.w3, experts.w2)))


def stack_experts(experts: MLPParams) -> MLPParams:
    """The inverse of `unstack_experts` (the paths other than `union_experts` read stacked weights)."""
    if not isinstance(experts.w1, tuple):
        return experts
    return MLPParams(quant.stack(experts.w1), quant.stack(experts.w3), quant.stack(experts.w2))


def _expert_on_rows(experts: MLPParams, cfg: ModelConfig, e: int, rows: jax.Array, scale: jax.Array) -> jax.Array:
    """Expert `e` (its own weights, read in place) on `rows` [R, d], each output row scaled by its
    routing weight `scale` [R] (0: a row that did not select it) -> [R, d] fp32."""
    w1, w3, w2 = (_expert(w, e) for w in (experts.w1, experts.w3, experts.w2))
    hidden = clamped_swiglu(quant.matmul(rows, w1), quant.matmul(rows, w3), cfg.swiglu_limit)
    hidden = hidden * scale[:, None].astype(rows.dtype)
    return jnp.matmul(hidden, quant.dequantize(w2), preferred_element_type=jnp.float32)


def union_experts(
    experts: MLPParams, cfg: ModelConfig, x: jax.Array, indices: jax.Array, weights: jax.Array
) -> jax.Array:
    """Every expert some assignment selected runs on all N tokens (rows it was not selected for weighted
    0); the others are skipped by a `lax.cond` -> [N, d] fp32. Each branch's weights are a static
    slice that XLA's CPU dot reads in place, so a step reads the union of the selected experts once
    (the floor) where the gathered path copies every assignment's expert first and the dense path
    reads all E. The path for a few tokens (a decode step), where N*k <= E experts run at most.
    Stacked weights work too, but a static slice of them is copied first (`unstack_experts`)."""
    n, d = x.shape
    num_experts = num_experts_of(experts)
    combine = combine_weights(indices, weights, num_experts)  # [N, E]
    used = jnp.zeros((num_experts + 1,), bool).at[jnp.minimum(indices, num_experts).reshape(-1)].set(True)
    out = jnp.zeros((n, d), jnp.float32)
    for e in range(num_experts):
        def run(acc, e=e):
            return acc + _expert_on_rows(experts, cfg, e, x, combine[:, e])

        out = jax.lax.cond(used[e], run, lambda acc: acc, out)
    return out


def expert_block(assignments: int, num_experts: int) -> int:
    """Rows per block of `blocked_experts`: a quarter of the mean assignments per expert as a power of
    two, clamped to [4, 16]. Smaller blocks waste fewer padded rows in each expert's last block;
    larger ones read each expert's weights fewer times (the sweep behind the rule: `bench/experts_cpu.py
    --blocks`, docs/speed.md "Routed experts by row blocks")."""
    quarter = max(1, assignments // (4 * num_experts))
    return min(16, max(4, 1 << (quarter.bit_length() - 1)))


def blocked_experts(
    experts: MLPParams, cfg: ModelConfig, x: jax.Array, indices: jax.Array, weights: jax.Array
) -> jax.Array:
    """Each expert on the rows that selected it, B rows at a time -> [N, d] fp32 (B: `expert_block`).

    The assignments are sorted by expert; a scan of static length ceil(N*k / B) + E walks the blocks
    (each expert's last block may be partial, blocks past the end do nothing) and a `lax.switch`
    runs the block's expert on its B rows, reading the expert's weights in place, as the union path
    does. Where the union path multiplies every selected expert by all N rows (E/k times the rows a
    token needs once every expert is selected), this does the N*k rows plus at most E partial blocks:
    the path for verifies and prefill chunks, where most experts are selected. Static shapes only, so
    it differentiates. Assignments of experts not on this device sort last, outside every block."""
    n, d = x.shape
    num_experts = num_experts_of(experts)
    flat, order, token, group_sizes = sorted_assignments(indices, num_experts)
    block = expert_block(flat.size, num_experts)

    def padded(v: jax.Array) -> jax.Array:  # a block starting at an expert's last rows stays in range
        return jnp.concatenate([v, jnp.zeros((block, *v.shape[1:]), v.dtype)])

    rows = padded(x[token])  # [N*k + B, d] in expert order
    scale = padded(jnp.where(flat[order] < num_experts, weights.reshape(-1)[order], 0.0))
    tokens = padded(token)
    starts = jnp.cumsum(group_sizes) - group_sizes  # [E] first sorted row of each expert
    blocks_of = (group_sizes + block - 1) // block
    first_block = jnp.cumsum(blocks_of) - blocks_of  # [E]

    branches = [functools.partial(_expert_on_rows, experts, cfg, e) for e in range(num_experts)]
    branches.append(lambda r, s: jnp.zeros((block, d), jnp.float32))  # past the last block

    def step(out, b):
        e = jnp.sum(b >= first_block + blocks_of)  # the expert whose blocks hold b (E: none)
        held = jnp.minimum(e, num_experts - 1)
        i = b - first_block[held]
        start = starts[held] + i * block
        valid = i * block + jnp.arange(block) < group_sizes[held]
        s = jnp.where(valid, jax.lax.dynamic_slice_in_dim(scale, start, block), 0.0)
        y = jax.lax.switch(e, branches, jax.lax.dynamic_slice_in_dim(rows, start, block), s)
        return out.at[jax.lax.dynamic_slice_in_dim(tokens, start, block)].add(y), None

    num_blocks = -(-flat.size // block) + num_experts
    out, _ = jax.lax.scan(step, jnp.zeros((n, d), jnp.float32), jnp.arange(num_blocks))
    return out


def combine_weights(indices: jax.Array, weights: jax.Array, num_experts: int) -> jax.Array:
    """[N, k] assignments -> [N, E] fp32 routing weight of each expert (0: not selected; indices >= E,
    held elsewhere, dropped)."""
    n = indices.shape[0]
    combine = jnp.zeros((n, num_experts + 1), jnp.float32)
    return combine.at[jnp.arange(n)[:, None], jnp.minimum(indices, num_experts)].add(weights)[:, :num_experts]


def cpu_experts_path(assignments: int, num_experts: int, top_k: int) -> str:
    """The CPU's path for `assignments` (N*k) over `num_experts` held here, up to UNION_MAX_EXPERTS
    experts: "union" (each selected expert once, on all N rows, in place) while the assignments fit
    in the experts (a decode step: at most N*k experts run, each on a few rows), "blocked" (each
    expert on its own rows, B at a time) beyond (verifies, prefill chunks: union would run most
    experts on every row); "dense" when each token takes every expert held (k >= E: nothing to
    skip). With more experts (a branch each would bloat the program): "gathered" while N*k <= 1.5 E,
    else "dense" (bench/experts_cpu.py, docs/results.md "Routed experts on the CPU")."""
    if top_k >= num_experts:
        return "dense"
    if num_experts <= UNION_MAX_EXPERTS:
        return "union" if assignments <= num_experts else "blocked"
    return "gathered" if 2 * assignments <= 3 * num_experts else "dense"


CPU_PATHS = {"union": union_experts, "blocked": blocked_experts, "gathered": gathered_experts,
             "dense": dense_experts}
IN_PLACE_PATHS = frozenset({"union", "blocked"})  # the paths that read per-expert leaves (`unstack_experts`)


def sparse_experts(
    experts: MLPParams, cfg: ModelConfig, x: jax.Array, indices: jax.Array, weights: jax.Array
) -> jax.Array:
    """The routed experts each token selected, and nothing else -> [N, d] fp32.

    `cfg.kernels == "pallas"`: `kernel_experts`, the Pallas grouped matmul, at every size (compiled when
    the program is lowered for CUDA, the interpreter elsewhere, as every kernel): it reads each selected
    expert once; XLA's GPU backend would run `ragged_dot` as every expert on every row unless cuDNN's
    ragged-dot fusion is on. "xla": the jnp path chosen from the static sizes (`cpu_experts_path`): the
    union path reads each selected expert in place on all rows, the blocked one each expert in place on
    its own rows, the gathered path copies each assignment's weights, the dense one multiplies every
    token by every expert; which costs least depends on the assignments per expert (docs/results.md,
    "Routed experts on the CPU"). XLA's CPU backend runs `ragged_dot` as every group on every row, and
    `ragged_dot` has no sharding rule under an explicit mesh, so no path uses it.

    Takes any slice of the experts (and of their hidden width) with indices relative to the slice,
    which is how `sharding.active.routed_experts` runs it per device before summing the outputs.
    """
    if cfg.kernels == "pallas":
        return kernel_experts(stack_experts(experts), cfg, x, indices, weights)
    name = cpu_experts_path(indices.size, num_experts_of(experts), indices.shape[1])
    held = experts if name in IN_PLACE_PATHS else stack_experts(experts)
    return CPU_PATHS[name](held, cfg, x, indices, weights)


def moe(p: MoEParams, cfg: ModelConfig, x: jax.Array, token_ids: jax.Array) -> jax.Array:
    """x: [B, T, d], token_ids: [B, T] -> [B, T, d].

    Only the experts a token selected run (`sparse_experts`); under a mesh the experts are split
    over devices and each runs its own assignments (see `sharding.active.routed_experts`).
    """
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    indices, weights = route(p, cfg, flat, token_ids.reshape(b * t))
    out = routed_experts(sparse_experts, p.experts, cfg, flat, indices, weights)
    if p.shared is not None:
        sh = clamped_swiglu(quant.matmul(flat, p.shared.w1), quant.matmul(flat, p.shared.w3), cfg.swiglu_limit)
        out = out + quant.matmul(sh, p.shared.w2)
    return out.reshape(b, t, d).astype(x.dtype)
