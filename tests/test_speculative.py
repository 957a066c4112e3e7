"""Ladder rungs 4-5 for trees: verify logits on every root-to-leaf path equal sequential decode,
greedy speculative output equals `generate`, rejected branches never leak, the committed state
equals a plain prefill of the accepted tokens, and the loop compiles once per bucket."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from committed_state import run_and_check

import jaxspec as js
from jaxspec.model import network as model
from jaxspec.model import state as state_lib
from jaxspec.model.sampling import Sampling
from jaxspec.speculation.cycle import accept_stage, commit_stage, draft_stage, plan_stage, verify_stage
from jaxspec.speculation.generate import speculative_compile_count
from jaxspec.speculation.plan import build_plan, verify_context
from jaxspec.testing import long_tests, mtp_models, mtp_prefill, mtp_speculator


def completes_block(plan, ratio: int) -> jax.Array:
    """[B, D] bool: nodes that close a compression block of `ratio` (they emit a branch-local entry)."""
    return (plan.positions + 1) % ratio == 0

extend = jax.jit(model.extend, static_argnums=(1,))
forward = jax.jit(model.forward, static_argnums=(1,))

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]]


def _random_tree(rng, num_nodes, max_depth):
    parent, depth = [0], [0]
    for _ in range(1, num_nodes):
        choices = [i for i in range(len(parent)) if depth[i] < max_depth]
        p = int(rng.choice(choices))
        parent.append(p)
        depth.append(depth[p] + 1)
    return np.asarray(parent, np.int32)


@pytest.mark.parametrize("lengths,seed", [((13, 30), 0), ((1, 3), 1), ((15, 47), 2), ((16, 4), 3)])
def test_tree_paths_equal_sequential_decode(test_params, test_cfg, lengths, seed):
    cfg, params = test_cfg, test_params
    rng = np.random.default_rng(seed)
    b, num_nodes, max_depth = 2, 12, 5
    prompt = jax.random.randint(jax.random.key(seed), (b, 64), 0, cfg.vocab_size)
    valid = jnp.arange(64)[None, :] < jnp.asarray(lengths)[:, None]
    _, committed = extend(params, cfg, state_lib.init_state(cfg, b, 128), prompt, valid)
    parent = jnp.asarray(np.stack([_random_tree(rng, num_nodes, max_depth) for _ in range(b)]))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, num_nodes)), jnp.int32)
    plan = build_plan(parent, committed.length, max_depth)
    out = forward(params, cfg, committed, tokens, verify_context(plan, committed.length))
    # Some branches close CSA / HCA blocks and others do not (checked, so the test covers it).
    emits = np.asarray(completes_block(plan, cfg.hca_ratio) | completes_block(plan, cfg.csa_ratio))
    assert emits.any() and not emits[:, 1:].all()
    mask = np.asarray(plan.ancestor_mask)
    depth = np.asarray(plan.depth)
    for row in range(b):
        is_parent = np.zeros(num_nodes, bool)
        is_parent[np.asarray(parent[row])[1:]] = True
        leaves = np.flatnonzero(~is_parent)
        for leaf in leaves:
            path = sorted(np.flatnonzero(mask[row, leaf]), key=lambda j: depth[row, j])
            state = committed
            for node in path:
                active = jnp.asarray([[r == row] for r in range(b)])
                step, state = extend(params, cfg, state, tokens[:, node : node + 1], active)
                expect = np.asarray(step.logits[row, 0])
                got = np.asarray(out.logits[row, node])
                assert np.max(np.abs(got - expect)) <= 1e-5 * np.max(np.abs(expect)), (row, leaf, node)


# A fixed subset for CI (a chain, K = 2 and K = 4 trees, the deepest D; ~25 s of compiling each), two more
# in the long tier. JAXSPEC_SPEC_GRID=corners runs every (S, K) pair with S 1..5, K {1,2,4} at its
# smallest and largest D; JAXSPEC_SPEC_GRID=full runs every valid config with D 2..16 (96 of them).
CI_SPECS = ["s1_k1_d2", "s3_k2_d6", "s5_k2_d16", "s4_k4_d16"]
if long_tests():
    CI_SPECS += ["s5_k1_d6", "s2_k4_d9"]


def _grid(corners_only):
    names = []
    for s in range(1, 6):
        for k in (1, 2, 4):
            valid = []
            for d in range(2, 17):
                try:
                    valid.append(js.SpecConfig(s, k, d).name)
                except ValueError:
                    pass
            names += sorted({valid[0], valid[-1]}) if corners_only else valid
    return names


_GRID = os.environ.get("JAXSPEC_SPEC_GRID", "")
SPECS = _grid(corners_only=True) if _GRID == "corners" else _grid(False) if _GRID == "full" else CI_SPECS


# Batch 3 (PROMPTS) always; the full grid adds a single sequence and a ragged batch of 8 whose
# prompt lengths sit on and beside the CSA (4), window (8) and HCA (16) boundaries.
PROMPT_SETS = {
    3: PROMPTS,
    1: [[9, 8, 7, 6, 5]],
    8: [list(range(11, 11 + n)) for n in (1, 3, 4, 7, 8, 15, 16, 17)],
}
# Each (spec, batch) compiles its own loop: the full grid runs batches 1 and 8 for every config (464
# more compiles, hours of CPU), the corners grid at its 25 (S, K) corners, CI at batch 3 only.
# A long grid no longer runs out of memory maps (each compiled loop holds ~1,000-1,800 and Linux's
# default vm.max_map_count is 65,530): at most `jaxspec.core.programs.cache_size()` loops stay compiled,
# the least recently used are freed (tests/test_programs.py compiles 60 in one process).
SPEC_BATCHES = [(spec, 3) for spec in SPECS]
SPEC_BATCHES += [(spec, batch) for spec in SPECS if _GRID for batch in (1, 8)]
if os.environ.get("JAXSPEC_SPEC_GRID_BATCHES"):  # e.g. "1,8": split a long grid run over processes
    _keep = {int(b) for b in os.environ["JAXSPEC_SPEC_GRID_BATCHES"].split(",")}
    SPEC_BATCHES = [(spec, batch) for spec, batch in SPEC_BATCHES if batch in _keep]


def stop_depths(stats, num_steps: int) -> np.ndarray:
    """[S + 1] cycles per number of accepted drafts, from the per-depth hits (cycles reaching depth d)."""
    hits = np.asarray(stats["per_sequence"]["depth_hits"]).sum(0)
    reached = np.concatenate([[stats["cycles"]], hits, [0]])
    return reached[:-1] - reached[1:]


# Floors on what the mixed-acceptance model must exercise in each CI config (batch 3, 56 new tokens;
# measured, conditional acceptance per depth / sibling accepts (rank >= 1) / cycles per number accepted):
#   s1_k1_d2   .46                   -          stops [62, 53]
#   s5_k1_d6   .42 .51 .94 .94 .06   -          stops [48, 17, 1, 1, 15, 1]
#   s3_k2_d6   .48 .92 .51           20 of 91   stops [42, 3, 17, 18]
#   s5_k2_d16  .55 .54 1.0 .95 .94   33 of 108  stops [29, 16, 0, 1, 1, 17]
#   s2_k4_d9   .71 .61               36 of 90   stops [23, 22, 34]
#   s4_k4_d16  .56 .89 .59 .95       34 of 105  stops [28, 4, 13, 1, 18]
# Alone a mixed case compiles its loop (~40 s on one core); after "random" and "agreeing" it reuses theirs.
MIXED_FIRST_DEPTH = (0.2, 0.85)  # cycles accepting >= 1 draft / cycles
MIXED_SIBLING_SHARE = 0.1  # accepted drafts of rank >= 1 / accepted drafts, K >= 2
MIXED_PARTIAL_SHARE = 0.1  # cycles accepting 1..S-1 drafts (a path cut below full depth) / cycles, S >= 2


# "which" varies fastest, so the models reuse one compiled loop back to back.
@pytest.mark.parametrize("which", ["random", "agreeing", "mixed"])
@pytest.mark.parametrize("spec,batch", SPEC_BATCHES)
def test_greedy_speculative_equals_generate(test_params, agreeing_params, mixed_params, test_cfg, spec, which,
                                            batch):
    params = {"random": test_params, "agreeing": agreeing_params, "mixed": mixed_params}[which]
    prompts = PROMPT_SETS[batch]
    n = 56  # from each prompt this crosses the window (8) and HCA blocks (16) several times
    ref = js.generate(params, test_cfg, prompts, max_new_tokens=n)
    out = js.speculative_generate(params, test_cfg, prompts, spec, max_new_tokens=n)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    stats = out.stats
    sc = js.SpecConfig.parse(spec)
    assert stats["cycles"] > 0 and len(stats["per_depth_acceptance"]) == sc.num_steps
    if which == "agreeing":
        assert stats["mean_accepted_length"] > 1.5, stats  # long accepts are exercised
    if which == "mixed" and batch == 3:  # the identity held on partial paths and sibling accepts
        stops, ranks = stop_depths(stats, sc.num_steps), np.asarray(stats["rank_histogram"])
        first = 1 - stops[0] / stats["cycles"]
        assert MIXED_FIRST_DEPTH[0] <= first <= MIXED_FIRST_DEPTH[1], (first, stats)
        assert stops[0] >= 1, (stops, stats)  # a rejected first depth
        if sc.num_steps > 1:
            assert stops[1 : sc.num_steps].sum() >= MIXED_PARTIAL_SHARE * stats["cycles"], (stops, stats)
        if sc.topk > 1:
            assert ranks[1:].sum() >= MIXED_SIBLING_SHARE * ranks.sum(), (ranks, stats)
    emitted = sum(stats["per_sequence"]["accepted"]) + stats["cycles"]
    assert emitted >= out.lengths.sum() - len(prompts)  # every token after the first came from a cycle


# CI: batch 8 (ragged prompts of 1-19 tokens); batch 1 adds ~45 s of compiling (long).
@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.long), 8])
def test_batch_sizes_and_eos(agreeing_params, test_cfg, batch):
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, test_cfg.vocab_size, int(rng.integers(1, 20))).tolist() for _ in range(batch)]
    ref = js.generate(agreeing_params, test_cfg, prompts, max_new_tokens=40)
    eos = int(ref.tokens[0, 10])
    ref = js.generate(agreeing_params, test_cfg, prompts, max_new_tokens=40, eos_id=eos)
    out = js.speculative_generate(agreeing_params, test_cfg, prompts, "s3_k2_d6", max_new_tokens=40, eos_id=eos)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    assert out.lengths[0] <= 11


@functools.partial(jax.jit, static_argnums=(0, 3))
def cycle(sp, models, state, poisoned):
    """One cycle by its stages; `poisoned`: the verify scratch of every node off the accepted path set to
    NaN before the commit. The commit must read only the accepted path, so nothing may change.
    -> (state, tree, acceptance)."""
    sampling = Sampling.create()
    tree = draft_stage(sp, models, state, sampling)
    verify_out = verify_stage(sp, models, state.target, tree, plan_stage(sp, state.target, tree))
    acc = accept_stage(sp, tree, verify_out.logits, sampling, state.stats.cycles)
    if poisoned:
        off_path = ~acc.path_mask  # [B, D]

        def poison(x):
            if x is None or not jnp.issubdtype(x.dtype, jnp.floating):
                return x
            return jnp.where(off_path.reshape(off_path.shape + (1,) * (x.ndim - 2)), jnp.nan, x)

        verify_out = verify_out.replace(rows=jax.tree.map(poison, verify_out.rows), hidden=poison(verify_out.hidden))
    state, _ = commit_stage(sp, models, state, tree, verify_out, acc, jnp.ones(state.root.shape, bool))
    return state, tree, acc


def _prefilled(params, cfg, prompts, spec, max_len=128):
    """Target prefill + the drafter following it, as the speculative loop does; -> SpecState."""
    b, width = len(prompts), max(len(p) for p in prompts)
    tokens = np.zeros((b, width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return mtp_prefill(params, cfg, tokens, [len(p) for p in prompts], max_len, spec=spec)


def test_poisoned_rejected_branches_do_not_leak_and_state_equals_prefill(agreeing_params, test_cfg):
    cfg, params = test_cfg, agreeing_params
    spec = js.SpecConfig.parse("s4_k4_d16")
    sp, models = mtp_speculator(cfg, spec), mtp_models(params)
    clean = poisoned = _prefilled(params, cfg, PROMPTS, spec)
    accepted = [[] for _ in PROMPTS]
    rejected_any = False
    for _ in range(8):
        s1, tree, acc = cycle(sp, models, clean, False)
        s2, _, _ = cycle(sp, models, poisoned, True)
        rejected_any |= bool(np.any(~np.asarray(acc.path_mask)))
        for x, y in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
            assert not np.isnan(np.asarray(y, np.float64)).any()
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        path_tokens = np.take_along_axis(np.asarray(tree.tokens), np.asarray(acc.path_nodes), axis=1)
        for i in range(len(PROMPTS)):
            accepted[i].extend(path_tokens[i, : int(acc.num_accepted[i]) + 1].tolist())
        clean, poisoned = s1, s2
    assert rejected_any
    # The committed target state equals a plain prefill of prompt + committed tokens.
    full = [list(p) + a for p, a in zip(PROMPTS, accepted, strict=True)]
    width = max(len(f) for f in full)
    tokens = np.zeros((len(full), width), np.int32)
    for i, f in enumerate(full):
        tokens[i, : len(f)] = f
    valid = jnp.arange(width)[None, :] < jnp.asarray([len(f) for f in full])[:, None]
    _, reference = extend(params, cfg, state_lib.init_state(cfg, len(full), 128), jnp.asarray(tokens), valid)
    final = clean.target
    np.testing.assert_array_equal(np.asarray(final.length), np.asarray(reference.length))
    for x, y in zip(jax.tree.leaves(final.layers), jax.tree.leaves(reference.layers), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.max(np.abs(x - y)) <= 1e-5 * max(np.max(np.abs(y)), 1e-30)


def test_committed_state_equals_step_decode_mixed(mixed_params, test_cfg):
    """After every cycle of the mixed-acceptance model (partial paths, sibling accepts) the whole speculative
    state (target leaves, MTP ring, lengths, paired streams) equals step-by-step decoding of the committed
    tokens, and every emitted token is that decode's argmax."""
    spec = js.SpecConfig.parse("s3_k2_d6")
    state = _prefilled(mixed_params, test_cfg, PROMPTS, spec)
    got = run_and_check(mtp_speculator(test_cfg, spec), mtp_models(mixed_params), mixed_params, state, PROMPTS,
                        128, cycles=8)
    assert got["rank_hist"][1:].sum() >= 1, got  # a sibling was accepted and committed
    assert got["stops"][0] >= 1 and got["stops"][1 : spec.num_steps].sum() >= 1, got  # rejections and partial paths


def test_loop_compiles_once_per_bucket(test_params, test_cfg):
    js.speculative_generate(test_params, test_cfg, PROMPTS, "s3_k2_d6", max_new_tokens=24)
    before = speculative_compile_count()
    js.speculative_generate(test_params, test_cfg, [[1, 2], [3], [9] * 20, [4]], "s3_k2_d6", max_new_tokens=24)
    js.speculative_generate(test_params, test_cfg, PROMPTS[::-1], js.SpecConfig(3, 2, 6), max_new_tokens=24)
    assert speculative_compile_count() == before


@pytest.mark.parametrize(
    "spec,match",
    [
        ("s3_k1_d6", "linear chain"),
        ("s2_k2_d12", "allowed 2..7"),
        ("s3_k2_d1", "num_draft_tokens must be >= 2"),
        ("s0_k2_d4", "num_steps"),
        ("tree", "s3_k2_d6"),
        ("s8_k1_d9", "below the sliding window"),
    ],
)
def test_bad_spec(test_params, test_cfg, spec, match):
    with pytest.raises(ValueError, match=match):
        js.speculative_generate(test_params, test_cfg, PROMPTS, spec, max_new_tokens=4)


def test_bad_inputs(test_params, test_cfg):
    with pytest.raises(ValueError, match="prompt_lengths"):
        js.speculative_generate(
            test_params, test_cfg, np.ones((2, 4), np.int32), "s3_k2_d6", max_new_tokens=4, prompt_lengths=[4, 4, 4]
        )
    with pytest.raises(ValueError, match="no MTP block; pass draft="):
        no_mtp = test_cfg.replace(num_mtp_layers=0)
        js.speculative_generate(test_params, no_mtp, PROMPTS, "s3_k2_d6", max_new_tokens=4)
    assert js.SpecConfig.parse("s3_k2_d6") == js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
