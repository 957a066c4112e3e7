import os
import subprocess
import sys

import pytest

from jaxspec.cli import main


def test_demo_random_init_reports_throughput(capsys):
    assert main(["demo", "--preset", "test", "--batch", "2", "--new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "random init" in out
    assert "tokens/s" in out
    assert "compile" in out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["demo", "--preset", "nope"], "unknown preset"),
        (["demo", "--preset", "test", "--batch", "0"], "--batch"),
        (["demo", "--preset", "test", "--new-tokens", "0"], "--new-tokens"),
        (["demo", "--checkpoint", "/nonexistent"], "/nonexistent"),
        (["demo", "--batch", "x"], "invalid int"),
        (["nope"], "invalid choice"),
        (["demo", "--preset", "test", "--batch", "1", "--new-tokens", "2", "--spec", "auto"], "--checkpoint"),
        (["train", "--steps", "0"], "--steps must be >= 1"),
        (["train", "--batch", "4", "--eval-rows", "2"], "--eval-rows"),
        (["sweep", "--merge", "/nonexistent.jsonl"], "no such runs file"),
    ],
)
def test_bad_input_exits_with_one_line_message(argv, expected):
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    code = excinfo.value.code
    # sys.exit(str): Python prints the string to stderr and exits with status 1.
    assert isinstance(code, str), code
    assert code.startswith("jaxspec: error: ")
    assert "\n" not in code
    assert expected in code


def test_module_entry_point_error_has_no_traceback():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxspec", "demo", "--batch", "0"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "jaxspec: error: --batch must be >= 1, got 0"


def _released_folder(path):
    """A DeepSeek-V4-style release folder: FP4 / FP8 safetensors shards + index, config.json,
    tokenizer.json (HF `tokenizers`, the release's special-token names at ids 0 / 1) and
    tokenizer_config.json."""
    import json

    import jax
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import jaxspec as js
    from jaxspec.checkpoint import save_hf_checkpoint
    from jaxspec.testing import high_acceptance, randomize

    cfg = js.ModelConfig.preset("test", bos_id=0, eos_id=1)
    params = high_acceptance(randomize(js.init_params(cfg, jax.random.key(0)), jax.random.key(1)))
    save_hf_checkpoint(path, cfg, params, quantize="fp4", max_shard_bytes=128 * 1024)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:60])
    tok.train_from_iterator(["The capital of France is Paris. def f(n): return n"] * 8, trainer)
    assert tok.token_to_id(specials[0]) == 0 and tok.get_vocab_size() <= cfg.vocab_size
    tok.save(str(path / "tokenizer.json"))
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": specials[0], "eos_token": specials[1]}, f)
    return tok


def test_demo_on_a_released_checkpoint_folder(tmp_path, capsys):
    """`jaxspec demo --checkpoint <downloaded V4 folder> --mesh ...`: loads the safetensors release
    (FP4 / FP8 dequantized) into the mesh and its tokenizer.json, and runs as on our checkpoints."""
    folder = tmp_path / "DeepSeek-V4-tiny"
    _released_folder(folder)
    assert main(["demo", "--checkpoint", str(folder), "--batch", "2", "--new-tokens", "6", "--mesh", "1,1,1",
                 "--spec", "s2_k2_d4"]) == 0
    out = capsys.readouterr().out
    assert "DeepSeek-V4 safetensors, float32 on the mesh" in out
    assert "Tom has 3 boxes" in out  # the prompts went through tokenizer.json (text shown, not ids)
    assert "identical to generate" in out
