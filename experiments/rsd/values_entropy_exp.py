"""Experiment only (docs/sampling_values.md): residual values keyed by exp(-entropy) of the parent's
processed draft q instead of its top-1 probability (both in (0, 1], the same PROB_EDGES bins), fitted
on the samples experiments/rsd/values_fit.py left in /tmp; held-out tau of the trees under them. The
engine is not changed: this process swaps `speculation.sampled._child_log_values` before compiling.

    JAXSPEC_DATA=/work/shared/data python experiments/rsd/values_entropy_exp.py s7_k2_d8,s4_k2_d8 OUT.jsonl
"""
import json
import sys

import jax.numpy as jnp
import numpy as np
from rsd_tau import load, measure_tau

from jaxspec.harness.calibrate_residual import with_residual
from jaxspec.harness.fit_values import fit_map
from jaxspec.speculation import sampled
from jaxspec.speculation.values import PROB_EDGES, load_calibration


def entropy_values(sampler, step, logq):  # logq: [B, n, V]
    if sampler.residual is None:
        return sampler.log_value[step - 1][None, None, :]
    q = jnp.exp(logq)
    feature = jnp.exp(jnp.sum(jnp.where(q > 0, q * logq, 0.0), axis=-1))  # exp(-H) [B, n]
    prob_bin = jnp.searchsorted(jnp.asarray(PROB_EDGES, jnp.float32), feature, side="right")
    return jnp.moveaxis(sampler.residual[step - 1][:, prob_bin], 0, -1)


specs, out_path = sys.argv[1].split(","), sys.argv[2]
maps = []
for t in (1.0, 0.6):
    s = dict(np.load(f"/tmp/exp21_samples_t{t}.npz"))
    maps.append(fit_map("residual", t, s["depth"], s["rank"], np.exp(-s["parent_entropy"]), s["label"]))
sampled._child_log_values = entropy_values
cfg, params, prompts, draft = load("checkpoints/tiny-v4", 16)
cal = with_residual(load_calibration("checkpoints/tiny-v4", draft.params, cfg), maps)
for spec in specs:
    for t in (1.0, 0.6):
        r = measure_tau(params, cfg, prompts, spec, "residual", t, 1.0, 96, 64, 0, cal, draft)
        r["calibration"] = "exp(-entropy) residual maps (values_entropy_exp.py)"
        print(json.dumps({k: v for k, v in r.items() if k not in ("rank_histogram", "per_sequence")}), flush=True)
        with open(out_path, "a") as f:
            f.write(json.dumps(r) + "\n")
