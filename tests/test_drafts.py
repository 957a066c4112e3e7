"""Drafts beside a checkpoint (`checkpoint/drafts.py`): `load_checkpoint(path, draft=NAME)` swaps in
drafts/NAME/ (MTP parameters only) with its own calibration.json / tune.json; the default stays the
checkpoint's own draft; a bad name is a one-line error listing what exists. Greedy speculation with
a loaded draft is `generate`; with the shipped one-step draft (long tier) greedy identity and the
chi-square harness of test_sampling.py hold on the real checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling import assert_samples_the_target, check_end_to_end

import jaxspec as js
from jaxspec.checkpoint import drafts
from jaxspec.checkpoint.drafts import DEFAULT_DRAFT, draft_dir, draft_names, save_draft
from jaxspec.core.config import ModelConfig
from jaxspec.model.network import init_params
from jaxspec.speculation.values import CONFIDENCE_EDGES, Calibration, ValueMap, calibration_file, draft_fingerprint

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-v4"


def _random(tree, seed, experts):
    """A tree of `tree`'s structure with random float leaves (numpy, no eager init)."""
    rng = np.random.default_rng(seed)

    def leaf(x):
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray((0.05 * rng.standard_normal(x.shape)).astype(np.float32).astype(x.dtype))
        ids = np.argsort(rng.random((x.shape[0], experts)), axis=-1)[:, : x.shape[1]]  # hash tables
        return jnp.asarray(ids, x.dtype)

    return jax.tree.map(leaf, tree)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A test-preset checkpoint with one extra draft "other": -> (folder, cfg, params, other mtp)."""
    cfg = ModelConfig.preset("test")
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    params = _random(abstract, 0, cfg.n_routed_experts)
    other = _random(abstract.mtp, 1, cfg.n_routed_experts)
    folder = tmp_path_factory.mktemp("drafts") / "ckpt"
    js.save_checkpoint(folder, cfg, params)
    save_draft(folder, "other", cfg, other, {"recipe": "test"})
    return folder, cfg, params, other


def _leaves_equal(a, b):
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_default_draft_is_the_checkpoints_own(saved):
    folder, _, params, other = saved
    assert draft_names(folder) == [DEFAULT_DRAFT, "other"]
    _, loaded, _ = js.load_checkpoint(folder)
    assert _leaves_equal(loaded, params)
    _, same, _ = js.load_checkpoint(folder, draft=DEFAULT_DRAFT)
    assert _leaves_equal(same, params)


def test_named_draft_swaps_the_mtp_block_only(saved):
    folder, cfg, params, other = saved
    _, loaded, _ = js.load_checkpoint(folder, draft="other")
    assert _leaves_equal(loaded.mtp, other)
    assert _leaves_equal(loaded.replace(mtp=None), params.replace(mtp=None))  # the target is the checkpoint's
    assert draft_fingerprint(loaded.mtp, cfg) != draft_fingerprint(params.mtp, cfg)
    info = json.loads((Path(folder) / "drafts" / "other" / drafts.INFO).read_text())
    assert info == {"recipe": "test"}
    # only MTP parameters were written: no target arrays in the draft folder
    assert not (Path(folder) / "drafts" / "other" / "params").exists()


def test_bad_draft_names_are_one_line_errors(saved, tmp_path):
    folder = saved[0]
    with pytest.raises(ValueError, match=r"has no draft 'one-stp'; drafts: default, other$") as e:
        js.load_checkpoint(folder, draft="one-stp")
    assert "\n" not in str(e.value)
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ValueError, match=r"drafts: default$"):
        draft_dir(plain, "other")
    with pytest.raises(ValueError, match="plain folder name"):
        save_draft(folder, DEFAULT_DRAFT, saved[1], saved[3])
    with pytest.raises(ValueError, match="do not match the mtp draft"):
        save_draft(folder, "broken", saved[1], saved[3].block)


def _calibration(fingerprint, value):
    cells = 7 * 4 * 13
    greedy = ValueMap("greedy", 0.0, (value,) * cells, (1,) * cells)
    return Calibration(fingerprint=fingerprint, greedy=greedy, sampling=())


def test_each_draft_carries_its_own_calibration(saved, tmp_path):
    folder, cfg, params, other = saved
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    own_fp = draft_fingerprint(params.mtp, cfg)
    other_fp = draft_fingerprint(other, cfg)
    _calibration(own_fp, 0.5).save(copy)
    _calibration(other_fp, 0.25).save(copy / "drafts" / "other")
    own = js.load_checkpoint(copy).draft
    assert own.name == DEFAULT_DRAFT and own.calibration.greedy.table[0] == 0.5
    swapped = js.load_checkpoint(copy, draft="other").draft
    assert swapped.name == "other" and swapped.calibration.greedy.table[0] == 0.25
    # the default draft's file beside another draft is refused (fitted for other params)
    _calibration(own_fp, 0.5).save(copy / "drafts" / "other")
    with pytest.raises(ValueError, match="fitted for another draft"):
        js.load_checkpoint(copy, draft="other")


def test_other_value_sources_calibrations_sit_beside_the_draft_ones(saved, tmp_path):
    """calibration_<source>.json (`jaxspec calibrate --values both` writes calibration_both.json) is read beside
    calibration.json; a spec ranking by that source takes it by default; a file holding another source's
    values than its name says is refused."""
    import shutil

    folder, cfg, params, _ = saved
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    fp = draft_fingerprint(params.mtp, cfg)
    cells = 7 * 4 * 13 * len(CONFIDENCE_EDGES + (1,))
    both = Calibration(fp, ValueMap("greedy", 0.0, (0.75,) * cells, (1,) * cells), (), feature="both")
    _calibration(fp, 0.5).save(copy)
    both.save(copy / calibration_file("both"))
    draft = js.load_checkpoint(copy).draft
    assert draft.calibration.feature == "draft" and draft.calibration.greedy.table[0] == 0.5
    assert draft.calibration_for("both") == both and draft.calibration_for("confidence") is None
    _calibration(fp, 0.5).save(copy / calibration_file("both"))
    with pytest.raises(ValueError, match="calibration_both.json holds a calibration of the 'draft' values"):
        js.load_checkpoint(copy)


def test_greedy_speculation_with_a_loaded_draft_is_generate(saved):
    folder, cfg, _, _ = saved
    _, params, _ = js.load_checkpoint(folder, draft="other")
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5]]
    out = js.speculative_generate(params, cfg, prompts, "s2_k2_d4", max_new_tokens=8)
    ref = js.generate(params, cfg, prompts, max_new_tokens=8)
    np.testing.assert_array_equal(out.tokens, ref.tokens)


def test_calibrate_cli_rejects_an_unknown_draft(saved):
    from jaxspec.cli import main

    with pytest.raises(SystemExit, match="has no draft 'nope'; drafts: default, other"):
        main(["calibrate", "--checkpoint", str(saved[0]), "--draft", "nope"])


# ---- the shipped one-step draft (long tier: the real checkpoint) --------------------------------


def _shipped_one_step():
    if not (SHIPPED / "drafts" / "one-step" / drafts.MTP).is_dir():
        pytest.skip("no shipped one-step draft")
    return js.load_checkpoint(SHIPPED, draft="one-step", dtype="float32")


def test_shipped_one_step_draft_loads_with_its_calibration():
    if not (SHIPPED / "drafts" / "one-step" / "calibration.json").is_file():
        pytest.skip("no shipped one-step draft")
    ckpt = _shipped_one_step()
    own = js.load_checkpoint(SHIPPED).draft
    assert draft_fingerprint(ckpt.draft.params, ckpt.cfg) != draft_fingerprint(own.params, ckpt.cfg)
    assert dict(ckpt.draft.calibration.meta).get("draft") == "one-step"


@pytest.mark.long
@pytest.mark.parametrize("spec", ["s7_k1_d8", "s7_k2_d8", "s4_k4_d8", "s15_k2_d16"])
def test_shipped_one_step_draft_greedy_is_generate(spec):
    from jaxspec.harness.eval import encode_prompts
    from jaxspec.training.data import HELDOUT_SPLITS, data_available, load_dataset

    if not data_available():
        pytest.skip("no data")
    ckpt = _shipped_one_step()
    cfg, params, tok = ckpt
    prompts = []
    for name in ("gsm8k", "mbpp", "sharegpt"):
        prompts += encode_prompts(tok, load_dataset(name, HELDOUT_SPLITS[name])[:2], 192)
    out = js.speculative_generate(params, cfg, prompts, spec, max_new_tokens=96, draft=ckpt.draft)
    ref = js.generate(params, cfg, prompts, max_new_tokens=96)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    assert out.stats["scores"] == "calibrated"


@pytest.mark.long
@pytest.mark.parametrize("spec,setting,rule", [("s3_k2_d6", "t1", "residual"), ("s3_k1_d4", "t0.5", "residual")])
def test_shipped_one_step_draft_samples_the_target(spec, setting, rule):
    ckpt = _shipped_one_step()
    # 4,096 rows (one chunk), not the test model's 12,288: a chunk of the 6-layer checkpoint takes 3-5 minutes
    # of a core (8,192 rows of a K = 4 tree took 11). The rules' grid, K = 4 and top-p included, has the power
    # on the test model (test_rsd.py); this case checks the trained checkpoint and its calibration.
    result = check_end_to_end(ckpt.params, ckpt.cfg, spec, setting, n=4096, accept=rule,
                              calibration=ckpt.draft.calibration)
    assert_samples_the_target(result)
    assert result["tau"] > 1.2, result


def test_draft_dir_of_the_default_is_the_checkpoint(tmp_path):
    assert draft_dir(tmp_path, None) == os.fspath(tmp_path)
    assert draft_dir(tmp_path, DEFAULT_DRAFT) == os.fspath(tmp_path)
