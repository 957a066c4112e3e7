"""The tables of docs/block_verification.md from bench/rsd_tau.py's records in results/block/: tau per rule
and spec (D = 4..8, 16, 32; T = 1 / 0.6; top-p 1 / 0.9) with the block rule's gain, per-depth reach, and
tree vs chain at D = 16 pooled over seeds.

    python experiments/block/tables.py [results/block]
"""

import json
import sys
from pathlib import Path


def records(folder: Path) -> list[dict]:
    out = []
    for name in ("tau.jsonl", "tau_d16_seeds.jsonl"):
        path = folder / name
        if path.exists():
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in out if "tau" in r]


def pooled(rs: list[dict]) -> tuple[float, int]:
    acc = sum(sum(r["per_sequence"]["accepted"]) for r in rs)
    cyc = sum(sum(r["per_sequence"]["cycles"]) for r in rs)
    return (acc + cyc) / max(cyc, 1), len(rs)


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "results/block")
    rs = records(folder)
    first = [r for r in rs if r.get("seed", 0) == 0 and "note" not in r]
    depth = lambda s: int(s.split("_d")[1])  # noqa: E731
    print("| D | chain / tree | T | top-p | residual tau | block tau | block / residual |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    keys = sorted({(depth(r["spec"]), r["spec"], r["temperature"], r["top_p"]) for r in first},
                  key=lambda k: (k[0], "_k1_" not in k[1], -k[2], -k[3]))
    for d, spec, t, p in keys:
        by = {r["rule"]: r["tau"] for r in first if (r["spec"], r["temperature"], r["top_p"]) == (spec, t, p)}
        if {"block", "residual"} <= set(by):
            print(f"| {d} | {spec} | {t} | {p} | {by['residual']:.2f} | {by['block']:.2f} | "
                  f"{100 * (by['block'] / by['residual'] - 1):+.1f}% |")
    print()
    print("| spec | rule | T | per-depth reach |")
    print("|---|---|---:|---|")
    for spec in ("s7_k1_d8", "s15_k1_d16"):
        for t in (1.0, 0.6):
            for rule in ("residual", "block"):
                sel = [r for r in first if (r["spec"], r["rule"], r["temperature"], r["top_p"]) == (spec, rule, t, 1.0)]
                if sel:
                    print(f"| {spec} | {rule} | {t} | " + ", ".join(f"{x:.2f}" for x in sel[0]["per_depth_acceptance"])
                          + " |")
    print()
    print("| T | chain s15_k1_d16 (block) | tree s15_k2_d16 (block, block values) | tree / chain | runs |")
    print("|---:|---:|---:|---:|---:|")
    def of(spec, t):
        return [r for r in rs if (r["spec"], r["rule"], r["temperature"], r["top_p"]) == (spec, "block", t, 1.0)]

    for t in (1.0, 0.6):
        chain = of("s15_k1_d16", t)
        # the seed-0 tree of tau.jsonl was ranked by the prior (no block maps yet): left out
        tree = [r for r in of("s15_k2_d16", t) if r.get("seed", 0) > 0 or "note" in r]
        (c, nc), (tr, nt) = pooled(chain), pooled(tree)
        print(f"| {t} | {c:.2f} | {tr:.2f} | {100 * (tr / c - 1):+.1f}% | {nc} / {nt} |")


if __name__ == "__main__":
    main()
