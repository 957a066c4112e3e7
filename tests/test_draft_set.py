"""Every draft of a checkpoint at once (`load_checkpoint(path, draft="all")` -> a `DraftSet`): spec="auto"
chooses the draft as well as the spec from the tuning across drafts (`jaxspec tune --draft all`,
drafts/tune.json), a spec can name its draft ("dspark/s4_k1_d5"), and greedy output stays `generate`'s."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import jaxspec as js
from jaxspec.checkpoint import drafts
from jaxspec.checkpoint.drafts import save_draft
from jaxspec.cli.speed import choose_spec
from jaxspec.core.dspark import DSparkConfig
from jaxspec.harness.tune import tune
from jaxspec.speculation.auto import NO_SPECULATION, Tuning, split_choice
from jaxspec.speculation.drafter import Draft, DraftSet
from jaxspec.speculation.dspark import dspark_draft
from jaxspec.speculation.mtp import MTPDrafter
from jaxspec.testing import agreeing_dspark, randomize

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(40, 50)), [7, 7, 7]]
CHOICES = {1: "dspark/s4_k1_d5", 4: "default/s3_k2_d6", 16: NO_SPECULATION}


@pytest.fixture(scope="module")
def dcfg(test_cfg):
    return DSparkConfig(block_size=5, noise_token_id=test_cfg.vocab_size - 1, target_layers=(1, 2, 3),
                        markov_rank=test_cfg.hidden_size, num_stages=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, agreeing_params, test_cfg, dcfg):
    """The agreeing test model with three drafts: its own MTP block, "other" (a random MTP block) and
    "dspark" (an agreeing DSpark drafter), and a tuning across them in drafts/tune.json."""
    folder = tmp_path_factory.mktemp("draft_set") / "ckpt"
    js.save_checkpoint(folder, test_cfg, agreeing_params)
    other = randomize(agreeing_params.mtp, jax.random.key(5))
    save_draft(folder, "other", test_cfg, other)
    save_draft(folder, "dspark", test_cfg, agreeing_dspark(agreeing_params, test_cfg, dcfg, jax.random.key(2)),
               config=dcfg)
    rows = ({"batch": 1, "spec": "dspark/s4_k1_d5", "ratio_vs_ar": 1.2}, {"batch": 1, "spec": "other/s2_k1_d3",
                                                                         "ratio_vs_ar": 0.9})
    Tuning(CHOICES, rows, 16).save(folder / drafts.DRAFTS)
    return folder


def _same(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_every_draft_loads_as_one_set_with_its_tuning(saved, agreeing_params):
    ckpt = js.load_checkpoint(saved, draft="all")
    assert isinstance(ckpt.draft, DraftSet) and ckpt.draft.names == ("default", "dspark", "other")
    assert _same(ckpt.params, agreeing_params)  # the target keeps its own MTP block
    for name in ("dspark", "other"):
        alone = js.load_checkpoint(saved, draft=name).draft
        assert _same(ckpt.draft[name].params, alone.params) and type(ckpt.draft[name].drafter) is type(alone.drafter)
    assert _same(ckpt.draft["default"].params, agreeing_params.mtp)
    assert ckpt.draft.tuning.choices == CHOICES and ckpt.draft.tuning.drafts == ("dspark", "other")
    with pytest.raises(ValueError, match=r"no draft 'nope' here; drafts: default, dspark, other"):
        ckpt.draft["nope"]
    with pytest.raises(ValueError, match="other than 'default' and 'all'"):
        save_draft(saved, "all", ckpt.cfg, agreeing_params.mtp)


def test_auto_over_a_draft_set_runs_the_chosen_draft_and_stays_exact(saved):
    ckpt = js.load_checkpoint(saved, draft="all")
    cfg, params, _ = ckpt
    for batch in (1, 4):  # the DSpark chain, then the default MTP draft's tree (16: AR, as test_tune runs it)
        prompts = (PROMPTS * 4)[:batch]
        ref = js.generate(params, cfg, prompts, max_new_tokens=16)
        out = js.speculative_generate(params, cfg, prompts, "auto", max_new_tokens=16, draft=ckpt.draft)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        name, spec = split_choice(CHOICES[batch])
        assert out.stats["spec"] == spec.name and out.stats["mean_accepted_length"] > 1.5
        alone = js.speculative_generate(params, cfg, prompts, spec, max_new_tokens=16, draft=ckpt.draft[name])
        accepted = [o.stats["per_sequence"]["accepted"] for o in (out, alone)]
        np.testing.assert_array_equal(*accepted)  # the chosen draft ran: its own run's acceptance, cycle for cycle
    with pytest.raises(ValueError, match=r"name the one to run in the spec \('other/s3_k2_d6'\)"):
        js.speculative_generate(params, cfg, PROMPTS, "s3_k2_d6", draft=ckpt.draft)
    with pytest.raises(ValueError, match="no draft 'mtp' here"):
        js.speculative_generate(params, cfg, PROMPTS, "mtp/s3_k2_d6", draft=ckpt.draft)
    with pytest.raises(ValueError, match="not among drafts"):  # a one-draft tuning cannot choose a draft
        js.speculative_generate(params, cfg, PROMPTS, "auto", draft=ckpt.draft, tuning=Tuning({4: "s3_k2_d6"}, (), 8))
    with pytest.raises(ValueError, match="jaxspec tune --draft all"):
        js.speculative_generate(params, cfg, PROMPTS, "auto", draft=DraftSet(ckpt.draft.drafts))


def test_cli_choice_over_a_draft_set(saved):
    found = js.load_checkpoint(saved, draft="all").draft
    choice = choose_spec("auto", found, 1)
    assert choice.spec.name == "s4_k1_d5" and choice.draft is found["dspark"] and "dspark/s4_k1_d5" in choice.how
    assert choice.tuned["spec"] == choice.best_tuned["spec"] == "dspark/s4_k1_d5"
    assert choose_spec("auto", found, 16).spec is None
    named = choose_spec("other/s2_k1_d3", found, 1)
    assert named.draft is found["other"] and named.spec.name == "s2_k1_d3"
    with pytest.raises(ValueError, match=r"--spec names the one to run \(other/s2_k1_d3\)"):
        choose_spec("s2_k1_d3", found, 1)
    with pytest.raises(ValueError, match="pass --draft all"):
        choose_spec("dspark/s2_k1_d3", found["dspark"], 1)
    with pytest.raises(ValueError, match="has no drafts/tune.json"):
        choose_spec("auto", DraftSet(found.drafts), 1)


def test_tune_across_drafts_times_each_draft_side_by_side(agreeing_params, test_cfg, dcfg, monkeypatch):
    """One bucket, tiny lengths: every draft runs every candidate it can grow (the DSpark block of 2 cannot
    grow a 3-step chain), in one process with AR; the choice names draft and spec."""
    from jaxspec.core import measure
    from jaxspec.harness.tune import _check

    monkeypatch.setattr(measure, "pinned_core", lambda: None)
    small = dataclasses.replace(dcfg, block_size=2)
    both = DraftSet((Draft("default", MTPDrafter(), agreeing_params.mtp),
                     dspark_draft(agreeing_dspark(agreeing_params, test_cfg, small, jax.random.key(2)), small)))
    methods, one_draft = _check(test_cfg, agreeing_params, both, (2,), ("s2_k1_d3", "s3_k1_d4"), 1)
    assert one_draft is None
    assert list(methods) == [NO_SPECULATION, "default/s2_k1_d3", "default/s3_k1_d4", "dspark/s2_k1_d3"]
    with pytest.raises(ValueError, match="no draft of"):
        _check(test_cfg, agreeing_params, DraftSet((both.drafts[1],)), (2,), ("s4_k1_d5",), 1)


@pytest.mark.long  # ~30 s; CI holds the methods above and the one-draft tune (test_tune.py)
def test_tune_across_drafts_measures_each_draft(agreeing_params, test_cfg, dcfg, monkeypatch):
    from jaxspec.core import measure

    monkeypatch.setattr(measure, "pinned_core", lambda: None)
    small = dataclasses.replace(dcfg, block_size=2)
    both = DraftSet((Draft("default", MTPDrafter(), agreeing_params.mtp),
                     dspark_draft(agreeing_dspark(agreeing_params, test_cfg, small, jax.random.key(2)), small)))
    tuning = tune(agreeing_params, test_cfg, {"a": PROMPTS[:2]}, batch_sizes=(2,), candidates=("s2_k1_d3",),
                  max_new_tokens=8, repeats=1, retries=0, allow_loaded=True, progress=False, draft=both)
    assert {m["spec"] for m in tuning.measurements} == {NO_SPECULATION, "default/s2_k1_d3", "dspark/s2_k1_d3"}
    assert all(m["tau"] > 1.0 for m in tuning.measurements if m["spec"] != NO_SPECULATION)
    assert tuning.drafts == ("default", "dspark")
    split_choice(tuning.choices[2])  # a name spec="auto" can run

