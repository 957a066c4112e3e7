"""Acceptance: walk the tree from the root following the child the target agrees with.

Greedy (`greedy_accept` over the argmax): at node i the target's choice is argmax(logits_i); the child
carrying that token (top-K children have distinct tokens) is accepted. The walk is a fixed number (S)
of gathers.

Sampling (drafts are deterministic top-K, so the target-only rule, docs/tree_verification.md §5, is
exact): every node gets its own draw y_i from the target distribution P_i, processed exactly as
`generate` processes it (temperature, top-k, top-p), all at once by Gumbel-max with an independent
key per (sequence, cycle, node). The walk accepts the child of the current node whose token equals
y_current and emits y at the node where it stops. Each emitted token is then a draw from the target
at the node it follows: the tree is fixed before the draws, the draws are independent, and a reached
node's draw was never looked at before. No thresholds, no relaxed matching.

`chain_residual_accept` is the rule for sampled (not top-K) chain drafts (Leviathan et al. 2023): accept with
probability min(1, p/q), emit from the residual on rejection. `residual_tree_accept` is the loop's rule for
sampled drafts (`speculation/sampled.py`): the chain rule for K = 1, recursive rejection sampling without
replacement (RSD-S, Jeon et al. 2024) for trees (docs/sampling.md). `greedy_accept` over independent target
draws (`model.sampling.gumbel_choice`) stays the rule for top-K drafts and the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.model.sampling import Sampling, gumbel_choice, processed_logprobs
from jaxspec.speculation.tree import Tree


@struct.dataclass
class Acceptance:
    path_mask: jax.Array  # [B, D] bool: root and accepted nodes
    num_accepted: jax.Array  # [B] accepted draft tokens (bonus excluded)
    last_node: jax.Array  # [B] deepest accepted node (0 = root)
    bonus: jax.Array  # [B] the target's token after the last accepted node
    path_nodes: jax.Array  # [B, S+1] node at depth 0..S on the path (valid up to num_accepted)


def greedy_accept(
    tokens: jax.Array,  # [B, D] node tokens
    parent: jax.Array,  # [B, D]
    target_choice: jax.Array,  # [B, D] the target's token after each node (argmax, or a draw)
    max_depth: int,
) -> Acceptance:
    b, d = tokens.shape
    nodes = jnp.arange(d)
    current = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    path_mask = nodes[None, :] == 0
    path_nodes = [current]
    num_accepted = jnp.zeros((b,), jnp.int32)
    for _ in range(max_depth):
        wanted = jnp.take_along_axis(target_choice, current[:, None], axis=1)  # [B, 1]
        match = (parent == current[:, None]) & (nodes[None, :] != 0) & (tokens == wanted)
        found = jnp.any(match, axis=1) & alive
        nxt = jnp.argmax(match, axis=1).astype(jnp.int32)
        current = jnp.where(found, nxt, current)
        path_mask, num_accepted = _step_into(path_mask, num_accepted, path_nodes, current, found)
        alive = found
    bonus = jnp.take_along_axis(target_choice, current[:, None], axis=1)[:, 0]
    return Acceptance(path_mask, num_accepted, current, bonus, jnp.stack(path_nodes, axis=1))


def target_accept(
    tokens: jax.Array,  # [B, D] node tokens of a top-K tree (drafted before any target draw)
    parent: jax.Array,  # [B, D]
    logits: jax.Array,  # [B, D, V] target logits at every node
    max_depth: int,
    sampling: Sampling,
    keys: jax.Array,  # [B, D] typed keys, independent per (sequence, cycle, node)
) -> Acceptance:
    """The target-only rule: every node gets its own target draw (Gumbel-max with its key; the argmax at
    temperature 0) and the walk follows the child carrying it."""
    return greedy_accept(tokens, parent, gumbel_choice(logits, keys, sampling), max_depth)


def _step_into(path_mask, num_accepted, path_nodes, current, found):
    """One step of an acceptance walk: where `found` [B], `current` [B] joins the path (mask [B, D],
    its count, and `path_nodes`, a list the walk appends to: the node a row stopped at repeats)."""
    at = jnp.arange(path_mask.shape[1])[None, :] == current[:, None]
    path_nodes.append(current)
    return path_mask | (at & found[:, None]), num_accepted + found.astype(jnp.int32)


def chain_residual_accept(
    tokens: jax.Array,  # [B, S+1] root, then the drafted chain x_1..x_S
    draft_logprobs: jax.Array,  # [B, S, V] log q_j: the distribution x_j was sampled from
    target_logprobs: jax.Array,  # [B, S+1, V] log p_j: processed target after the root and each x_j
    keys: jax.Array,  # [B, S+1] typed keys, independent per (sequence, cycle, node)
) -> Acceptance:
    """Sampled chain drafts (Leviathan et al. 2023, Chen et al. 2023): accept x_j with probability
    min(1, p_{j-1}(x_j) / q_j(x_j)) while every earlier draft was accepted; at the first rejection
    emit a draw from norm(max(p_{j-1} - q_j, 0)), after a full accept a draw from p_S.

    Exact only if q_j is exactly the distribution x_j was drawn from and p_j is processed exactly
    as `generate` processes it. All coins and residual draws are made for every node at once; the
    accepted length is a prefix count, so there is no sequential walk.
    """
    b, d = tokens.shape
    steps = d - 1
    if draft_logprobs.shape[:2] != (b, steps) or target_logprobs.shape[:2] != (b, d):
        raise ValueError(
            f"chain shapes disagree: tokens {tokens.shape} needs draft_logprobs [B={b}, S={steps}, V] and "
            f"target_logprobs [B={b}, S+1={d}, V], got {draft_logprobs.shape} and {target_logprobs.shape}"
        )
    split = jax.vmap(jax.vmap(jax.random.split))(keys)  # [B, S+1, 2]
    vocab = target_logprobs.shape[-1]
    coins = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32)))(split[..., 0])  # [B, S+1]
    noise = jax.vmap(jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32)))(split[..., 1])  # [B, S+1, V]
    drafts = tokens[:, 1:, None]
    p_x = jnp.exp(jnp.take_along_axis(target_logprobs[:, :-1], drafts, axis=2)[..., 0])  # [B, S]
    q_x = jnp.exp(jnp.take_along_axis(draft_logprobs, drafts, axis=2)[..., 0])
    accept = coins[:, 1:] * q_x < p_x  # u < p/q without dividing
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    last = num_accepted[:, None, None]
    p_last = jnp.exp(jnp.take_along_axis(target_logprobs, last, axis=1)[:, 0])  # [B, V]
    q_next = jnp.exp(jnp.take_along_axis(draft_logprobs, jnp.minimum(last, steps - 1), axis=1)[:, 0])
    residual = jnp.maximum(p_last - q_next, 0.0)
    # p == q leaves no residual, but then rejection has probability 0: fall back to p to stay finite.
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_last)
    dist = jnp.where(num_accepted[:, None] < steps, residual, p_last)
    bonus = jnp.argmax(jnp.log(dist) + jnp.take_along_axis(noise, last, axis=1)[:, 0], axis=-1).astype(jnp.int32)
    nodes = jnp.arange(d, dtype=jnp.int32)[None, :]
    return Acceptance(
        path_mask=nodes <= num_accepted[:, None],
        num_accepted=num_accepted,
        last_node=num_accepted,
        bonus=bonus,
        path_nodes=jnp.minimum(nodes, num_accepted[:, None]),
    )


def _coins_and_noise(keys: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
    """keys [B, D] -> (uniform coins [B, D], Gumbel noise [B, D, V]): a node's coin decides whether it is
    accepted, its noise draws the token emitted where the walk stops at it."""
    split = jax.vmap(jax.vmap(jax.random.split))(keys)  # [B, D, 2]
    coins = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32)))(split[..., 0])
    noise = jax.vmap(jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32)))(split[..., 1])
    return coins, noise


def _residual_step(p, q, x, coin, try_it):
    """One sibling of recursive rejection: p, q [B, V] the current target / draft distributions, x [B]
    the child (drawn from q), coin [B]. -> (accepted [B], p, q after it): on rejection
    p <- norm(max(p - q, 0)) and q <- q without x, renormalised; otherwise unchanged."""
    px = jnp.take_along_axis(p, x[:, None], axis=1)[:, 0]
    qx = jnp.take_along_axis(q, x[:, None], axis=1)[:, 0]
    try_it = try_it & (qx > 0)  # beyond q's support: not a draw, skipped (and so are the later siblings)
    ok = try_it & (coin * qx < px)  # u < p/q without dividing
    rejected = (try_it & ~ok)[:, None]
    residual = jnp.maximum(p - q, 0.0)
    mass = jnp.sum(residual, -1, keepdims=True)
    # p == q leaves no residual, but then rejection has probability 0: keep p to stay finite.
    p = jnp.where(rejected, jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p), p)
    q_rest = jnp.where(jnp.arange(q.shape[1])[None, :] == x[:, None], 0.0, q)
    rest = jnp.sum(q_rest, -1, keepdims=True)
    q = jnp.where(rejected, q_rest / jnp.where(rest > 0, rest, 1.0), q)
    return ok, p, q


def recursive_rejection_accept(
    tokens: jax.Array,  # [B, D] node tokens; siblings drawn from their parent's q without replacement
    parent: jax.Array,  # [B, D]
    rank: jax.Array,  # [B, D] sampling order among siblings; the kept siblings are ranks 0..m-1
    draft_probs: jax.Array,  # [B, D, V] q each node was drawn from (siblings share it; root unused)
    target_probs: jax.Array,  # [B, D, V] processed target after each node
    keys: jax.Array,  # [B, D] typed keys, independent per (sequence, cycle, node)
    max_depth: int,
    topk: int,
) -> Acceptance:
    """RSD-S: at the reached node try its children in sampling order, accepting x_i with probability
    min(1, p_i(x_i) / q_i(x_i)), where p_1, q_1 are the target and draft distributions there and each
    rejection moves to p_{i+1} = norm(max(p_i - q_i, 0)), q_{i+1} = q_i without x_i (renormalised).
    The walk enters an accepted child; where all children are rejected it emits a draw from the last
    p (the target itself at a node without children). S * K gathers of [B, V], no host loop."""
    b, d = tokens.shape
    nodes = jnp.arange(d)
    coins, noise = _coins_and_noise(keys, target_probs.shape[-1])
    batch = jnp.arange(b)
    current = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    path_mask = nodes[None, :] == 0
    path_nodes = [current]
    num_accepted = jnp.zeros((b,), jnp.int32)
    bonus = jnp.zeros((b,), jnp.int32)

    def emit(p, at):  # Gumbel-max draw from p [B, V] with the noise of node `at` [B]
        return jnp.argmax(jnp.log(p) + noise[batch, at], axis=-1).astype(jnp.int32)

    for depth in range(max_depth + 1):
        p = target_probs[batch, current]
        is_child = (parent == current[:, None]) & (nodes[None, :] != 0)  # [B, D]
        found = jnp.zeros((b,), bool)
        nxt = current
        if depth < max_depth:
            q = draft_probs[batch, jnp.argmax(is_child & (rank == 0), axis=1)]
            for j in range(topk):
                sibling = is_child & (rank == j)
                child = jnp.argmax(sibling, axis=1).astype(jnp.int32)
                ok, p, q = _residual_step(p, q, tokens[batch, child], coins[batch, child],
                                          alive & ~found & jnp.any(sibling, axis=1))
                nxt = jnp.where(ok, child, nxt)
                found = found | ok
        bonus = jnp.where(alive & ~found, emit(p, current), bonus)
        if depth == max_depth:
            break
        current = nxt
        path_mask, num_accepted = _step_into(path_mask, num_accepted, path_nodes, current, found)
        alive = found
    return Acceptance(path_mask, num_accepted, current, bonus, jnp.stack(path_nodes, axis=1))


def residual_tree_accept(
    tree: Tree,  # a sampled draft (`speculation/sampled.py`): tree.q holds log q each node was drawn from
    logits: jax.Array,  # [B, D, V] target logits at every node
    max_depth: int,
    topk: int,
    sampling: Sampling,
    keys: jax.Array,  # [B, D] typed keys, independent per (sequence, cycle, node)
) -> Acceptance:
    """Exact sampling of a sampled draft: the chain residual rule for K = 1, recursive rejection (RSD-S)
    for trees; the argmax walk at temperature 0 (the same program)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled():
        logp = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        if topk == 1:  # a chain: nodes 0..S in order
            return chain_residual_accept(tree.tokens, tree.q[:, 1:], logp, keys)
        return recursive_rejection_accept(
            tree.tokens, tree.parent, tree.rank, jnp.exp(tree.q), jnp.exp(logp), keys, max_depth, topk
        )

    return jax.lax.cond(sampling.temperature > 0, sampled,
                        lambda: greedy_accept(tree.tokens, tree.parent, greedy, max_depth))
