"""Our DSpark drafter against mlx-vlm's (tests/mlx_dspark_oracle.py; mlx-vlm 0.7.10, mlx[cpu] 0.32.4,
installed by scripts/setup.sh test). No skip: without mlx this module fails to import.

Both read the same 0731-style folder (tests/dspark_layout.py, F32) and are fed the same captured
target rows for positions 0..p and the same anchor; the Markov-corrected logits of every block
position and the greedy drafted tokens must agree (fp32, relative error <= 1e-4), for a context
shorter than the window and one that has wrapped the ring. mlx-vlm drops the confidence head, so
the confidence logits are checked against the reference formula on mlx-vlm's hc_head output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import mlx_dspark_oracle as oracle  # imports mlx at module level: fails, never skips, without it
import numpy as np
import pytest
from dspark_layout import write_folder

from jaxspec.checkpoint import load_hf_dspark
from jaxspec.model import dspark as ds

LENGTHS = (13, 5)  # context rows: past the window (8, the ring wrapped) and short of it
ANCHORS = (7, 40)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dspark_parity") / "f32")
    write_folder(path, "f32", seed=1)
    return path, load_hf_dspark(path, dtype="float32"), oracle.load(path)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _draft(dp, tp, cfg, dcfg, rows, take, anchor):
    """Context committed in two calls (3 rows, then the rest), then the chain."""
    b, t, _ = rows.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    state = ds.init_dspark_state(cfg, dcfg, b)
    state = ds.commit_context(dp, cfg, dcfg, state, rows[:, :3], pos[:, :3], take[:, :3])
    state = ds.commit_context(dp, cfg, dcfg, state, rows[:, 3:], pos[:, 3:], take[:, 3:])
    return ds.draft_chain(dp, tp, cfg, dcfg, state, anchor)


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def test_block_logits_and_greedy_tokens_match_mlx(setup):
    path, (cfg, tp, dp, dcfg), mlx_model = setup
    assert cfg.sliding_window < LENGTHS[0] and LENGTHS[1] < cfg.sliding_window
    rng = np.random.default_rng(0)
    width = len(dcfg.target_layers) * cfg.hidden_size
    rows = rng.standard_normal((len(LENGTHS), max(LENGTHS), width)).astype(np.float32)
    take = np.arange(max(LENGTHS))[None, :] < np.asarray(LENGTHS)[:, None]  # ragged: one batch, both lengths
    chain = _draft(dp, tp, cfg, dcfg, jnp.asarray(rows), jnp.asarray(take), jnp.asarray(ANCHORS, jnp.int32))
    errors, moved = [], 0
    for i, (n, anchor) in enumerate(zip(LENGTHS, ANCHORS, strict=True)):
        want = oracle.draft(mlx_model, rows[i, :n], anchor, dcfg.block_size)
        np.testing.assert_array_equal(chain.tokens[i], want["tokens"], err_msg=f"context of {n} rows")
        errors.append(_rel(chain.logits[i], want["logits"]))
        assert errors[-1] <= 1e-4, (n, errors[-1])
        assert _rel(chain.confidence[i], want["conf"]) <= 1e-4
        np.testing.assert_allclose(want["corrected"], want["logits"], rtol=1e-6, atol=1e-6)  # the oracle's two paths
        moved += int(np.sum(want["base"].argmax(-1) != want["logits"].argmax(-1)))
    assert moved > 0  # the Markov bias changes some argmax: the check covers it
    print(f"max relative error of the corrected logits vs mlx-vlm: {max(errors):.2e}")
