"""The reference a speculative run's committed state is held to: step-by-step decoding of the tokens it
committed. The target takes them through `network.extend` one token per call (the dense path, no tree,
no band) and the MTP block's window ring is fed one MTP position per call (position i: the target's
streams H_i from that step decode and token i + 1), exactly as a plain decoder would build them. After
every cycle the whole speculative state (`cycle.SpecState`: every target leaf, the MTP ring, its length,
the streams it pairs next) must equal this reference, and the greedy argmax after each fed token must be
the next token the cycle emitted (the identity, step by step).

Used by tests/test_speculative.py (the test preset, mixed-acceptance model) and tests/test_v4_geometry.py
(window 128, CSA 4 with top-512, HCA 128).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.model import dspark as dspark_model
from jaxspec.model import network
from jaxspec.model import state as state_lib
from jaxspec.model.sampling import Sampling
from jaxspec.speculation.cycle import speculative_cycle

REL_TOL = 1e-5  # of the leaf's largest magnitude, as the prefill tests (tree verify vs one-token steps)


@functools.partial(jax.jit, static_argnums=(0,))
def _step(cfg, target, mtp, state, ring, mtp_length, last_hidden, has_hidden, token, valid):
    """One token per row (rows with valid False take nothing): the target's extend of it, and the MTP
    position before it (H of the previous token, this token), for rows that have a previous token."""
    out, state = network.extend(target, cfg, state, token[:, None], valid[:, None], banded=False)
    take = (valid & has_hidden)[:, None]
    ctx = network.causal_context(mtp_length, take)
    _, _, rows = network.mtp_forward(target, mtp, cfg, ring, last_hidden[:, None], token[:, None], ctx)
    mtp_length = mtp_length + take[:, 0].astype(jnp.int32)
    ring = state_lib.commit_layer(cfg, "sliding", ring, rows, ctx.positions, take, mtp_length)
    last_hidden = jnp.where(valid[:, None, None], out.hidden[:, 0], last_hidden)
    return out.logits[:, 0], state, ring, mtp_length, last_hidden, has_hidden | valid


class StepReference:
    """Step-by-step decoding of a batch's committed tokens (params with an MTP block)."""

    def __init__(self, params, cfg, batch: int, max_len: int):
        self.cfg, self.target, self.mtp = cfg, params.replace(mtp=None), params.mtp
        self.state = state_lib.init_state(cfg, batch, max_len)
        self.ring = state_lib.layer_state(cfg, "sliding", batch, max_len)
        self.mtp_length = jnp.zeros((batch,), jnp.int32)
        self.last_hidden = jnp.zeros((batch, cfg.hc_mult, cfg.hidden_size), jnp.dtype(cfg.dtype))
        self.has_hidden = jnp.zeros((batch,), bool)

    def feed(self, rows: list[list[int]]) -> list[list[int]]:
        """Commit rows[r] (any lengths) one token per call -> per row, the argmax after each fed token."""
        b = len(rows)
        steps = max((len(r) for r in rows), default=0)
        argmax = [[] for _ in range(b)]
        for j in range(steps):
            valid = np.asarray([j < len(r) for r in rows])
            token = np.asarray([r[j] if j < len(r) else 0 for r in rows], np.int32)
            logits = self._step(jnp.asarray(token), jnp.asarray(valid))
            best = np.asarray(jnp.argmax(logits, axis=-1))
            for r in np.flatnonzero(valid):
                argmax[r].append(int(best[r]))
        return argmax

    def _step(self, token, valid):
        logits, self.state, self.ring, self.mtp_length, self.last_hidden, self.has_hidden = _step(
            self.cfg, self.target, self.mtp, self.state, self.ring, self.mtp_length, self.last_hidden,
            self.has_hidden, token, valid)
        return logits

    def _pairs(self, spec_state):
        np.testing.assert_array_equal(np.asarray(spec_state.drafter.length), np.asarray(self.mtp_length))
        return [("target", spec_state.target.layers, self.state.layers),
                ("mtp ring", spec_state.drafter.ring, self.ring),
                ("mtp last_hidden", spec_state.drafter.last_hidden, self.last_hidden)]

    def assert_equals(self, spec_state, where: str = "") -> float:
        """Every leaf of the committed target state and of the draft's state equals this reference
        (lengths exactly, floats to REL_TOL of each leaf's largest magnitude) -> the largest relative
        difference seen."""
        np.testing.assert_array_equal(np.asarray(spec_state.target.length), np.asarray(self.state.length), where)
        pairs = self._pairs(spec_state)
        worst = 0.0
        for name, got, want in pairs:
            got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
            assert len(got_leaves) == len(want_leaves), (name, where)
            for i, (x, y) in enumerate(zip(got_leaves, want_leaves, strict=True)):
                assert x.shape == y.shape and x.dtype == y.dtype, (name, i, x.shape, y.shape, where)
                x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
                scale = max(np.max(np.abs(y)), 1e-30)
                err = float(np.max(np.abs(x - y)) / scale) if x.size else 0.0
                assert err <= REL_TOL, f"{where}: {name} leaf {i} {x.shape}: relative difference {err:.2e}"
                worst = max(worst, err)
        return worst


@functools.partial(jax.jit, static_argnums=(0, 1))
def _dspark_step(cfg, dcfg, target, draft, state, dstate, token, valid):
    """One token per row through the target, its tapped rows into the DSpark drafter's rings."""
    positions = state.length[:, None]
    out, state = network.extend(target, cfg, state, token[:, None], valid[:, None], banded=False,
                                 capture=dcfg.target_layers)
    dstate = dspark_model.commit_context(draft, cfg, dcfg, dstate, out.captured, positions, valid[:, None])
    return out.logits[:, 0], state, dstate


class DSparkStepReference(StepReference):
    """Step-by-step decoding for a DSpark drafter (V4 or V4.1 target): each fed token's tapped rows are
    committed into the drafter's rings, as a plain decoder followed by the drafter would build them."""

    def __init__(self, target, draft, cfg, dcfg, batch: int, max_len: int):
        self.cfg, self.dcfg, self.target, self.draft = cfg, dcfg, target, draft
        self.state = state_lib.init_state(cfg, batch, max_len)
        self.dstate = dspark_model.init_dspark_state(cfg, dcfg, batch)

    def _step(self, token, valid):
        logits, self.state, self.dstate = _dspark_step(self.cfg, self.dcfg, self.target, self.draft, self.state,
                                                       self.dstate, token, valid)
        return logits

    def _pairs(self, spec_state):
        np.testing.assert_array_equal(np.asarray(spec_state.drafter.length), np.asarray(self.dstate.length))
        return [("target", spec_state.target, self.state), ("dspark rings", spec_state.drafter.stages,
                                                                self.dstate.stages)]


@functools.partial(jax.jit, static_argnums=(0,))
def greedy_cycle(sp, models, state):
    """One greedy `speculative_cycle`, every row active -> (state, CycleOut)."""
    return speculative_cycle(sp, models, state, Sampling.create(), jnp.ones(state.root.shape, bool))


def run_and_check(sp, models, params, state, prompts: list[list[int]], max_len: int, cycles: int,
                  ref: StepReference | None = None) -> dict:
    """From `state` (the speculative prefill of `prompts`), `cycles` greedy cycles; after the prefill and
    after each cycle the committed state equals `StepReference` fed the same tokens, and every emitted
    token is the reference's greedy argmax. -> {"worst": largest relative state difference, "emitted":
    tokens per row after the first, "depth_hits" [S], "rank_hist" [K], "stops" [S+1] cycles per number of
    accepted drafts}. `ref`: the reference for a drafter other than `params`' MTP block (`DSparkStepReference`)."""
    b = len(prompts)
    ref = StepReference(params, sp.cfg, b, max_len) if ref is None else ref
    greedy = ref.feed(prompts)
    np.testing.assert_array_equal(np.asarray(state.root), [g[-1] for g in greedy], "first token")
    worst = ref.assert_equals(state, "after the prefill")
    emitted = [0] * b
    stops = np.zeros(sp.spec.num_steps + 1, np.int64)
    for c in range(cycles):
        root = np.asarray(state.root)
        state, out = greedy_cycle(sp, models, state)
        path, n, bonus = np.asarray(out.path), np.asarray(out.num_accepted), np.asarray(out.bonus)
        committed = [path[r, : n[r] + 1].tolist() for r in range(b)]
        for r in range(b):
            assert committed[r][0] == root[r], (c, r)  # the root heads the path
            stops[n[r]] += 1
        after = ref.feed(committed)
        for r in range(b):  # the token after each committed one: the next accepted draft, then the bonus
            np.testing.assert_array_equal(committed[r][1:] + [int(bonus[r])], after[r], f"cycle {c} row {r}")
            emitted[r] += n[r] + 1
        worst = max(worst, ref.assert_equals(state, f"after cycle {c}"))
    return {"worst": worst, "emitted": emitted, "depth_hits": np.asarray(state.stats.depth_hits).sum(0),
            "rank_hist": np.asarray(state.stats.rank_hist).sum(0), "stops": stops}
