"""DSpark training sees what inference sees: the batched training blocks (a window of the target's
captured rows committed into a fresh state, the block pass, the teacher-forced Markov head) equal the
drafter's own path (prefill with capture -> commit_context -> block_logits + markov) at every anchor;
a few steps lower the loss and train the drafter only; a stopped run resumes where it stopped."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.core.dspark import DSparkConfig
from jaxspec.model import dspark as ds
from jaxspec.model.network import extend
from jaxspec.model.state import init_state
from jaxspec.testing import randomize
from jaxspec.training import dspark as train
from jaxspec.training import dspark_anchors

DCFG = DSparkConfig(block_size=4, noise_token_id=2, target_layers=(0, 1), markov_rank=8, num_stages=1)


@pytest.fixture(scope="module")
def small():
    # The `test` preset cut to two layers (window 8); captured rows of both.
    cfg = js.ModelConfig.preset("test", num_layers=2, layer_types=("sliding", "csa"))
    key = jax.random.key(0)
    target = jax.jit(lambda k: randomize(js.init_params(cfg, k), jax.random.fold_in(k, 1)))(key)
    draft = jax.jit(lambda k: randomize(ds.init_dspark_params(cfg, DCFG, k), jax.random.fold_in(k, 2), 0.1))(
        jax.random.fold_in(key, 3))
    return cfg, target, draft


def _cache(cfg, target, seqs, prompts):
    return train.build_cache(target, cfg, DCFG, seqs, prompts, batch=2)


def test_training_blocks_equal_the_inference_forward(small):
    cfg, target, draft = small
    rng = np.random.default_rng(0)
    seq = rng.integers(3, cfg.vocab_size, 30).astype(np.int32)
    cache = _cache(cfg, target, [seq], [1])
    g = DCFG.block_size
    anchors = np.array([1, 5, 8, 9, 17, 25])  # before the window is full, at it and past it
    host = cache.blocks(cache.anchors[anchors - 1], cfg.sliding_window, g)
    assert host["anchor_pos"].tolist() == anchors.tolist()
    logits, conf = jax.jit(train.block_forward, static_argnums=(2, 3))(
        draft, target, cfg, DCFG, jnp.asarray(host["window"]), jnp.asarray(host["anchor_pos"]),
        jnp.asarray(host["tokens"][:, :g]))

    @jax.jit
    def inference(tokens, length, anchor, prevs):
        state = init_state(cfg, 1, 32)
        out, _ = extend(target, cfg, state, tokens, jnp.arange(32)[None] < length, capture=DCFG.target_layers)
        dstate = ds.commit_context(draft, cfg, DCFG, ds.init_dspark_state(cfg, DCFG, 1), out.captured,
                                   jnp.arange(32, dtype=jnp.int32)[None], jnp.arange(32)[None] < length)
        base, hh = ds.block_logits(draft, target, cfg, DCFG, dstate, anchor)
        e, bias = ds.markov(draft, prevs)
        return base + bias, ds.confidence_logits(draft, hh, e)

    for i, a in enumerate(anchors):
        prompt = np.zeros((1, 32), np.int32)
        prompt[0, :a] = seq[:a]  # x_0 .. x_{a-1} committed, x_a the anchor
        want, want_conf = inference(jnp.asarray(prompt), jnp.int32(a), jnp.asarray(seq[None, a]),
                                    jnp.asarray(seq[None, a : a + g]))
        np.testing.assert_allclose(np.asarray(logits[i]), np.asarray(want[0]), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(conf[i]), np.asarray(want_conf[0]), rtol=2e-5, atol=2e-5)
    # the greedy chain of the drafter, where its drafts follow the sequence, is the teacher-forced argmax
    chain = jax.jit(ds.draft_chain, static_argnums=(2, 3))
    a = 17
    state = init_state(cfg, 1, 32)
    prompt = np.zeros((1, 32), np.int32)
    prompt[0, :a] = seq[:a]
    out, _ = extend(target, cfg, state, jnp.asarray(prompt), jnp.arange(32)[None] < a, capture=DCFG.target_layers)
    dstate = ds.commit_context(draft, cfg, DCFG, ds.init_dspark_state(cfg, DCFG, 1), out.captured,
                               jnp.arange(32, dtype=jnp.int32)[None], jnp.arange(32)[None] < a)
    drafted = chain(draft, target, cfg, DCFG, dstate, jnp.asarray(seq[None, a]))
    teacher_forced = np.argmax(np.asarray(logits[anchors.tolist().index(a)]), -1)
    assert drafted.tokens[0, 0] == teacher_forced[0]


def test_cache_rows_and_labels(small):
    cfg, target, _ = small
    seqs = [np.arange(3, 23, dtype=np.int32), np.arange(30, 42, dtype=np.int32)]
    cache = _cache(cfg, target, seqs, [12, 4])
    # anchors: response positions P..L-2 of each sequence
    assert sorted(cache.positions[cache.anchors][cache.seq[cache.anchors] == 0].tolist()) == list(range(12, 19))
    assert sorted(cache.positions[cache.anchors][cache.seq[cache.anchors] == 1].tolist()) == list(range(4, 11))
    host = cache.blocks(cache.anchors, cfg.sliding_window, DCFG.block_size)
    last = np.flatnonzero((host["anchor_pos"] == 18) & (host["tokens"][:, 0] == 21))[0]
    assert host["valid"][last].tolist() == [True, False, False, False]  # supervision stops at the end
    assert host["tokens"][last, :2].tolist() == [21, 22]
    # the window holds positions a-W..a-1 (zeros before position 0)
    first = np.flatnonzero(host["anchor_pos"] == 4)[0]
    assert not host["window"][first, :4].any() and host["window"][first, 4:].any()
    # the rows are the target's own
    cap, _ = train.target_rows(target, cfg, DCFG.target_layers, jnp.asarray(seqs[0][None]))
    np.testing.assert_allclose(host["window"][0][-1], np.asarray(cap[0, host["anchor_pos"][0] - 1]),
                               rtol=1e-5, atol=1e-6)  # one row of two programs: float32 rounding


def test_steps_lower_the_loss_and_resume(small, tmp_path):
    cfg, target, _ = small
    rng = np.random.default_rng(1)
    seqs = [rng.integers(3, cfg.vocab_size, 24).astype(np.int32) for _ in range(4)]
    cache = _cache(cfg, target, seqs, [6] * 4)
    tc = train.DSparkTrainConfig(steps=6, warmup_steps=0, lr=3e-3, blocks=16)
    exported = []
    logs = []
    _, hist = train.train_loop(target, cfg, DCFG, tc, cache, cache, run_dir=str(tmp_path), eval_every=3,
                               export=lambda p, r: exported.append((p, r)), log=logs.append, resume=False)
    evals = [h["heldout"] for h in hist if "heldout" in h]
    assert len(evals) == 3 and evals[-1]["loss"] < evals[0]["loss"]
    assert exported[-1][1]["final"] and exported[-1][1]["step"] == 6
    fresh = ds.init_dspark_params(cfg, DCFG, jax.random.key(0))
    assert jax.tree.structure(exported[-1][0]) == jax.tree.structure(fresh)
    assert 0 <= evals[-1]["accept1"] <= 1 and evals[-1]["tau5"] >= 1
    # a longer schedule resumes from the saved step 6 and draws the same blocks a straight run would
    tc9 = dataclasses.replace(tc, steps=9)
    ts, hist2 = train.train_loop(target, cfg, DCFG, tc9, cache, cache, run_dir=str(tmp_path), eval_every=3,
                                 log=logs.append)
    assert any(line.startswith("resumed at step 6") for line in logs) and int(ts.step) == 9
    assert [h["step"] for h in hist2 if "train_loss" in h] == list(range(1, 10))


def test_greedy_confidence_goal_and_sibling_metric(small):
    """`confidence_target="greedy"` trains the confidence head on whether the block's argmax is the label
    (what a greedy verify accepts); `sibling{k}` is the runner-up's hit rate where the argmax missed.
    Both recomputed here from the training forward's own logits."""
    cfg, target, draft = small
    rng = np.random.default_rng(2)
    seqs = [rng.integers(3, cfg.vocab_size, 28).astype(np.int32) for _ in range(3)]
    cache = _cache(cfg, target, seqs, [5] * 3)
    host = cache.blocks(cache.anchors, cfg.sliding_window, DCFG.block_size)
    blocks = train.to_blocks(host)
    g = DCFG.block_size
    logits, conf = train.block_forward(draft, target, cfg, DCFG, blocks.window, blocks.anchor_pos, blocks.tokens[:, :g])
    logits, conf = np.asarray(logits), np.asarray(conf)
    labels, valid = host["tokens"][:, 1:], host["valid"]
    order = np.argsort(-logits, axis=-1, kind="stable")
    match = (order[..., 0] == labels) & valid
    missed = valid & ~match
    w = np.exp(-np.arange(g) / 4.0)[None, :] * valid
    bce = np.logaddexp(0.0, conf) - match * conf  # sigmoid BCE with goal 1[argmax == label]
    greedy = train.LossWeights(confidence_target="greedy")
    _, m = jax.jit(train.dspark_loss, static_argnums=(2, 3, 5))(draft, target, cfg, DCFG, blocks, greedy)
    np.testing.assert_allclose(float(m["bce"]), np.sum(w * bce) / np.sum(w), rtol=1e-4)
    _, m_l1 = jax.jit(train.dspark_loss, static_argnums=(2, 3, 5))(draft, target, cfg, DCFG, blocks,
                                                                   train.LossWeights())
    assert abs(float(m_l1["bce"]) - float(m["bce"])) > 1e-3  # the goal is a different one
    assert missed.sum() > 0
    for k in range(g):
        want = ((order[:, k, 1] == labels[:, k]) & missed[:, k]).sum() / max(missed[:, k].sum(), 1)
        assert float(m[f"sibling{k + 1}"]) == pytest.approx(want, abs=1e-6)
        assert float(m[f"match{k + 1}"]) == pytest.approx(match[:, k].sum() / valid[:, k].sum(), abs=1e-6)
    with pytest.raises(ValueError, match="confidence_target"):
        train.DSparkTrainConfig(confidence_target="soft")


def test_decoding_anchors_are_where_a_greedy_chain_starts_its_cycles(small):
    """A sequence written cycle by cycle from the drafter's own greedy chain (the inference path:
    prefill with capture, commit_context, draft_chain): each cycle keeps a chosen number of its drafts,
    then a token the draft did not propose, as a greedy verify would commit. `decoding_anchors` must
    find exactly those cycle starts, for every acceptance from none to the whole chain."""
    cfg, target, draft = small
    g, depth, p = DCFG.block_size, 4, 3  # a chain of depth 4: 3 drafts a cycle
    seq = list(np.random.default_rng(3).integers(3, cfg.vocab_size, p + 1))
    keeps = [2, 0, 3, 1, 3, 0, 2]
    chain = jax.jit(ds.draft_chain, static_argnums=(2, 3))

    @jax.jit
    def state_at(tokens, length):
        out, _ = extend(target, cfg, init_state(cfg, 1, 32), tokens, jnp.arange(32)[None] < length,
                        capture=DCFG.target_layers)
        return ds.commit_context(draft, cfg, DCFG, ds.init_dspark_state(cfg, DCFG, 1), out.captured,
                                 jnp.arange(32, dtype=jnp.int32)[None], jnp.arange(32)[None] < length)

    want = []
    for keep in keeps:
        a = len(seq) - 1  # the anchor: the last committed token
        want.append(a)
        tokens = np.zeros((1, 32), np.int32)
        tokens[0, :a] = seq[:a]
        drafted = np.asarray(chain(draft, target, cfg, DCFG, state_at(jnp.asarray(tokens), jnp.int32(a)),
                                   jnp.asarray([seq[a]], jnp.int32)).tokens[0])
        seq += list(drafted[:keep])
        seq.append(3 + (drafted[keep] - 2) % (cfg.vocab_size - 3) if keep < depth - 1 else 5)  # not the draft
    assert len(seq) <= 32
    cache = _cache(cfg, target, [np.asarray(seq, np.int32)], [p])
    rows = dspark_anchors.decoding_anchors(draft, target, cfg, DCFG, cache, depth, batch=4)
    assert cache.positions[rows].tolist() == want
    # a chain as deep as the block runs further from the same start: fewer cycles
    assert len(dspark_anchors.decoding_anchors(draft, target, cfg, DCFG, cache, g, batch=4)) <= len(rows)
    with pytest.raises(ValueError, match="depth"):
        dspark_anchors.decoding_anchors(draft, target, cfg, DCFG, cache, g + 1)
    # sampling them: share 1 is those rows only, a share below 1 mixes them into the uniform anchors
    only = dspark_anchors.with_anchors(cache, rows, 1.0)
    assert sorted(set(train.sample_anchors(only, 0, 64, 0).tolist())) <= sorted(rows.tolist())
    mixed = dspark_anchors.with_anchors(cache, rows, 0.5)
    drawn = train.sample_anchors(mixed, 0, 4000, 0)
    assert 0.45 < np.isin(drawn, rows).mean() < 0.75  # ~0.5 by construction, plus uniform draws that land on them
    with pytest.raises(ValueError, match="share"):
        dspark_anchors.with_anchors(cache, rows, 0.0)


def test_training_continues_from_given_params(small, tmp_path):
    """init=DSparkParams fine-tunes those parameters: the step-0 held-out metrics are theirs."""
    cfg, target, draft = small
    rng = np.random.default_rng(4)
    seqs = [rng.integers(3, cfg.vocab_size, 24).astype(np.int32) for _ in range(2)]
    cache = _cache(cfg, target, seqs, [6] * 2)
    tc = train.DSparkTrainConfig(steps=1, warmup_steps=0, blocks=8)
    _, hist = train.train_loop(target, cfg, DCFG, tc, cache, cache, run_dir=str(tmp_path), init=draft,
                               eval_every=5, log=lambda _: None, resume=False)
    want = train.evaluate(draft, target, cfg, DCFG, cache, tc)
    assert hist[0]["heldout"]["loss"] == pytest.approx(want["loss"], rel=1e-5)
    with pytest.raises(ValueError, match="init"):
        train.train_loop(target, cfg, DCFG, tc, cache, cache, run_dir=str(tmp_path), init="dspark")


def _shipped_dspark():
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tiny-v4")
    ck = js.load_checkpoint(path, draft="dspark", dtype="float32")
    assert ck.draft.drafter.config.block_size >= 7  # a chain reaches D = 8
    return ck


def test_shipped_dspark_draft_loads():
    from jaxspec.speculation.values import Calibration

    ck = _shipped_dspark()
    assert ck.draft.name == "dspark" and isinstance(ck.draft.calibration, Calibration)
    assert ck.draft.calibration.feature == "draft"  # calibration.json: what sS_kK_dD trees rank by
    both = ck.draft.calibration_for("both")  # calibration_both.json: what the `_vb` trees rank by
    assert isinstance(both, Calibration) and both.feature == "both" and dict(both.meta)["draft"] == "dspark"


def test_shipped_regime_draft_loads_at_the_releases_sizes():
    """drafts/dspark-regime (docs/dspark.md, "In DeepSeek's regime"): block 5 and Markov rank 256 as
    released, its own calibrations (both value sources), and draft.json saying why."""
    import json
    import os

    from jaxspec.speculation.values import Calibration

    path = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tiny-v4")
    ck = js.load_checkpoint(path, draft="dspark-regime", dtype="float32")
    dcfg = ck.draft.drafter.config
    assert (dcfg.block_size, dcfg.markov_rank, dcfg.num_stages) == (5, 256, 1)
    assert ck.draft.name == "dspark-regime" and isinstance(ck.draft.calibration, Calibration)
    both = ck.draft.calibration_for("both")
    assert both.feature == "both" and dict(both.meta)["draft"] == "dspark-regime"
    info = json.load(open(os.path.join(path, "drafts", "dspark-regime", "draft.json")))
    assert info["final"] and info["step"] == 350 and "V4-Flash-0731" in info["why"]["draft"]


@pytest.mark.long  # ~45 s; CI: the load above and DSpark trees == generate on the test model
def test_shipped_regime_draft_tree_is_generate():
    import os

    from jaxspec.training.tokenizer import encode

    path = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tiny-v4")
    ck = js.load_checkpoint(path, draft="dspark-regime", dtype="float32")
    prompt = [encode(ck.tokenizer, "Question: Tom has 3 apples and buys 5 more. How many apples?\nAnswer:")]
    want = js.generate(ck.params, ck.cfg, prompt, max_new_tokens=16)
    out = js.speculative_generate(ck.params, ck.cfg, prompt, "s5_k3_d8_vb", max_new_tokens=16, draft=ck.draft)
    assert out.tokens[0, : int(out.lengths[0])].tolist() == want.tokens[0, : int(want.lengths[0])].tolist()
    assert out.stats["cycles"] < 16


@pytest.mark.long  # ~45 s (the 6-layer checkpoint's loop compiles); CI: the load above, DSpark chains and trees
# greedy == generate on the test model and on a release folder (test_dspark_speculation.py)
def test_shipped_dspark_draft_loads_and_its_greedy_chain_is_generate():
    ck = _shipped_dspark()
    from jaxspec.training.tokenizer import encode

    prompt = [encode(ck.tokenizer, "Question: Tom has 3 apples and buys 5 more. How many apples?\nAnswer:")]
    want = js.generate(ck.params, ck.cfg, prompt, max_new_tokens=16)
    out = js.speculative_generate(ck.params, ck.cfg, prompt, "s7_k1_d8", max_new_tokens=16, draft=ck.draft)
    assert out.tokens[0, : int(out.lengths[0])].tolist() == want.tokens[0, : int(want.lengths[0])].tolist()
    assert out.stats["cycles"] < 16  # it drafts tokens the target accepts


@pytest.mark.long  # ~85 s; CI: the training blocks == the inference forward, training continued from given params
def test_train_dspark_command_trains_resumes_and_fine_tunes(small, tmp_path, capsys):
    """`jaxspec train-dspark` end to end on a saved checkpoint: it ships a drafter whose greedy chain is
    `generate`'s output, a rerun with more steps resumes from the kept rows and states, and `--init` /
    `--decoding-anchors` fine-tune the shipped drafter where its chain starts its cycles."""
    import json

    from jaxspec.checkpoint import load_checkpoint, save_checkpoint
    from jaxspec.cli import main
    from jaxspec.training import distill

    cfg, target, _ = small
    ckpt, data = tmp_path / "ckpt", tmp_path / "data"
    save_checkpoint(ckpt, cfg, target)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg.vocab_size, 6).tolist() for _ in range(8)]
    distill.generate_data(target, cfg, prompts, data, max_new_tokens=18, chunk_size=4, temperatures=(0.0,))
    sizes = ["--block-size", "4", "--markov-rank", "8", "--target-layers", "0,1"]
    common = ["--checkpoint", str(ckpt), "--data", str(data), "--blocks", "8", "--eval-every", "2",
              "--eval-blocks", "8", "--cache-batch", "4", "--eval-fraction", "0.25", "--warmup", "0"]
    run = ["train-dspark", *common, *sizes, "--run-dir", str(tmp_path / "run")]
    assert main([*run, "--steps", "2", "--why", "sized for a test"]) == 0
    info = json.loads((ckpt / "drafts" / "dspark" / "draft.json").read_text())
    assert info["final"] and info["step"] == 2 and info["why"]["draft"] == "sized for a test"
    # the sizes set here carry the command's reason, not the default sizes' reasons
    assert info["why"]["block_size"] == "4: set for this draft (sized for a test)"
    assert info["why"]["markov_rank"].startswith("8: ") and info["why"]["num_stages"].startswith("1: each stage")
    assert main([*run, "--steps", "3"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "target rows from" in out and "resumed at step 2" in out
    shipped = load_checkpoint(ckpt, draft="dspark", dtype="float32")
    assert shipped.draft.drafter.config.block_size == 4 and shipped.draft.drafter.config.target_layers == (0, 1)
    want = js.generate(target, cfg, prompts[:2], max_new_tokens=10)
    got = js.speculative_generate(shipped.params, shipped.cfg, prompts[:2], "s3_k1_d4", max_new_tokens=10,
                                  draft=shipped.draft)
    np.testing.assert_array_equal(got.tokens, want.tokens)

    tune = ["train-dspark", *common, "--run-dir", str(tmp_path / "ft"), "--draft-name", "ft", "--steps", "1",
            "--init", "dspark", "--decoding-anchors", "dspark", "--decoding-depth", "4"]
    assert main(tune) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "draft 'dspark'" in out  # the target and the drafter to fine-tune came in one load
    assert "decoding anchors of dspark" in out
    ft = load_checkpoint(ckpt, draft="ft", dtype="float32").draft
    assert ft.drafter.config == shipped.draft.drafter.config  # --init keeps the drafter's sizes
    with pytest.raises(SystemExit) as e:
        main([*tune, "--init", "nope"])
    assert "--init 'nope': not target / random nor a draft of" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        main([*tune, "--checkpoint", str(tmp_path / "missing")])
    assert "checkpoint folder" in str(e.value.code) and "does not exist" in str(e.value.code)
