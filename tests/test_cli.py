import os
import subprocess
import sys

import pytest

from jaxspec.cli import main


def test_demo_random_init_reports_throughput(capsys):
    assert main(["demo", "--preset", "test", "--batch", "2", "--new-tokens", "8", "--repeats", "2", "--no-pin"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "random init" in out
    assert "tokens/s" in out and "x AR" in out and "spread" in out
    assert "measurement: LOADED" in out and "not pinned to one core" in out  # --no-pin: never a clean verdict
    assert "compile, not in any tokens/s above: AR" in out
    # no tune.json on a random init: the untuned default, said so, and why a CPU gain is small
    assert "--spec auto: the draft has no tune.json; running the untuned s3_k2_d6" in out
    assert "Why the gain is small on a CPU" in out and "no tune.json measurements" in out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["demo", "--preset", "nope"], "unknown preset"),
        (["demo", "--preset", "test", "--batch", "0"], "--batch"),
        (["demo", "--preset", "test", "--new-tokens", "0"], "--new-tokens"),
        (["demo", "--checkpoint", "/nonexistent"], "/nonexistent"),
        (["demo", "--batch", "x"], "invalid int"),
        (["nope"], "invalid choice"),
        (["demo", "--preset", "test", "--spec", "s7_k9_d4"], "num_steps must be in 1..3"),
        (["demo", "--preset", "test", "--spec", "foo"], "--spec 'foo'"),
        (["demo", "--preset", "test", "--checkpoint", "checkpoints/tiny-v4"], "--preset test and --checkpoint"),
        (["generate", "--preset", "test"], "no prompts"),
        (["generate", "--preset", "test", "--prompt", "1 2", "--spec", "s0_k1_d1"], "--spec 's0_k1_d1'"),
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


# ~50 s; CI: the demo on a release folder (tests/test_fp8_weights.py), release loading on a mesh (8 devices)
@pytest.mark.long
def test_demo_on_a_released_checkpoint_folder(tmp_path, capsys):
    """`jaxspec demo --checkpoint <downloaded V4 folder> --mesh ...`: loads the safetensors release
    (FP4 / FP8 dequantized) into the mesh and its tokenizer.json, and runs as on our checkpoints."""
    folder = tmp_path / "DeepSeek-V4-tiny"
    _released_folder(folder)
    assert main(["demo", "--checkpoint", str(folder), "--batch", "2", "--new-tokens", "6", "--mesh", "1,1,1",
                 "--repeats", "1", "--spec", "s2_k2_d4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "DeepSeek-V4 safetensors, float32 on the mesh" in out
    assert "Tom has 3 boxes" in out  # the prompts went through tokenizer.json (text shown, not ids)
    assert "identical to AR" in out


@pytest.fixture
def no_model(monkeypatch):
    """Commands whose arguments are wrong must fail before any model work."""
    import jaxspec.cli.demo
    import jaxspec.cli.generate

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(jaxspec.cli.demo, "load_model", refuse)
    monkeypatch.setattr(jaxspec.cli.generate, "load_model", refuse)


@pytest.mark.parametrize("argv, expected", [
    (["demo", "--spec", "foo"], "spec name must look like"),
    (["demo", "--prompt-file", "EMPTY"], "is empty"),
    (["demo", "--prompt-file", "/nonexistent.txt"], "is not a file"),
    (["generate", "--prompt-file", "EMPTY"], "holds no prompt"),
    (["generate", "--jsonl", "BAD"], "BAD:2: not JSON"),
    (["generate", "--jsonl", "NEITHER"], 'NEITHER:1: want an object with "prompt" (text) or "messages"'),
    (["generate", "--prompt", " "], "--prompt 1: empty prompt"),
])
def test_bad_arguments_fail_before_the_model_loads(tmp_path, no_model, argv, expected):
    files = {"EMPTY": "\n \n", "BAD": '{"prompt": "a"}\n{"prompt": \n', "NEITHER": '{"text": "a"}\n'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        argv = [str(tmp_path / name) if a == name else a for a in argv]
        expected = expected.replace(f"{name}:", f"{tmp_path / name}:")
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code.startswith("jaxspec: error: ") and "\n" not in excinfo.value.code
    assert expected in excinfo.value.code


def test_every_option_has_help_and_shows_its_default(capsys):
    from jaxspec.cli import _Formatter, build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert {"demo", "generate", "train", "distill-data", "distill", "sweep", "tune", "calibrate", "plan",
            "cost"} <= set(commands)
    for name, sub in commands.items():
        formatter = _Formatter(name)
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings[0]}: no help"
            if action.nargs != 0:  # flags (store_true) default to off
                assert "default" in formatter._get_help_string(action), f"{name} {action.option_strings[0]}"
    with pytest.raises(SystemExit) as excinfo:
        main(["--version"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("jaxspec ") and "(jax " in out


def test_compile_cache_folder_flag_env_and_opt_out(monkeypatch, tmp_path):
    import argparse

    from jaxspec.cli.common import compile_cache_dir

    for var in ("JAXSPEC_NO_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = argparse.Namespace(compile_cache=None, no_compile_cache=False)
    assert compile_cache_dir(args) == str(tmp_path / "jaxspec" / "xla")  # the user's cache folder
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert compile_cache_dir(args) == str(tmp_path / "jax")  # jax's own variable is honoured
    assert compile_cache_dir(argparse.Namespace(compile_cache=str(tmp_path / "x"), no_compile_cache=False)) == \
        str(tmp_path / "x")
    assert compile_cache_dir(argparse.Namespace(compile_cache=None, no_compile_cache=True)) is None
    monkeypatch.setenv("JAXSPEC_NO_COMPILE_CACHE", "1")
    assert compile_cache_dir(args) is None


def test_run_sh_says_the_defaults_it_uses():
    """run.sh passes its own defaults before the user's arguments (argparse keeps the last), leaves
    out the shipped checkpoint when the user names a model, and prints the command with --dry-run."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def dry(*argv):
        proc = subprocess.run(["bash", os.path.join(root, "run.sh"), *argv, "--dry-run"], capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    shipped = "--checkpoint checkpoints/tiny-v4 " if os.path.isdir(os.path.join(root, "checkpoints/tiny-v4")) else ""
    assert dry() == f"python -m jaxspec demo {shipped}--batch 6 --new-tokens 128"
    assert dry("--batch", "2").endswith("--new-tokens 128 --batch 2")
    assert dry("--preset", "test") == "python -m jaxspec demo --batch 6 --new-tokens 128 --preset test"
    with open(os.path.join(root, "run.sh")) as f:
        assert "./run.sh runs: python -m jaxspec demo ${DEMO[*]} [ARGS]" in f.read()  # what --help prints first
