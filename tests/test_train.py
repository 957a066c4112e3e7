"""Training smoke on the `test` preset: finite, decreasing loss; gradients reach the float leaves;
orbax resume continues where a run stopped; the shipped checkpoint loads."""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.checkpoint import load_checkpoint
from jaxspec.core.config import ModelConfig
from jaxspec.model import network as model_lib
from jaxspec.training import packing
from jaxspec.training import train as train_lib

SEQ = 40  # crosses the test preset's window 8, CSA 4 and HCA 16 blocks


class _Counting:
    """Rows of counting sequences mod V (easy to learn, so the loss must fall fast)."""

    def __init__(self, vocab: int, seq_len: int):
        self.vocab, self.seq_len = vocab, seq_len

    def batch(self, step: int, batch: int) -> np.ndarray:
        rng = np.random.default_rng([7, step])
        start = rng.integers(0, self.vocab, (batch, 1))
        return ((start + np.arange(self.seq_len + 2)[None]) % self.vocab).astype(np.int32)


@pytest.fixture(scope="session")
def cfg():
    # The `test` preset cut to two layers (CSA + indexer, HCA; the MTP block is the sliding layer) to keep
    # the compile short; every mechanism stays on.
    return ModelConfig.preset("test", num_layers=2, layer_types=("csa", "hca"))


def test_train_resume_and_export(cfg, tmp_path):
    # weight_decay 0: a leaf moves only if it got a gradient.
    opt = train_lib.OptConfig(lr=3e-3, warmup_steps=1, steps=3, min_lr_ratio=1.0, weight_decay=0.0)
    init = jax.tree.leaves(train_lib.init_train_state(cfg, opt, jax.random.key(0)).params)
    sampler = _Counting(cfg.vocab_size, SEQ)
    eval_rows = {"count": sampler.batch(999, 2)}
    run, out = str(tmp_path / "run"), str(tmp_path / "ckpt")
    kw = dict(batch=2, run_dir=run, out=out, eval_every=2, save_every=100, log=lambda s: None, ship_dtype="float32")
    ts, hist = train_lib.train_loop(cfg, opt, sampler, eval_rows, **kw)
    train_losses = [r["train_loss"] for r in hist if r.get("train_loss") is not None]
    assert len(train_losses) == 3 and all(np.isfinite(train_losses))
    assert train_losses[-1] < train_losses[0]
    assert int(ts.step) == 3
    moved = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(init, jax.tree.leaves(ts.params),
                                                                              strict=True)
             if jnp.issubdtype(a.dtype, jnp.floating)]
    # Everything but the indexer (its top-k selection is not differentiable) learns; nothing is NaN.
    assert np.mean(moved) > 0.8
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(ts.params) if jnp.issubdtype(x.dtype,
                                                                                                     jnp.floating))

    # Resume to 5 steps == an uninterrupted 5-step run.
    opt5 = dataclasses.replace(opt, steps=5)
    ts5, hist5 = train_lib.train_loop(cfg, opt5, sampler, eval_rows, resume=True, **kw)
    assert int(ts5.step) == 5 and [r["step"] for r in hist5 if "train_loss" in r] == [1, 2, 3, 4, 5]
    ref, _ = train_lib.train_loop(cfg, opt5, sampler, eval_rows, **{**kw, "run_dir": str(tmp_path / "r2"),
                                                                     "out": None})
    for a, b in zip(jax.tree.leaves(ts5.params), jax.tree.leaves(ref.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    lcfg, params, tok = load_checkpoint(out)
    assert lcfg == cfg and tok is None
    assert (tmp_path / "ckpt" / "loss.csv").is_file() and (tmp_path / "ckpt" / "training.json").is_file()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "ckpt" / "loss.png").is_file()
    logits = model_lib.one_shot_logits(params, lcfg, jnp.asarray(sampler.batch(5, 1)[:, :SEQ]))
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_ship_bf16_and_validation(cfg):
    params = model_lib.init_params(cfg, jax.random.key(0))
    scfg, sp = train_lib.ship_params(cfg, params, "bfloat16")
    assert scfg.dtype == "bfloat16" and sp.embed.dtype == jnp.bfloat16
    assert train_lib.param_bytes(sp) < train_lib.param_bytes(params)
    with pytest.raises(ValueError, match="dtype must be one of"):
        train_lib.ship_params(cfg, params, "float16")
    with pytest.raises(ValueError, match="lr must be > 0"):
        train_lib.OptConfig(lr=0.0)
    with pytest.raises(ValueError, match="seq_len"):
        packing.PackedSampler({"a": [[1, 2]]}, {"a": 1.0}, seq_len=1)


def test_schedule_and_unigram():
    opt = train_lib.OptConfig(lr=1.0, warmup_steps=10, steps=100, min_lr_ratio=0.1)
    assert train_lib.learning_rate(opt, 0) == pytest.approx(0.1)
    assert train_lib.learning_rate(opt, 10, 0.0) == pytest.approx(1.0)
    assert train_lib.learning_rate(opt, 50, 1.0) == pytest.approx(0.1)
    rows = np.zeros((4, 10), np.int64)
    rows[:, ::2] = 1
    u = packing.unigram_loss(rows, rows, vocab_size=4)
    assert 0.5 < u < 1.0  # about ln 2 for a 50/50 two-token stream


def test_packed_sampler_deterministic():
    docs = {"a": [[0, 5, 6, 1], [0, 7, 1]], "b": [[0, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 1]]}
    s = packing.PackedSampler(docs, {"a": 0.5, "b": 0.5}, seq_len=6, seed=3)
    x = s.batch(4, 3)
    assert x.shape == (3, 8)
    np.testing.assert_array_equal(x, s.batch(4, 3))


def test_unlikelihood_candidates_stay_inside_each_document():
    bos = 0
    tokens = jnp.asarray([[0, 5, 6, 5, 0, 7, 5]])  # two packed documents
    seen = np.asarray(train_lib.seen_in_document(tokens, 8, bos))  # [1, 7, 8]
    # position 3 (second 5) has seen BOS, 5, 6 of its document
    assert sorted(np.flatnonzero(seen[0, 3])) == [0, 5, 6]
    # position 5 (7) is in the second document: 6 and the first document's 5 are forgotten
    assert sorted(np.flatnonzero(seen[0, 5])) == [0, 7]
    assert sorted(np.flatnonzero(seen[0, 6])) == [0, 5, 7]

    # the loss sums -log(1 - p) over seen tokens except the target, and is 0 when only the target was seen
    logits = jnp.log(jnp.asarray([[[0.5, 0.25, 0.25]]]))
    only_target = jnp.asarray([[[False, True, False]]])
    assert float(train_lib.unlikelihood_loss(logits, jnp.asarray([[1]]), only_target)) == 0.0
    both = jnp.asarray([[[True, True, False]]])
    got = float(train_lib.unlikelihood_loss(logits, jnp.asarray([[1]]), both))
    np.testing.assert_allclose(got, -np.log(0.5), rtol=1e-6)


def test_unlikelihood_weight_adds_to_the_loss(cfg):
    # Jitted: op by op, the two forwards took half a minute.
    params = jax.jit(model_lib.init_params, static_argnums=0)(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 18), 2, cfg.vocab_size)
    loss_fn = jax.jit(train_lib.loss_fn, static_argnums=1, static_argnames="unlikelihood_weight")
    plain, aux = loss_fn(params, cfg, tokens, 0.5)
    with_ul, aux_ul = loss_fn(params, cfg, tokens, 0.5, unlikelihood_weight=1.0)
    assert "main_ul" not in aux and aux_ul["main_ul"] > 0 and aux_ul["mtp_ul"] > 0
    np.testing.assert_allclose(float(with_ul), float(plain + aux_ul["main_ul"] + 0.5 * aux_ul["mtp_ul"]), rtol=1e-5)
    with pytest.raises(ValueError, match="unlikelihood_weight"):
        train_lib.OptConfig(unlikelihood_weight=-1.0)
