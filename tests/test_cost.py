"""The cost model: stage costs summed layer kind by layer kind equal a full lowering, the roofline
projection equals a hand calculation, and bad `jaxspec cost` input is a one-line error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.cli import main
from jaxspec.cost import xla as cost
from jaxspec.model.network import abstract_params, jitted_one_shot_logits


def test_costs_summed_per_layer_kind_equal_a_full_lowering(test_cfg):
    pattern = ("sliding", "csa", "hca", "csa", "hca", "hca", "csa", "sliding", "hca", "csa")
    cfg = test_cfg.replace(num_layers=len(pattern), layer_types=pattern, num_hash_layers=2)
    assert cfg.num_layers > cost.FULL_LOWERING_MAX_LAYERS  # so stage_costs composes
    spec = js.SpecConfig.parse("s2_k2_d4")
    composed = cost.stage_costs(cfg, spec, batch=2, context=64, which=("ar", "verify", "commit"))
    for name, got in composed.items():
        fn, args = cost._stage_call(name, cfg, spec, cost._abstract_inputs(cfg, spec, 2, 64))
        whole = cost._lowered_cost(fn, args, None, 2, cfg)
        assert got.flops == pytest.approx(whole.flops, rel=1e-9), name
        # bytes agree to 0.1% (a few shared per-call buffers are not per layer)
        assert got.bytes == pytest.approx(whole.bytes, rel=1e-3), name


def test_projection_equals_a_hand_calculation(test_cfg):
    toy = cost.Accelerator("toy", peak_flops=2e9, bandwidth=1e8, nominal_bandwidth=1e8)
    overhead = 1e-5
    spec = js.SpecConfig.parse("s3_k2_d6")
    [ar, cycle] = cost.project(test_cfg, [spec], [2], 64, toy, overhead)
    assert (ar.spec, cycle.spec) == ("ar", "s3_k2_d6")
    c = ar.costs["ar"]
    assert c.flops > 0 and c.bytes > 0
    # by hand: the slower of compute and memory, plus one overhead per forward pass
    assert ar.step_seconds == pytest.approx(max(c.flops / 2e9, c.bytes / 1e8) + 1 * 1e-5)
    passes = {"draft": 3, "plan": 0, "verify": 1, "commit": 1}  # S = 3 draft steps
    by_hand = sum(max(cycle.costs[s].flops / 2e9, cycle.costs[s].bytes / 1e8) + n * 1e-5 for s, n in passes.items())
    assert cycle.step_seconds == pytest.approx(by_hand)
    assert cycle.speedup(2.5, ar) == pytest.approx(2.5 * ar.step_seconds / by_hand)
    # verifying six tokens reads and computes more than one decode step
    assert cycle.costs["verify"].flops > c.flops and cycle.costs["verify"].bytes > c.bytes


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["cost", "--preset", "nope"], "unknown preset"),
        (["cost", "--preset", "test", "--accelerator", "tpu9"], "unknown accelerator"),
        (["cost", "--preset", "test", "--devices", "8", "--mesh", "1,2,2"], "spans 4 devices but --devices is 8"),
        (["cost", "--preset", "test", "--specs", "s3_k1_d6"], "linear chain"),
        (["cost", "--preset", "test", "--tau", "0.5"], "--tau must be >= 1"),
    ],
)
def test_cost_cli_bad_input_is_one_line(argv, expected):
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    code = excinfo.value.code
    assert isinstance(code, str) and code.startswith("jaxspec: error: ") and "\n" not in code
    assert expected in code


def test_cost_cli_reports_and_projects(capsys, tmp_path):
    out_json = tmp_path / "cost.json"
    assert main(["cost", "--preset", "test", "--specs", "s2_k2_d4", "--batch-sizes", "1,4", "--context", "64",
                 "--tau", "2.0", "--json", str(out_json)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "a model, not a measurement" in out and "NVIDIA H200" in out and "2.00" in out
    import json

    data = json.loads(out_json.read_text())
    assert {(r["batch"], r["spec"]) for r in data["rows"]} == {(1, "ar"), (1, "s2_k2_d4"), (4, "ar"), (4, "s2_k2_d4")}


# The work a forward needs (XLA cost analysis on abstract shapes).


def _active_params(cfg: js.ModelConfig) -> float:
    """Parameters one token uses in the main model: all but the MTP block, the embedding table
    (a row lookup) and the routed experts it did not select."""
    params = abstract_params(cfg)
    count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))  # noqa: E731
    routed = sum(count(layer.ffn.experts) for layer in params.layers)
    unselected = routed * (1 - cfg.num_experts_per_tok / cfg.n_routed_experts)
    return count(params) - count(params.mtp) - params.embed.size - unselected


def test_v4_flash_forward_does_only_the_active_work():
    cfg = js.ModelConfig.preset("v4-flash")
    active = _active_params(cfg)
    assert 13.0e9 < active < 13.6e9  # the 13.3B active parameters of V4-Flash
    params = abstract_params(cfg)
    for tokens in (1, 8):
        lowered = jitted_one_shot_logits.lower(params, cfg, jax.ShapeDtypeStruct((1, tokens), jnp.int32))
        ratio = lowered.cost_analysis()["flops"] / (2 * active * tokens)
        assert 1.0 <= ratio <= 1.5, (tokens, ratio)  # the dense-expert forward measured ~25

