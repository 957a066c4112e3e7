"""One end-to-end chi-square case of the test suite at several seeds: is a failing p-value a fixed
seed's bad luck, or does the sampler drift from the target?

    python bench/chi_square_seeds.py [--spec s2_k4_d9] [--setting t1] [--accept residual]
                                     [--seeds 0 1 2 3 4 5] [--json PATH]

Runs `tests/test_sampling.check_end_to_end` (20,480 sequences (chunks of 4,096) of 3 tokens on the `test` preset's
confident params, the p-values of token 1, token 2, token 2 | t1, token 3 | t1 and token 3 | t1, t2
against the exact processed target) once per seed, and prints each seed's p-values and Fisher's
combination per statistic (-2 sum log p ~ chi-square with 2 x seeds degrees of freedom under an
exact sampler).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax
import numpy as np
from _common import console, parser, write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import test_sampling  # noqa: E402  (the suite's harness, so the case is exactly the test's)

import jaxspec as js  # noqa: E402
from jaxspec.testing import high_acceptance, randomize, sharpened  # noqa: E402


def confident_params(cfg: js.ModelConfig):
    """The suite's `confident_params` fixture (tests/conftest.py), built the same way."""
    return sharpened(high_acceptance(randomize(js.init_params(cfg, jax.random.key(0)), jax.random.key(1))))


def fisher_p(p_values: list[float]) -> float:
    """Fisher's method: P(chi-square with 2n dof >= -2 sum log p), in closed form for even dof."""
    half = -sum(math.log(max(p, 1e-300)) for p in p_values)  # = statistic / 2
    return math.exp(-half) * sum(half**i / math.factorial(i) for i in range(len(p_values)))


def main() -> None:
    p = parser(__doc__, preset="test")
    p.add_argument("--spec", default="s2_k4_d9")
    p.add_argument("--setting", default="t1", choices=sorted(test_sampling.SETTINGS))
    p.add_argument("--accept", default="residual", choices=["residual", "target"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    args = p.parse_args()
    con = console()
    cfg = js.ModelConfig.preset(args.preset)
    params = confident_params(cfg)
    rows = []
    for seed in args.seeds:
        result = test_sampling.check_end_to_end(params, cfg, args.spec, args.setting, seed=seed, accept=args.accept)
        rows.append({k: float(v) for k, v in result.items()})
        con.print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in rows[-1].items()))
    stats = [k for k in rows[0] if k != "tau"]
    combined = {k: fisher_p([r[k] for r in rows if k in r]) for k in stats}
    con.print("Fisher's combination over the seeds: " + ", ".join(f"{k} {v:.4f}" for k, v in combined.items()))
    con.print(f"smallest single p-value {min(min(r[k] for k in stats if k in r) for r in rows):.4f} "
              f"of {sum(k in r for r in rows for k in stats)}")
    write_json(args.json, {"spec": args.spec, "setting": args.setting, "accept": args.accept, "seeds": args.seeds,
                           "rows": rows, "fisher": combined, "tau": float(np.mean([r["tau"] for r in rows]))}, con)


if __name__ == "__main__":
    main()
