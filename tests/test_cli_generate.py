"""`jaxspec generate`: prompts from the command line, text files and JSON lines (prompts or chats),
batched, streamed as cycles commit them, one JSON line per prompt out. The `test` preset (no
tokenizer: prompts are token ids) for the format; the shipped checkpoint for one short streamed run."""

from __future__ import annotations

import argparse
import ast
import json
import os
from pathlib import Path

import pytest

from jaxspec.cli import generate as gen
from jaxspec.cli import main

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "checkpoints" / "tiny-v4"
# Shared by the tests below so the module compiles one AR and one speculative program (batch 2).
ARGV = ["generate", "--preset", "test", "--prompt", "5 17 3 9", "--prompt", "7 8 9 4", "--max-new-tokens", "6",
        "--batch-size", "2"]
RECORD_KEYS = {"index", "source", "prompt", "prompt_text", "prompt_tokens", "tokens", "text", "num_tokens", "finish",
               "spec", "spec_choice", "tau", "cycles", "temperature", "seed", "timings"}
TIMING_KEYS = {"wall_seconds", "compile_seconds", "generate_seconds", "programs", "cache_hits", "batch_tokens",
               "batch_tokens_per_s", "batch_tau", "streamed"}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_out_holds_tokens_text_tau_and_timings(tmp_path, capsys):
    """The speculative path; `--spec none` builds its records the same way from `generate`'s output
    (both loops' stats come from the one `summarize_stats`). One program compiled."""
    spec = "s2_k2_d4"
    out = tmp_path / "out.jsonl"
    assert main([*ARGV, "--spec", spec, "--out", str(out)]) == 0
    records = _records(out)
    assert [r["index"] for r in records] == [0, 1] and [r["prompt"] for r in records] == ["5 17 3 9", "7 8 9 4"]
    for r in records:
        assert set(r) == RECORD_KEYS and set(r["timings"]) == TIMING_KEYS
        assert len(r["tokens"]) == r["num_tokens"] <= 6 and r["text"] == " ".join(map(str, r["tokens"]))
        assert r["prompt_tokens"] == 4 and r["finish"] in ("eos", "length")
        assert r["timings"]["compile_seconds"] <= r["timings"]["wall_seconds"] and r["timings"]["streamed"]
    assert records[0]["spec"] == spec and all(r["tau"] >= 1.0 and r["cycles"] >= 1 for r in records)
    printed = capsys.readouterr().out
    # two rows stream as "[i] 'new text'" lines, as each step / cycle commits tokens
    streamed = {i: "".join(ast.literal_eval(line.split("] ", 1)[1]) for line in printed.splitlines()
                           if line.startswith(f"[{i}] ")) for i in (0, 1)}
    assert streamed == {0: records[0]["text"], 1: records[1]["text"]}
    assert "compile" in printed and "apart" in printed


def test_prompts_from_a_text_file_and_jsonl_in_order(tmp_path):
    (tmp_path / "p.txt").write_text("first prompt\n\n  second one  \n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "third"}\n\n{"messages": [{"role": "system", "content": "Be brief."},'
                                      ' {"role": "user", "content": " Hi? "}]}\n')
    args = argparse.Namespace(prompt=["zero"], prompt_file=str(tmp_path / "p.txt"), jsonl=str(tmp_path / "p.jsonl"))
    items = gen.read_prompts(args)
    assert [i.get("prompt") for i in items] == ["zero", "first prompt", "  second one  ", "third", None]
    assert [i["source"] for i in items][:3] == ["--prompt 1", f"{tmp_path / 'p.txt'}:1", f"{tmp_path / 'p.txt'}:3"]
    assert items[-1]["source"] == f"{tmp_path / 'p.jsonl'}:3"
    # a chat without a template: the format the shipped checkpoint was trained on
    assert gen.plain_chat(items[-1]["messages"]) == "System: Be brief.\nUser: Hi?\nAssistant:"
    render, how = gen.chat_renderer(None)
    assert render is gen.plain_chat and "Assistant:" in how


def test_chat_template_of_the_checkpoint_is_used(tmp_path):
    pytest.importorskip("jinja2")
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>" \
               "{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    render, how = gen.chat_renderer(str(tmp_path))
    assert render([{"role": "user", "content": "hi"}]) == "<user>hi<a>" and "chat_template" in how


@pytest.mark.skipif(not (SHIPPED / "tokenizer.json").is_file(), reason="the shipped checkpoint is absent")
def test_shipped_checkpoint_streams_text_as_cycles_commit(tmp_path, capsys):
    """Two prompts (one a chat), spec auto (tune.json's choice for batch 2), eight tokens: the text
    streamed per row is the text written to the JSONL, decoded from its tokens."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "Question: What is 2 + 3?\\nAnswer:"}\n'
                                      '{"messages": [{"role": "user", "content": "Name a color."}]}\n')
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--checkpoint", str(SHIPPED), "--jsonl", str(tmp_path / "p.jsonl"),
                 "--max-new-tokens", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    records = _records(out)
    assert len(records) == 2 and records[1]["prompt_text"] == "User: Name a color.\nAssistant:"
    assert records[0]["spec"] != "ar" and "tune.json chose" in records[0]["spec_choice"]
    streamed = {i: "".join(ast.literal_eval(line.split("] ", 1)[1]) for line in printed.splitlines()
                           if line.startswith(f"[{i}] ")) for i in (0, 1)}
    assert streamed == {0: records[0]["text"], 1: records[1]["text"]} and all(streamed.values())
    assert "chats rendered as" in " ".join(printed.split())
    assert os.path.getsize(out) > 0
