"""Damaged inputs give one line naming the file and the problem, and nothing else on stderr: a
truncated orbax array file, a config.json that does not match the arrays, damaged orbax metadata,
a truncated or malformed .safetensors file, and params that are not a jaxspec params pytree."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.checkpoint import save_checkpoint, save_hf_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = js.ModelConfig.preset("test")


def _params(cfg):
    """Random params built in numpy from the abstract tree (eager init is slow on a CPU)."""
    import jax

    rng = np.random.default_rng(0)
    abstract = jax.eval_shape(lambda: js.init_params(cfg, jax.random.key(0)))
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    out = [jnp.asarray(rng.standard_normal(x.shape).astype(x.dtype)) if jnp.issubdtype(x.dtype, jnp.floating)
           else jnp.zeros(x.shape, x.dtype) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """(orbax checkpoint folder, HF safetensors folder), written once; tests damage copies."""
    root = tmp_path_factory.mktemp("damaged")
    params = _params(CFG)
    save_checkpoint(root / "orbax", CFG, params)
    save_hf_checkpoint(root / "hf", CFG, params)
    return root / "orbax", root / "hf"


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _stderr_of(args: list[str]) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stderr


def _demo(checkpoint) -> str:
    return _stderr_of(["-m", "jaxspec", "demo", "--checkpoint", str(checkpoint), "--spec", "none",
                       "--batch", "1", "--new-tokens", "1"])


def _load(call: str) -> str:
    """stderr of a python process that runs `call` and prints only the ValueError's message."""
    script = f"import sys\nimport jaxspec as js\ntry:\n    {call}\nexcept ValueError as e:\n" \
             "    sys.exit(str(e))\nprint('no error')\n"
    return _stderr_of(["-c", script])


def _assert_one_line(stderr: str, *expected: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-4000:]
    for text in expected:
        assert text in lines[0], lines[0]
    for noise in ("Traceback", "Event loop is closed", "Exception ignored", "TensorStore({"):
        assert noise not in stderr


def test_truncated_orbax_array_file(saved, tmp_path):
    ckpt = _copy(saved[0], tmp_path / "ckpt")
    data = ckpt / "params" / "ocdbt.process_0" / "d"
    biggest = max(data.iterdir(), key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 2)
    _assert_one_line(_demo(ckpt), "jaxspec: error: ", str(biggest), "damaged or truncated")
    _assert_one_line(_load(f"js.load_checkpoint({str(ckpt)!r})"), str(biggest), "damaged or truncated")


def test_config_that_does_not_match_the_arrays(saved, tmp_path):
    ckpt = _copy(saved[0], tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["hidden_size"] = 64
    (ckpt / "config.json").write_text(json.dumps(config))
    _assert_one_line(_demo(ckpt), f"checkpoint {ckpt}: config.json does not match its arrays",
                     "embed is stored with shape (96, 32), config.json implies (96, 64)")
    config = json.loads((saved[0] / "config.json").read_text())
    config["num_layers"], config["layer_types"] = 3, config["layer_types"][:3]
    (ckpt / "config.json").write_text(json.dumps(config))
    _assert_one_line(_demo(ckpt), "config.json does not match its arrays", "layers.3.")


def test_damaged_orbax_metadata_and_config(saved, tmp_path):
    ckpt = _copy(saved[0], tmp_path / "ckpt")
    with open(ckpt / "params" / "_METADATA", "r+b") as f:
        f.truncate(50)
    _assert_one_line(_demo(ckpt), str(ckpt / "params" / "_METADATA"), "damaged or not JSON")
    (ckpt / "config.json").write_text('{"vocab_size": 96, "hidden')
    _assert_one_line(_demo(ckpt), str(ckpt / "config.json"), "damaged or not JSON")


def test_truncated_and_malformed_safetensors(saved, tmp_path):
    hf = _copy(saved[1], tmp_path / "hf")
    shard = hf / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    _assert_one_line(_load(f"js.load_hf_checkpoint({str(hf)!r})"), str(shard), "truncated or not a safetensors file")
    shard.write_bytes((40).to_bytes(8, "little") + b"{this is not a header}".ljust(40) + b"\0" * 64)
    _assert_one_line(_load(f"js.load_hf_checkpoint({str(hf)!r})"), str(shard), "truncated or not a safetensors file")


@pytest.mark.parametrize("call", [
    "js.generate({}, cfg, [[1, 2]], max_new_tokens=2)",
    "js.speculative_generate({}, cfg, [[1, 2]], 's2_k1_d3', max_new_tokens=2)",
    "js.prefill_logits({}, cfg, [[1, 2]])",
])
def test_params_that_are_not_a_params_pytree(call):
    cfg = CFG  # noqa: F841  (used by `call`)
    with pytest.raises(ValueError) as excinfo:
        eval(call)
    message = str(excinfo.value)
    assert message == "params must be a jaxspec ModelParams (from init_params / load_checkpoint), got dict"


def test_params_of_another_config():
    other = _params(CFG.replace(hidden_size=64))
    with pytest.raises(ValueError, match=r"params do not fit cfg: embed \(96, 64\) and 4 layers, cfg implies "
                                         r"\(96, 32\) and 4"):
        js.generate(other, CFG, [[1, 2]], max_new_tokens=2)


def test_orphaned_orbax_reads_are_finalized_quietly():
    """The mechanism behind the orbax case, made deterministic: a suspended coroutine of orbax's code
    whose cleanup fails ("Event loop is closed"). Unhandled it prints a traceback when collected;
    after `quiet_orphaned_reads` it prints nothing, while other unraisable errors still show."""
    script = """
import gc, sys
from jaxspec.checkpoint import errors as checkpoint_errors
code = compile('''
async def read():
    try:
        await pending
    finally:
        raise RuntimeError("Event loop is closed")
class Pending:
    def __await__(self):
        yield
pending = Pending()
''', "/site-packages/orbax/checkpoint/fake.py", "exec")
space = {}
exec(code, space)
def orphan():
    coro = space["read"]()
    coro.send(None)  # suspended in the read, as a restore's reads are when one fails
if sys.argv[1] == "quiet":
    checkpoint_errors.quiet_orphaned_reads()
orphan()
gc.collect()
class Other:
    def __del__(self):
        raise KeyError("not orbax")
Other()
gc.collect()
"""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    runs = {mode: subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, env=env,
                                 timeout=120).stderr for mode in ("loud", "quiet")}
    assert "Event loop is closed" in runs["loud"] and "not orbax" in runs["loud"]
    assert "Event loop is closed" not in runs["quiet"] and "Exception ignored" in runs["quiet"]
    assert "not orbax" in runs["quiet"]
