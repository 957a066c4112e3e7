"""`jaxspec cost`: the analytic cost model of each stage of a cycle (default; `cli/cost_analytic.py`)
or, with `--model xla`, XLA's cost analysis of each stage on abstract shapes (any preset, no weights
allocated) and its roofline projection. A model, not a measurement."""

from __future__ import annotations

import argparse
import io
import os
from typing import Any

from rich.console import Console
from rich.table import Table

from jaxspec.cli.common import add_weights_args, csv, positive, weights_label
from jaxspec.cli.tables import add_format_argument, compact, emit

DEFAULT_SPECS = ("s4_k1_d5", "s4_k2_d8")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "cost",
        help="FLOPs / bytes / latency per stage from the analytic cost model, projected onto an accelerator",
        description="Cost one AR step and each stage of a speculative cycle with the analytic model (named terms, "
        "docs/cost_model.md) and its latency terms calibrated to published H200 points (--calibrate refits them); "
        "with --model xla, lower one AR step and each stage of a speculative cycle (draft, plan, verify, commit) on "
        "abstract shapes, report XLA's FLOPs, bytes accessed and (on a mesh) collective bytes per device, and "
        "project ms per AR step and per cycle onto an accelerator's roofline, with the speedup at a given tau. "
        "This is a model, not a measurement.",
    )
    p.add_argument("--preset", default="v4-flash", help="model preset (default v4-flash)")
    p.add_argument("--model", choices=("analytic", "xla"), default="analytic",
                   help="analytic terms (default) or XLA's cost analysis of the lowered CPU program (the cross-check)")
    p.add_argument("--draft", choices=("mtp", "dspark"), default="mtp",
                   help="the draft a cycle runs: the model's MTP block (default) or DeepSeek's DSpark drafter as "
                   "shipped for the preset (block 5, 3 stages, the last three target layers captured, Markov rank "
                   "256; jaxspec.cost.default_dspark)")
    p.add_argument("--specs", type=csv(str), default=None,
                   help="comma-separated sS_kK_dD (default: every spec the tau source measured, else "
                   "s4_k1_d5,s4_k2_d8)")
    p.add_argument("--batch-sizes", type=csv(int), default=(1, 8, 32, 64), help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=4096, help="positions the decode state holds (default 4096)")
    p.add_argument("--devices", type=int, default=1, help="devices of the mesh (simulated on a CPU)")
    p.add_argument("--mesh", default=None, metavar="D,T,E", help="data,tensor,expert (default: from --devices)")
    p.add_argument("--accelerator", default="h200", help="roofline to project onto (default h200)")
    p.add_argument("--overhead-us", type=float, default=None, help="fixed overhead per forward pass (default 20)")
    p.add_argument("--launch-us", type=float, default=None, help="analytic: per kernel launch (default: the H200 fit)")
    p.add_argument("--collective-us", type=float, default=None,
                   help="analytic: latency of one collective (default: the H200 fit)")
    p.add_argument("--kernels", default=None, metavar="KIND=N,...|counted",
                   help="analytic: kernels per pass of a unit kind (sliding, hca, csa, head, mtp_kv), e.g. csa=40; "
                   "'counted': the launches of each layer kind's CUDA program (jaxspec.cost.kernels)")
    p.add_argument("--layout", choices=("even", "rules"), default="even",
                   help="analytic: weights split evenly over the devices (default; the serving stacks behind the "
                   "calibration points) or as jaxspec's sharding rules place them (some leaves replicated)")
    p.add_argument("--overlap", type=float, default=0.0,
                   help="analytic: routing overlap of learned routers in [0, 1) (0: independent routing)")
    p.add_argument("--calibrate", action="store_true",
                   help="fit the latency terms to the published points and print each point's residual")
    p.add_argument("--calibration", default=None, metavar="JSON",
                   help="calibration points file (default: the one shipped in jaxspec/cost/)")
    p.add_argument("--tau", type=float, default=None, help="mean accepted length for the projected speedup")
    p.add_argument("--sweep", default=None, metavar="RUNS_JSONL",
                   help="take tau per spec and batch size from `jaxspec sweep` runs.jsonl files (comma-separated; "
                   "mean over datasets; a batch size not swept takes the nearest one)")
    p.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="take tau per spec and batch size from what `jaxspec tune` measured on this checkpoint (its "
                   "tune.json; a batch size not tuned takes the nearest one); without --tau / --sweep / --checkpoint "
                   "the shipped checkpoints/tiny-v4's, said so")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every number as JSON to PATH")
    add_format_argument(p)
    add_weights_args(p)
    p.set_defaults(func=run)


def _taus(path: str) -> dict[tuple[str, int], float]:
    from jaxspec.harness.eval import load_runs

    sums: dict[tuple[str, int], list[float]] = {}
    for r in load_runs(path):
        if r.get("spec", "ar") != "ar" and "tau" in r:
            sums.setdefault((r["spec"], int(r["batch_size"])), []).append(float(r["tau"]))
    if not sums:
        raise ValueError(f"{path} holds no speculative runs with a tau")
    return {key: sum(v) / len(v) for key, v in sums.items()}


def _tuned_taus(folder: str) -> dict[tuple[str, int], float]:
    """(spec, batch) -> tau from the measurements of a checkpoint's tune.json (`jaxspec tune`)."""
    from jaxspec.speculation.auto import load_tuning

    tuning = load_tuning(os.path.expanduser(folder))
    taus = {(m["spec"], int(m["batch"])): float(m["tau"]) for m in tuning.measurements
            if m.get("spec", "ar") != "ar" and m.get("tau") is not None}
    if not taus:
        raise ValueError(f"{folder}: its tune.json holds no speculative measurement with a tau")
    return taus


def shipped_checkpoint() -> str:
    """checkpoints/tiny-v4 of this checkout (where `./run.sh` finds it)."""
    from jaxspec.training.data import checkout_root

    return str(checkout_root() / "checkpoints" / "tiny-v4")


def tau_source(args: argparse.Namespace) -> tuple[dict[tuple[str, int], float], str]:
    """(spec, batch) -> tau, and one line saying where it came from: --tau, --sweep runs, --checkpoint's
    tune.json, else the shipped checkpoint's tune.json when it is there."""
    if args.tau is not None:
        return {}, f"{args.tau:g} for every spec and batch size (--tau)"
    if args.sweep:
        taus: dict[tuple[str, int], float] = {}
        for path in args.sweep.split(","):
            taus.update(_taus(path))
        return taus, f"measured by `jaxspec sweep` ({args.sweep}), mean over datasets, nearest batch size"
    if args.checkpoint is not None:
        return _tuned_taus(args.checkpoint), (f"measured by `jaxspec tune` on {args.checkpoint} (its tune.json), "
                                              "nearest batch size")
    shipped = shipped_checkpoint()
    if os.path.isfile(os.path.join(shipped, "tune.json")):
        return _tuned_taus(shipped), ("measured by `jaxspec tune` on the shipped checkpoints/tiny-v4 (a 15M-parameter "
                                      "model's draft, not this preset's): pass --tau, --sweep or --checkpoint for "
                                      "your own draft")
    return {}, "none (pass --tau, --sweep RUNS_JSONL or --checkpoint PATH): the speculative columns stay '-'"


def run(args: argparse.Namespace, console: Console) -> int:
    from jaxspec.core.config import ModelConfig
    from jaxspec.core.spec import SpecConfig

    if args.calibrate:
        from jaxspec.cli.cost_analytic import run_calibrate

        return run_calibrate(args, console)
    _check_args(args)
    cfg = ModelConfig.preset(args.preset)
    if cfg.v41 is not None and args.draft == "mtp":
        raise ValueError(f"{args.preset} is a V4.1 model: it has no MTP block and drafts with DSpark (--draft dspark)")
    if args.format == "json":  # the tables and notes go nowhere; the numbers to stdout at the end (`emit`)
        console = Console(file=io.StringIO())
    taus, args.tau_source = tau_source(args)
    console.print(f"tau: {args.tau_source}", highlight=False)
    # every spec the tau source measured (per-cycle widths aside), else two defaults
    names = args.specs or (sorted({name for name, _ in taus if "_w" not in name}) if taus else DEFAULT_SPECS)
    specs = [SpecConfig.parse(s) for s in names]
    for spec in specs:
        spec.validate_for(cfg)
    if args.draft == "dspark":
        from jaxspec.cost.terms import check_dspark, default_dspark

        for spec in specs:
            check_dspark(cfg, spec, default_dspark(cfg))
    if args.model == "analytic":
        from jaxspec.cli.cost_analytic import run_analytic

        return run_analytic(args, console, specs, taus)
    return _run_xla(args, console, cfg, specs, taus)


def _check_args(args: argparse.Namespace) -> None:
    """ValueError (one line) on a bad argument shared by both paths."""
    from jaxspec.cost import xla as cost

    positive("devices", args.devices)
    positive("context", args.context)
    for b in args.batch_sizes:
        positive("batch-sizes", b)
    if args.model == "analytic":
        from jaxspec.cost import latency

        latency.hardware(args.accelerator)
    else:
        cost.accelerator(args.accelerator)
    if not 0.0 <= args.overlap < 1.0:
        raise ValueError(f"--overlap must be in [0, 1), got {args.overlap}")
    if args.tau is not None and args.tau < 1:
        raise ValueError(f"--tau must be >= 1 (the bonus token alone), got {args.tau}")
    if sum(x is not None for x in (args.tau, args.sweep, args.checkpoint)) > 1:
        raise ValueError("give one of --tau, --sweep and --checkpoint (where tau comes from)")


def _xla_mesh(args: argparse.Namespace, cfg: Any) -> tuple[Any, tuple[int, int, int]]:
    """-> (the simulated CPU mesh or None for one device, its shape)."""
    import jax

    from jaxspec import sharding

    mesh = None
    shape = sharding.parse_mesh(args.mesh) if args.mesh is not None else sharding.default_mesh_shape(args.devices, cfg)
    if shape[0] * shape[1] * shape[2] != args.devices:
        raise ValueError(f"--mesh {args.mesh} spans {shape[0] * shape[1] * shape[2]} devices but --devices is "
                         f"{args.devices}")
    if args.devices > 1:
        # Per-device costs come from the partitioned HLO, not from running it: skip the slow LLVM
        # work when compiling for the simulated devices (read when jax starts its backends).
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                                   " --xla_llvm_disable_expensive_passes=true").strip()
        try:  # simulate the mesh on CPU devices; only possible before jax starts its backends
            jax.config.update("jax_num_cpu_devices", args.devices)
        except RuntimeError:
            pass
        devices = jax.devices("cpu") if jax.default_backend() == "cpu" else jax.devices()
        if len(devices) < args.devices:
            raise ValueError(f"--devices {args.devices}: this process has {len(devices)} device(s) (jax started "
                             "before the mesh could be simulated)")
        mesh = sharding.make_mesh(*shape)
        for b in args.batch_sizes:
            if b % shape[0]:
                raise ValueError(f"batch size {b} does not divide by the mesh's data axis {shape[0]}")
    return mesh, shape


def _run_xla(args: argparse.Namespace, console: Console, cfg: Any, specs: list, taus: dict) -> int:
    """`--model xla`: XLA's cost analysis of each stage's lowered CPU program and its roofline."""
    from jaxspec.cost import xla as cost
    from jaxspec.cost.terms import default_dspark

    acc = cost.accelerator(args.accelerator)
    overhead_us = cost.DEFAULT_OVERHEAD_US if args.overhead_us is None else args.overhead_us
    if overhead_us < 0:
        raise ValueError(f"--overhead-us must be >= 0, got {overhead_us}")
    mesh, shape = _xla_mesh(args, cfg)

    console.print(f"[bold]jaxspec cost[/]: {args.preset} ({weights_label(cfg, args)}), context {args.context}, "
                  f"{'1 device' if mesh is None else f'mesh data={shape[0]} tensor={shape[1]} expert={shape[2]}'}; "
                  f"{acc.name}: {acc.peak_flops / 1e12:.0f} TFLOP/s, {acc.bandwidth / 1e12:.1f} TB/s "
                  f"(nominal {acc.nominal_bandwidth / 1e12:.1f}), {overhead_us:g} us per forward pass")
    with console.status("lowering") as status:
        rows = cost.project(cfg, specs, args.batch_sizes, args.context, acc, overhead_us * 1e-6, mesh,
                            progress=lambda what: status.update(f"lowering {what}"), weights=args.weights,
                            experts=args.experts, draft=default_dspark(cfg) if args.draft == "dspark" else None)
    table = Table(title="per device, one call" if mesh is not None else "one call")
    for name in ("batch", "spec", "stage", "GFLOP", "GB accessed", "collective MB", "projected ms", "bound"):
        table.add_column(name, justify="left" if name in ("spec", "stage", "bound") else "right")
    ar = {r.batch: r for r in rows if r.spec == "ar"}
    summary = Table(title=f"projected on {acc.name} (a model, not a measurement)")
    for name in ("batch", "spec", "AR ms/step", "cycle ms", "break-even tau", "tau", "speedup vs AR"):
        summary.add_column(name, justify="left" if name == "spec" else "right")
    for r in rows:
        for stage, c in r.costs.items():
            compute, memory = c.flops / acc.peak_flops, c.bytes / acc.bandwidth
            table.add_row(str(r.batch), r.spec, stage, f"{c.flops / 1e9:.2f}", f"{c.bytes / 1e9:.3f}",
                          f"{c.collective_bytes / 1e6:.2f}", f"{1e3 * r.seconds[stage]:.3f}",
                          "memory" if memory >= compute else "compute")
        if r.spec != "ar":
            tau = args.tau if args.tau is not None else taus.get((r.spec, r.batch))
            base = ar[r.batch]
            summary.add_row(str(r.batch), r.spec, f"{1e3 * base.step_seconds:.3f}", f"{1e3 * r.step_seconds:.3f}",
                            f"{r.step_seconds / base.step_seconds:.2f}", "-" if tau is None else f"{tau:.2f}",
                            "-" if tau is None else f"{r.speedup(tau, base):.2f}x")
        table.add_section()
    console.print(compact(table))
    console.print(compact(summary))
    console.print(
        "[dim]Model, not measurement: FLOPs and bytes are XLA's cost analysis of the program as written (before "
        "fusion: a gathered expert is counted as copied and read back; jax.lax.ragged_dot is counted dense over "
        "all groups); projected time = max(FLOPs / peak, bytes / bandwidth) + overhead x forward passes; cycle = "
        "draft + plan + verify + commit; break-even tau = cycle / AR step; speedup = tau x AR step / cycle."
        + (" On a mesh, FLOPs and collectives are the partitioned program's (compiled for a float32 twin on "
           "simulated CPU devices, collectives scaled to the model's dtype) and bytes scale with the device's "
           "share of the FLOPs." if mesh is not None else "") + "[/]"
    )
    emit(args, {"model": "xla", "preset": args.preset, "weights": args.weights, "experts": args.experts,
                "context": args.context, "mesh": list(shape), "accelerator": acc.name, "overhead_us": overhead_us,
                "tau_source": args.tau_source, "rows": [
                    {"batch": r.batch, "spec": r.spec, "step_seconds": r.step_seconds,
                     "tau": args.tau if args.tau is not None else taus.get((r.spec, r.batch)),
                     "stages": {k: {"flops": c.flops, "bytes": c.bytes, "collective_bytes": c.collective_bytes,
                                    "passes": c.passes, "seconds": r.seconds[k]} for k, c in r.costs.items()}}
                    for r in rows]})
    return 0

