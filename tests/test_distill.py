"""Draft training sees what inference sees: the unrolled training forward's chain equals
the MTP drafter's top-1 chain on the same inputs; the loss trains the MTP block only; data chunks resume."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.testing import mtp_prefill, mtp_tree, randomize
from jaxspec.training import distill


@pytest.fixture(scope="session")
def small():
    # The `test` preset cut to two layers (CSA + indexer, HCA; the MTP block is the sliding layer):
    # every mechanism the draft and its training touch, at a fraction of the compile time.
    cfg = js.ModelConfig.preset("test", num_layers=2, layer_types=("csa", "hca"))
    params = jax.jit(lambda k: randomize(js.init_params(cfg, k), jax.random.fold_in(k, 1)))(jax.random.key(0))
    return cfg, params


def test_unrolled_training_chain_equals_the_drafted_chain(small):
    cfg, params = small
    steps, t, width = 3, 30, 22
    spec = js.SpecConfig(steps, 1, steps + 1)
    # One program each for every root (prompts padded to one width): roots before, at and after the
    # compressors' block boundaries.
    target_pass = jax.jit(distill.target_pass, static_argnums=(1,))
    unrolled = jax.jit(distill.unrolled_draft_logits, static_argnums=(1, 4))
    for r in (0, 9, 21):
        rng = np.random.default_rng(r)
        seq = rng.integers(0, cfg.vocab_size, 40).astype(np.int32)
        # the drafted chain after committing x_0..x_r, with x_{r+1} as the root (as a cycle would)
        prompt = np.zeros((1, width), np.int32)
        prompt[0, : r + 1] = seq[: r + 1]
        state = mtp_prefill(params, cfg, prompt, [r + 1], 64, spec=spec)
        tree = mtp_tree(params, cfg, spec, state.replace(root=jnp.asarray(seq[None, r + 1])))
        chain = np.asarray(tree.tokens[0, 1:])  # t_1 .. t_S
        # the training forward fed the draft's own tokens after the root
        seq[r + 2 : r + 1 + steps] = chain[: steps - 1]
        target_hidden, _ = target_pass(params, cfg, jnp.asarray(seq[None, :t]))
        logits = unrolled(params, cfg, target_hidden, jnp.asarray(seq[None, : t + steps]), steps)
        logp = [jax.nn.log_softmax(x[0, r]) for x in logits]
        assert [int(jnp.argmax(x)) for x in logp] == chain.tolist(), r
        score = np.cumsum([float(x[tok]) for x, tok in zip(logp, chain, strict=True)])
        np.testing.assert_allclose(score, np.asarray(tree.score[0, 1:]), rtol=1e-5, atol=1e-5)


def test_distill_step_trains_the_draft_only(small):
    test_cfg, test_params = small
    dc = distill.DistillConfig(num_steps=2, steps=10, warmup_steps=0)
    ds = distill.init_distill_state(test_params, dc)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, test_cfg.vocab_size, (2, 18)), jnp.int32)
    mask = jnp.ones((2, 18), bool).at[1, 12:].set(False)
    before = distill.distill_eval(ds.mtp, test_params, tokens, mask, test_cfg, 2)
    for _ in range(5):
        ds, metrics = distill.distill_step(ds, test_params, tokens, mask, jnp.float32(3e-3), test_cfg, dc)
    after = distill.distill_eval(ds.mtp, test_params, tokens, mask, test_cfg, 2)
    assert int(ds.step) == 5 and np.isfinite(float(metrics["grad_norm"]))
    assert float(after["loss"]) < float(before["loss"])  # the KL to the target falls
    assert float(after["kl1"]) >= 0 and 0 <= float(after["agree2"]) <= 1
    # the target stays untouched: the step only ever sees and returns the MTP block
    assert jax.tree.structure(ds.mtp) == jax.tree.structure(test_params.mtp)


def test_generate_data_resumes_and_loads(small, tmp_path):
    test_cfg, test_params = small
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    n = distill.generate_data(test_params, test_cfg, prompts, tmp_path, max_new_tokens=6, chunk_size=2,
                              temperatures=(0.0, 1.0))
    assert n == 4 and len(list(tmp_path.glob("chunk_*.npz"))) == 4
    first = (tmp_path / "chunk_00000.npz").stat().st_mtime_ns
    distill.generate_data(test_params, test_cfg, prompts, tmp_path, max_new_tokens=6, chunk_size=2)
    assert (tmp_path / "chunk_00000.npz").stat().st_mtime_ns == first  # kept, not redone
    seqs = distill.load_data(tmp_path)
    assert len(seqs) == 8 and seqs[0][:3].tolist() == [1, 2, 3]
    greedy = js.generate(test_params, test_cfg, prompts[:2], max_new_tokens=6)
    assert seqs[0][3:].tolist() == greedy.tokens[0, : greedy.lengths[0]].tolist()
    tokens, mask = distill.batch_rows(seqs, step=3, batch=4, width=8)
    assert tokens.shape == (4, 8) and mask.any(axis=1).all()
    with pytest.raises(ValueError, match="distill-data"):
        distill.load_data(tmp_path / "nothing")


def test_one_step_recipe_is_deepseeks_mtp_loss(small):
    """The one-step recipe (depth 1, no KL, cross-entropy on the text) is the MTP loss `jaxspec train`
    optimises jointly with the target: the next-next token, teacher-forced from the target's streams."""
    from jaxspec.training.train import loss_fn

    cfg, params = small
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 26)), jnp.int32)  # [B, T+2]
    _, aux = jax.jit(loss_fn, static_argnums=(1,))(params, cfg, tokens, 1.0)
    # distill reads the row as T+1 chains, the last without a target: the same T predictions x_2..x_{T+1}
    # jitted: op by op the target pass and the chain took half a minute
    loss, m = jax.jit(distill.distill_loss, static_argnums=(2, 5, 6, 7))(
        params.mtp, params, cfg, tokens, jnp.ones(tokens.shape, bool), 1, 1.0, 0.0)
    np.testing.assert_allclose(float(loss), float(aux["mtp"]), rtol=2e-5)
    assert float(m["ce1"]) == float(loss) and float(m["kl1"]) > 0  # the KL is reported, not trained


def test_one_step_training_starts_fresh_and_trains_depth_one(small):
    cfg, params = small
    dc = distill.DistillConfig(**distill.ONE_STEP, eval_steps=3, steps=10, warmup_steps=0)
    ds = distill.init_distill_state(params, dc, cfg, fresh=jax.random.key(7))
    own = jax.tree.leaves(params.mtp)
    fresh = jax.tree.leaves(ds.mtp)
    assert any(not np.allclose(np.asarray(a, np.float32), np.asarray(b)) for a, b in zip(own, fresh, strict=True))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 18)), jnp.int32)
    mask = jnp.ones((2, 18), bool)
    before = distill.distill_eval(ds.mtp, params, tokens, mask, cfg, 1, 1.0)
    for _ in range(5):
        ds, metrics = distill.distill_step(ds, params, tokens, mask, jnp.float32(3e-3), cfg, dc)
    after = distill.distill_eval(ds.mtp, params, tokens, mask, cfg, 1, 1.0)
    assert set(metrics) >= {"ce1", "kl1", "agree1"} and "agree2" not in metrics  # depth 1 only
    assert float(after["ce1"]) < float(before["ce1"])
    deep = distill.distill_eval(ds.mtp, params, tokens, mask, cfg, dc.eval_depths, 1.0)  # judged reused deeper
    assert {"agree1", "agree2", "agree3"} <= set(deep)
    with pytest.raises(ValueError, match="not both 0"):
        distill.DistillConfig(ce_weight=0.0, kl_weight=0.0)
