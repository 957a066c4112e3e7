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
