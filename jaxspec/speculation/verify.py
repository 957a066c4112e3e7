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

Sampled (not top-K) drafts (`speculation/sampled.py`) have two exact rules, `sampled_accept` picks by name:
"block" (the default at T > 0), block verification for chains (Sun et al. 2025: the longest prefix accepted by
a sequence-level rule, `chain_block_accept`) and its tree form (`traversal_accept`: a post-order traversal of
sequence-level weights); "residual", the token rule for chains (Leviathan et al. 2023: accept with probability
min(1, p/q), emit from the residual on rejection, `chain_residual_accept`) and recursive rejection sampling
without replacement for trees (RSD-S, Jeon et al. 2024, `recursive_rejection_accept`). docs/sampling.md.
`greedy_accept` over independent target draws (`model.sampling.gumbel_choice`) stays the rule for top-K drafts
and the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.model.sampling import Sampling, gumbel_choice, processed_logprobs, select_rows
from jaxspec.speculation.plan import TreePlan, build_plan
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
    steps = _check_chain(tokens, draft_logprobs, target_logprobs)
    coins, noise = _coins_and_noise(keys, target_logprobs.shape[-1])
    accept = coins[:, 1:] < jnp.exp(_log_ratios(tokens, draft_logprobs, target_logprobs))  # u < p/q
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    at = jnp.minimum(num_accepted, steps - 1)[:, None, None]
    p_at = jnp.exp(jnp.take_along_axis(target_logprobs, at, axis=1)[:, 0])  # [B, V]
    q_next = jnp.exp(jnp.take_along_axis(draft_logprobs, at, axis=1)[:, 0])
    return _chain_outcome(num_accepted, jnp.maximum(p_at - q_next, 0.0), target_logprobs, noise)


def _check_chain(tokens, draft_logprobs, target_logprobs) -> int:
    """-> S, the chain's drafts, once the shapes agree."""
    b, d = tokens.shape
    steps = d - 1
    if draft_logprobs.shape[:2] != (b, steps) or target_logprobs.shape[:2] != (b, d):
        raise ValueError(
            f"chain shapes disagree: tokens {tokens.shape} needs draft_logprobs [B={b}, S={steps}, V] and "
            f"target_logprobs [B={b}, S+1={d}, V], got {draft_logprobs.shape} and {target_logprobs.shape}"
        )
    return steps


def _log_ratios(tokens, draft_logprobs, target_logprobs):
    """-> [B, S] log r_j = log p_{j-1}(x_j) - log q_j(x_j); -inf for a token outside q's support (not a draw)."""
    drafts = tokens[:, 1:, None]
    log_p_x = jnp.take_along_axis(target_logprobs[:, :-1], drafts, axis=2)[..., 0]
    log_q_x = jnp.take_along_axis(draft_logprobs, drafts, axis=2)[..., 0]
    return jnp.where(log_q_x > -jnp.inf, log_p_x - log_q_x, -jnp.inf)


def _chain_outcome(
    num_accepted: jax.Array,  # [B] accepted drafts
    residual: jax.Array,  # [B, V] the (unnormalised) law of the bonus where the chain stopped short
    target_logprobs: jax.Array,  # [B, S+1, V]
    noise: jax.Array,  # [B, S+1, V] Gumbel noise per node
) -> Acceptance:
    """A chain's accepted prefix and its bonus: a draw from `residual` where it stopped short, from p_S
    after a full accept, with the noise of the node it stopped at."""
    d = target_logprobs.shape[1]
    last = num_accepted[:, None, None]
    p_last = jnp.exp(jnp.take_along_axis(target_logprobs, last, axis=1)[:, 0])  # [B, V]
    # a zero residual has probability 0 of being reached (p == q, or h = 1 before it): p keeps the draw finite
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_last)
    dist = jnp.where(num_accepted[:, None] < d - 1, residual, p_last)
    bonus = jnp.argmax(jnp.log(dist) + jnp.take_along_axis(noise, last, axis=1)[:, 0], axis=-1).astype(jnp.int32)
    nodes = jnp.arange(d, dtype=jnp.int32)[None, :]
    return Acceptance(
        path_mask=nodes <= num_accepted[:, None],
        num_accepted=num_accepted,
        last_node=num_accepted,
        bonus=bonus,
        path_nodes=jnp.minimum(nodes, num_accepted[:, None]),
    )


def chain_block_accept(
    tokens: jax.Array,  # [B, S+1] root, then the drafted chain x_1..x_S
    draft_logprobs: jax.Array,  # [B, S, V] log q_j: the distribution x_j was sampled from
    target_logprobs: jax.Array,  # [B, S+1, V] log p_j: processed target after the root and each x_j
    keys: jax.Array,  # [B, S+1] typed keys, independent per (sequence, cycle, node)
) -> Acceptance:
    """Block verification (Sun et al., ICLR 2025): the longest prefix is accepted by a sequence-level rule,
    not token by token (docs/block_verification.md gives the proof).

    With r_i = p_{i-1}(x_i) / q_i(x_i), the running weight w_0 = 1, w_i = min(1, w_{i-1} r_i) and the
    residual masses z_i = sum_v max(w_i p_i(v) - q_{i+1}(v), 0), prefix i is accepted with probability
    h_i = z_i / (z_i + 1 - w_i) (i < S) or h_S = w_S; the accepted length is the largest i whose coin
    u_i < h_i (0 if none), and the bonus is a draw from p_S after a full accept, else from
    norm(max(w_tau p_tau - q_{tau+1}, 0)). The same coins and noises as `chain_residual_accept`, one more
    [B, S, V] pass; the weights are a running minimum in log space, w_i = exp(c_i - max_{j<=i} c_j) with
    c the cumulative sum of log r (no sequential loop).
    """
    steps = _check_chain(tokens, draft_logprobs, target_logprobs)
    coins, noise = _coins_and_noise(keys, target_logprobs.shape[-1])
    _, h, residual = block_terms(tokens, draft_logprobs, target_logprobs)
    index = jnp.arange(1, steps + 1, dtype=jnp.int32)[None, :]
    num_accepted = jnp.max(jnp.where(coins[:, 1:] < h, index, 0), axis=1).astype(jnp.int32)
    at = jnp.minimum(num_accepted, steps - 1)[:, None, None]
    return _chain_outcome(num_accepted, jnp.take_along_axis(residual, at, axis=1)[:, 0], target_logprobs, noise)


def block_terms(
    tokens: jax.Array,  # [B, S+1] root, then the drafted chain
    draft_logprobs: jax.Array,  # [B, S, V] log q_j
    target_logprobs: jax.Array,  # [B, S+1, V] log p_j
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Block verification's quantities on a drafted chain -> (weights w_0..w_S [B, S+1], h_1..h_S [B, S],
    residuals max(w_i p_i - q_{i+1}, 0) for i = 0..S-1 [B, S, V]); `chain_block_accept` and the harness's
    block values and probes read them."""
    b, steps = draft_logprobs.shape[:2]
    log_r = _log_ratios(tokens, draft_logprobs, target_logprobs)  # a token outside q's support: weight 0
    c = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), jnp.cumsum(log_r, axis=1)], axis=1)  # [B, S+1]
    weight = jnp.exp(c - jax.lax.cummax(c, axis=1))  # [B, S+1]: w_0 = 1, w_i = min(1, w_{i-1} r_i)
    residual = jnp.maximum(weight[:, :steps, None] * jnp.exp(target_logprobs[:, :steps])
                           - jnp.exp(draft_logprobs), 0.0)  # [B, S, V]
    mass = jnp.sum(residual, axis=-1)  # [B, S] z_0..z_{S-1}
    denom = mass + 1.0 - weight[:, :steps]
    # w_i = 1 with z_i = 0 means p_i = q_{i+1}: every later weight is 1 too, so the coin there never matters
    h = jnp.where(denom > 0, mass / jnp.where(denom > 0, denom, 1.0), 1.0)  # [B, S]
    return weight, jnp.concatenate([h[:, 1:], weight[:, steps:]], axis=1), residual


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
    q = jnp.where(rejected, _draft_without(q, x[:, None]), q)
    return ok, p, q


def _one_hot(x, vocab):  # x [B, 1] -> [B, V] the point mass at x: the law of a deterministic child
    return (jnp.arange(vocab)[None, :] == x).astype(jnp.float32)


def _tried_order(children, exists, greedy_set: bool):
    """children, exists [..., K] of a node in rank order -> the same in the order they are tried, and
    [..., K] bool: is the child the greedy draft set's argmax (a point mass) at that position.

    Draws from q (Gumbel-top-K) are tried in rank order. The greedy draft set {a = argmax q, y ~ q without a,
    ...} tries y first (its law q without a) and the argmax second, against what y's rejection left: that
    order accepts p(a) + sum_{x != a} min(p(x), q_a(x)), the most any verifier of {a, y} can (Hu et al.,
    ICLR 2025), where the argmax first would accept p(a) + sum min(p(x), (1 - p(a)) q_a(x)). An argmax kept
    without siblings is tried alone (accepted with its target probability)."""
    k = children.shape[-1]
    hub = jnp.zeros(children.shape, bool)
    if not greedy_set or k < 2:
        return children, exists, hub
    pair = exists[..., 1:2]

    def swap(a):
        return jnp.concatenate([a[..., 1:2], a[..., :1], a[..., 2:]], axis=-1)

    at = jnp.arange(k)
    return (jnp.where(pair, swap(children), children), jnp.where(pair, swap(exists), exists),
            jnp.where(pair, at == 1, at == 0) & exists[..., :1])


def _draws_start(q, hub_token, pair, greedy_set: bool):
    """q [B, V] the node's draft and, for the greedy draft set, its argmax token [B, 1] and pair [B] (a drawn
    sibling is kept) -> the law of the first child tried that is a draw: q, or q without the argmax."""
    if not greedy_set:
        return q
    return jnp.where(pair[:, None], _draft_without(q, hub_token), q)


def _child_law(q, x, is_hub, greedy_set: bool):
    """The law a child x [B, 1] was drawn from: the point mass at x for the greedy set's argmax, else the
    current q [B, V] (the draft without the siblings drawn before it); and q after the child: without x.
    Drawn children only (`greedy_set` False, static) add no [B, V] select to the walk."""
    law = jnp.where(is_hub[:, None], _one_hot(x, q.shape[-1]), q) if greedy_set else q
    return law, _draft_without(q, x)


def _draft_without(q, x):
    """q [B, V] with the drawn x [B, 1] removed and renormalised: the law of the next draw without replacement."""
    rest = jnp.where(jnp.arange(q.shape[-1])[None, :] == x, 0.0, q)
    mass = jnp.sum(rest, -1, keepdims=True)
    return rest / jnp.where(mass > 0, mass, 1.0)


def recursive_rejection_accept(
    tokens: jax.Array,  # [B, D] node tokens; siblings drawn from their parent's q without replacement
    parent: jax.Array,  # [B, D]
    rank: jax.Array,  # [B, D] sampling order among siblings; the kept siblings are ranks 0..m-1
    draft_probs: jax.Array,  # [B, D, V] q each node was drawn from (siblings share it; root unused)
    target_probs: jax.Array,  # [B, D, V] processed target after each node
    keys: jax.Array,  # [B, D] typed keys, independent per (sequence, cycle, node)
    max_depth: int,
    topk: int,
    greedy_set: bool = False,
) -> Acceptance:
    """RSD-S: at the reached node try its children in sampling order, accepting x_i with probability
    min(1, p_i(x_i) / q_i(x_i)), where p_1, q_1 are the target and draft distributions there and each
    rejection moves to p_{i+1} = norm(max(p_i - q_i, 0)), q_{i+1} = q_i without x_i (renormalised).
    The walk enters an accepted child; where all children are rejected it emits a draw from the last
    p (the target itself at a node without children). S * K gathers of [B, V], no host loop.
    `greedy_set`: rank 0 is q's argmax, a point mass, tried after rank 1 (`_tried_order`)."""
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
            slots = [is_child & (rank == j) for j in range(topk)]
            by_rank = jnp.stack([jnp.argmax(c, axis=1) for c in slots], 1).astype(jnp.int32)  # [B, K]
            q = draft_probs[batch, by_rank[:, 0]]  # what the children were drawn from (siblings share it)
            children, exists, hub = _tried_order(by_rank, jnp.stack([jnp.any(c, axis=1) for c in slots], 1), greedy_set)
            q = _draws_start(q, tokens[batch, by_rank[:, 0]][:, None], exists[:, 0] & hub[:, 1], greedy_set)
            for j in range(topk):
                child = children[:, j]
                law, q_next = _child_law(q, tokens[batch, child][:, None], hub[:, j], greedy_set)
                ok, p, _ = _residual_step(p, law, tokens[batch, child], coins[batch, child],
                                          alive & ~found & exists[:, j])
                q = jnp.where((alive & ~found & exists[:, j])[:, None], q_next, q)
                nxt = jnp.where(ok, child, nxt)
                found = found | ok
        bonus = jnp.where(alive & ~found, emit(p, current), bonus)
        if depth == max_depth:
            break
        current = nxt
        path_mask, num_accepted = _step_into(path_mask, num_accepted, path_nodes, current, found)
        alive = found
    return Acceptance(path_mask, num_accepted, current, bonus, jnp.stack(path_nodes, axis=1))


def _post_order_first(candidate, plan: TreePlan, rank, max_depth):
    """-> [B] int32 the first node in post-order (children in rank order, a node after its subtree) among
    `candidate` [B, D] bool (the root, last in post-order, must be one). Post-order is the lexicographic
    order of the rank paths padded past a node's depth with a rank larger than any, compared pairwise."""
    d = rank.shape[1]
    k = jnp.arange(1, max_depth + 1)[None, None, :]
    ranks = jnp.take_along_axis(rank[:, None, :], plan.ancestor_at_depth[:, :, 1:max_depth + 1], axis=2)
    path = jnp.where(k <= plan.depth[..., None], ranks, d + 1)  # [B, D, S]: the ranks down to each node
    differ = path[:, :, None, :] != path[:, None, :, :]  # [B, D(u), D(v), S]
    first = jnp.argmax(differ, axis=-1)[..., None]
    before = jnp.take_along_axis(path[:, :, None, :].repeat(d, 2), first, -1)[..., 0] < \
        jnp.take_along_axis(path[:, None, :, :].repeat(d, 1), first, -1)[..., 0]  # [B, u, v]: u precedes v
    earlier = jnp.any(before & candidate[:, :, None], axis=1)  # [B, v]: some candidate precedes v
    return jnp.argmax(candidate & ~earlier, axis=1).astype(jnp.int32)


def _sibling_rejected(t, q, x):
    """What a node's target measure t [B, V] and draft q [B, V] become once its child x [B, 1] (drawn from
    q) and that child's subtree were rejected: t <- max(t - q, 0) / (1 - sum min(q, t)) (the part of t the
    child could not cover, given that it did not), q <- q without x, renormalised."""
    overlap = jnp.sum(jnp.minimum(q, t), axis=-1, keepdims=True)
    # 1 - overlap = 0: the child is always accepted (q <= t), so what follows is never reached
    t_next = jnp.maximum(t - q, 0.0) / jnp.where(overlap < 1.0, 1.0 - overlap, 1.0)
    return t_next, _draft_without(q, x)


def traversal_accept(
    tokens: jax.Array,  # [B, D] node tokens; siblings drawn from their parent's q without replacement
    parent: jax.Array,  # [B, D]
    rank: jax.Array,  # [B, D] sampling order among siblings; the kept siblings are ranks 0..m-1
    draft_probs: jax.Array,  # [B, D, V] q each node was drawn from (siblings share it; root unused)
    target_probs: jax.Array,  # [B, D, V] processed target after each node
    keys: jax.Array,  # [B, D] typed keys, independent per (sequence, cycle, node)
    max_depth: int,
    topk: int,
    greedy_set: bool = False,
) -> Acceptance:
    """Sequence-level verification of a sampled tree (block verification's tree form, in the spirit of
    Weng et al.'s Traversal Verification; docs/block_verification.md derives it and proves it exact).

    Every node n gets a weight w_n (root 1) and a target measure T, first w_n p_n; its children, in
    sampling order, each take the weight min(1, T(x)/q(x)) from the T and q of that moment, after which
    T <- max(T - q, 0) / (1 - sum min(q, T)) and q <- q without x, renormalised. What is left once every
    child has had its turn, a_n = sum T, is the chance that n itself is accepted when all its subtrees
    were rejected, and norm(T) is the law of the bonus there. The accepted node is the first node in
    post-order (a node after its subtree, siblings in rank order) whose coin u_n < a_n; a leaf has a_n =
    w_n, the root a = 1. On a chain this is `chain_block_accept`; at depth 1 recursive rejection. The
    weights are a function of the draft and the target alone (D sequential [B, V] steps of K siblings);
    only the coins decide where the traversal stops. `greedy_set`: rank 0 is q's argmax, a point mass, tried
    after rank 1 (`_tried_order`); post-order follows the order the siblings are tried."""
    b, d = tokens.shape
    vocab = target_probs.shape[-1]
    nodes = jnp.arange(d, dtype=jnp.int32)
    batch = jnp.arange(b)
    coins, noise = _coins_and_noise(keys, vocab)
    is_child = (parent[:, None, :] == nodes[None, :, None]) & (nodes[None, None, :] != nodes[None, :, None])
    slots = [is_child & (rank[:, None, :] == j) for j in range(topk)]  # [B, D(node), D(child)] per rank
    by_rank = jnp.stack([jnp.argmax(s, axis=-1) for s in slots], axis=-1).astype(jnp.int32)  # [B, D, K]
    exists = jnp.stack([jnp.any(s, axis=-1) for s in slots], axis=-1)  # [B, D, K]
    child, exists, hub = _tried_order(by_rank, exists, greedy_set)
    tried = rank  # the position of each node among its siblings in the order they are tried
    if greedy_set:
        tried = jnp.zeros_like(rank)
        for j in range(topk):  # [B, D]: child[b, n, j] is tried j-th
            tried = jnp.where(exists[:, :, j][batch[:, None], parent] & (child[:, :, j][batch[:, None], parent]
                                                                          == nodes[None, :]), j, tried)

    def node_step(i, carry):
        weight, left, rest = carry  # [B, D] weights, [B, D] a_n, [B, D, V] the final T of each node
        t = weight[:, i, None] * target_probs[:, i]  # [B, V]
        q = _draws_start(draft_probs[batch, by_rank[:, i, 0]], tokens[batch, by_rank[:, i, 0]][:, None],
                         hub[:, i, 1], greedy_set)  # what the node's first drawn child came from
        for j in range(topk):
            c = child[:, i, j]
            x = tokens[batch, c][:, None]
            law, q_next = _child_law(q, x, hub[:, i, j], greedy_set)
            qx = jnp.take_along_axis(law, x, axis=1)[:, 0]
            tx = jnp.take_along_axis(t, x, axis=1)[:, 0]
            has = exists[:, i, j] & (qx > 0)  # beyond q's support: not a draw (and no later sibling is)
            w_c = jnp.minimum(1.0, tx / jnp.where(has, qx, 1.0))
            weight = weight.at[batch, c].set(jnp.where(has, w_c, weight[batch, c]))
            t_next, _ = _sibling_rejected(t, law, x)
            t = jnp.where(has[:, None], t_next, t)
            q = jnp.where(has[:, None], q_next, q)
        left = left.at[:, i].set(jnp.sum(t, axis=-1))
        rest = rest.at[:, i].set(t)
        return weight, left, rest

    weight = jnp.zeros((b, d), jnp.float32).at[:, 0].set(1.0)
    init = (weight, jnp.zeros((b, d), jnp.float32), jnp.zeros((b, d, vocab), jnp.float32))
    weight, left, rest = jax.lax.fori_loop(0, d, node_step, init)
    candidate = (coins < left) | (nodes[None, :] == 0)
    plan = build_plan(parent, jnp.zeros((b,), jnp.int32), max_depth)  # ancestors and depths
    last = _post_order_first(candidate, plan, tried, max_depth)
    depth = plan.depth[batch, last]  # [B] the accepted node's depth
    k = jnp.arange(max_depth + 1)[None, :]
    path_nodes = jnp.where(k <= depth[:, None], plan.ancestor_at_depth[batch, last, : max_depth + 1],
                           last[:, None]).astype(jnp.int32)  # [B, S+1]: the last node repeats past its depth
    path_mask = plan.ancestor_mask[batch, last]
    dist = rest[batch, last]
    dist = jnp.where(jnp.sum(dist, -1, keepdims=True) > 0, dist, target_probs[batch, last])
    bonus = jnp.argmax(jnp.log(dist) + noise[batch, last], axis=-1).astype(jnp.int32)
    return Acceptance(path_mask, depth.astype(jnp.int32), last, bonus, path_nodes)


# the sampled-draft rules: (chain rule, tree rule) by name
SAMPLED_RULES = {
    "block": (chain_block_accept, traversal_accept),
    "residual": (chain_residual_accept, recursive_rejection_accept),
}


def sampled_accept(
    tree: Tree,  # a sampled draft (`speculation/sampled.py`): tree.q holds log q each node was drawn from
    logits: jax.Array,  # [B, D, V] target logits at every node
    max_depth: int,
    topk: int,
    sampling: Sampling,
    keys: jax.Array,  # [B, D] typed keys, independent per (sequence, cycle, node)
    rule: str,
    greedy_set: bool = False,
) -> Acceptance:
    """Exact sampling of a sampled draft by `rule` (static): "block", block verification for K = 1 and its
    tree form (`traversal_accept`) for trees; "residual", the token rule for K = 1 and recursive rejection
    (RSD-S) for trees. The argmax walk at temperature 0 (the same program)."""
    if rule not in SAMPLED_RULES:
        raise ValueError(f"rule must be one of {tuple(SAMPLED_RULES)}, got {rule!r}")
    chain_rule, tree_rule = SAMPLED_RULES[rule]

    def greedy():
        return greedy_accept(tree.tokens, tree.parent, jnp.argmax(logits, axis=-1).astype(jnp.int32), max_depth)

    def sampled():
        logp = processed_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        if topk == 1:  # a chain: nodes 0..S in order
            acc = chain_rule(tree.tokens, tree.q[:, 1:], logp, keys)
        else:
            acc = tree_rule(tree.tokens, tree.parent, tree.rank, jnp.exp(tree.q), jnp.exp(logp), keys, max_depth, topk,
                            greedy_set)
        return select_rows(sampling.sampled_rows, acc, greedy())  # a mixed batch's greedy rows walk the argmax

    return jax.lax.cond(sampling.any_sampled, sampled, greedy)
