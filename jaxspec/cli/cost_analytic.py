"""`jaxspec cost` with the analytic model (the default): the stage table per device, its latency
terms, projection rows and `--calibrate`. The XLA path stays in `cli/cost.py` (`--model xla`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from jaxspec.cli.tables import compact

ASSUMPTIONS = (
    "Model, not measurement: per device, the context full (every compressed entry exists); weights read once per "
    "stage at stored precision; routed experts at the expected distinct count per device (independent routing, "
    "less --overlap on learned routers), time from the busiest device (its expected maximum, exact given the union "
    "size); "
    "t = max(FLOPs / peak, busiest bytes / HBM) + kernels x launch_us + collectives x (collective_us + bytes / "
    "NVLink) + passes x pass_us; latency terms fitted to published H200 points (jaxspec cost --calibrate); "
    "break-even tau = cycle / AR step; speedup = tau x AR step / cycle."
)


def _latency(args: argparse.Namespace, cfg: Any = None) -> Any:
    from jaxspec.cost import latency

    lat = latency.H200
    changes = {k: v for k, v in (("launch_us", args.launch_us), ("collective_us", args.collective_us),
                                 ("pass_us", args.overhead_us)) if v is not None}
    for name, value in changes.items():
        if value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if args.kernels == "counted":  # launches counted from the CUDA program of each layer kind
        from jaxspec.cost.kernels import counted_kernels

        if cfg is None:
            raise ValueError("--kernels counted needs a model config")
        changes["kernels"] = tuple({**dict(lat.kernels), **counted_kernels(cfg)}.items())
    elif args.kernels:
        kernels = dict(lat.kernels)
        for item in args.kernels.split(","):
            kind, _, count = item.partition("=")
            if kind not in kernels or not count.isdigit():
                raise ValueError(f"--kernels takes KIND=N with KIND in {sorted(kernels)}, got {item!r}")
            kernels[kind] = int(count)
        changes["kernels"] = tuple(kernels.items())
    return dataclasses.replace(lat, **changes)


def run_calibrate(args: argparse.Namespace, console: Console) -> int:
    from jaxspec.cost import fit as cost_fit
    from jaxspec.cost import latency

    points = cost_fit.load_points(args.calibration)
    fitted = cost_fit.fit(points)
    console.print(f"[bold]fit[/]: launch_us {fitted.launch_us:g}, collective_us {fitted.collective_us:g} (prior "
                  f"{latency.PRIOR.launch_us:g} / {latency.PRIOR.collective_us:g}, weight {cost_fit.PRIOR_WEIGHT}); "
                  f"shipped H200 default: {latency.H200.launch_us:g} / {latency.H200.collective_us:g}")
    rows = cost_fit.residuals(points, fitted)
    table = Table(title="calibration points (a model, not a measurement)")
    for name in ("point", "role", "what", "published", "model", "residual"):
        table.add_column(name, justify="right" if name in ("published", "model", "residual") else "left")
    for r in rows:
        if r["role"] == "unexpressed":
            table.add_row(r["name"], r["role"], r["why"], "-", "-", "-")
        else:
            table.add_row(r["name"], r["role"], r["what"], f"{r['published']:.3f}", f"{r['model']:.3f}",
                          f"{100 * r['residual']:+.1f}%")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fit": dataclasses.asdict(fitted), "points": rows}, f, indent=1)
    return 0


def _mesh(args: argparse.Namespace, cfg: Any) -> tuple[int, int, int]:
    from jaxspec import sharding

    shape = sharding.parse_mesh(args.mesh) if args.mesh is not None else sharding.default_mesh_shape(args.devices, cfg)
    if shape[0] * shape[1] * shape[2] != args.devices:
        raise ValueError(f"--mesh {args.mesh} spans {shape[0] * shape[1] * shape[2]} devices but --devices is "
                         f"{args.devices}")
    return shape


def run_analytic(args: argparse.Namespace, console: Console, specs: list, taus: dict) -> int:
    from jaxspec.core.config import ModelConfig
    from jaxspec.cost import latency, project, terms

    cfg = ModelConfig.preset(args.preset)
    draft = terms.default_dspark(cfg) if getattr(args, "draft", "mtp") == "dspark" else None
    hw = latency.hardware(args.accelerator)
    lat = _latency(args, cfg.replace(kernels="pallas"))  # the GPU program runs the kernels
    mesh = _mesh(args, cfg)
    for b in args.batch_sizes:
        terms.check_setup(cfg, mesh, b, args.context)
    console.print(f"[bold]jaxspec cost[/] (analytic): {args.preset} (weights {args.weights}, experts {args.experts}), "
                  f"context {args.context}, mesh data={mesh[0]} tensor={mesh[1]} expert={mesh[2]}, layout "
                  f"{args.layout}; {hw.name}: {hw.peak_flops / 1e12:.0f} TFLOP/s, {hw.bandwidth / 1e12:.1f} TB/s, "
                  f"NVLink {hw.link_bandwidth / 1e9:.0f} GB/s; launch {lat.launch_us:g} us, collective "
                  f"{lat.collective_us:g} us, {lat.pass_us:g} us per forward pass")
    stages = Table(title="per device, one call")
    for name in ("batch", "spec", "stage", "GFLOP", "GB (mean)", "GB (busiest)", "collectives", "ms"):
        stages.add_column(name, justify="left" if name in ("spec", "stage") else "right")
    summary = Table(title=f"projected on {hw.name} (a model, not a measurement)")
    for name in ("batch", "AR ms", "best", "spec", "tau", "cycle ms", "break-even tau", "speedup"):
        summary.add_column(name, justify="left" if name in ("best", "spec") else "right")
    out_rows, best_rows = [], []
    for b in args.batch_sizes:
        s = terms.Setup(cfg, mesh, b, args.context, args.weights, args.experts, args.overlap, args.layout)
        rows = [project.row(s, spec, hw, lat, draft) for spec in [None, *specs]]
        for r in rows:
            for stage, c in r.stages.items():
                n = sum(k for k, _ in c.collectives.values())
                stages.add_row(str(b), r.spec, stage, f"{c.total_flops / 1e9:.2f}", f"{c.total_bytes / 1e9:.3f}",
                               f"{c.busiest_bytes / 1e9:.3f}", str(n), f"{1e3 * r.seconds[stage]:.3f}")
            stages.add_section()
            out_rows.append(_row_json(r, hw, lat))
        ar = rows[0]
        chain, tree = (project.best(rows, ar, taus, args.tau, c) for c in (True, False))
        best_rows.append({"batch": b, "ar_ms": 1e3 * ar.step_seconds, "best_chain": chain, "best_tree": tree})
        for kind, pick in (("chain", chain), ("tree", tree)):  # one row each: fits 80 columns
            summary.add_row(str(b), f"{1e3 * ar.step_seconds:.3f}", kind, *(
                ["-"] * 5 if pick is None else [pick["spec"], f"{pick['tau']:.2f}", f"{pick['cycle_ms']:.3f}",
                                                f"{pick['break_even_tau']:.2f}", f"{pick['speedup']:.2f}x"]))
        summary.add_section()
    console.print(compact(stages))
    console.print(compact(summary))
    console.print(f"[dim]{ASSUMPTIONS}[/]")
    from jaxspec.cli.tables import emit

    emit(args, {"model": "analytic", "preset": args.preset, "weights": args.weights, "experts": args.experts,
                "context": args.context, "mesh": list(mesh), "layout": args.layout, "overlap": args.overlap,
                "accelerator": hw.name, "latency": dataclasses.asdict(lat), "assumptions": ASSUMPTIONS,
                "tau_source": getattr(args, "tau_source", None), "rows": out_rows, "best": best_rows})
    return 0


def _row_json(r: Any, hw: Any, lat: Any) -> dict[str, Any]:
    from jaxspec.cost import latency

    return {"batch": r.batch, "spec": r.spec, "step_seconds": r.step_seconds, "stages": {
        k: {"flops": c.total_flops, "bytes": c.total_bytes, "busiest_bytes": c.busiest_bytes,
            "bytes_terms": c.bytes, "flops_terms": c.flops,
            "collectives": {n: {"count": a, "bytes": v} for n, (a, v) in c.collectives.items()},
            "collective_bytes": sum(v for _, v in c.collectives.values()), "passes": c.passes,
            "seconds": r.seconds[k], "seconds_terms": latency.split(c, hw, lat)}
        for k, c in r.stages.items()}}
