"""`jaxspec plan`: per-device bytes of parameters and decode state on a mesh, from abstract shapes; with
`--prefill`, XLA's temporaries of the chunked prefill program too."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from jaxspec.cli.common import add_weights_args, positive, weights_label
from jaxspec.cli.tables import add_format_argument, compact, print_json

DEVICE_GIB = 140.0  # an H200 as nvidia-smi reports it (143,771 MiB)
# DeepSeek-V4-Flash's DSpark drafter as released (its config.json's dspark_* keys; jaxspec.core.dspark).
def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="per-device memory of parameters and decode state on a mesh",
        description="Per-device bytes of the parameters and of the decode state (batch sequences of "
        "`--context` tokens) under the default sharding rules, from abstract shapes (no devices needed).",
    )
    p.add_argument("--preset", default="v4-flash", help="model preset (default v4-flash)")
    p.add_argument("--devices", type=int, default=8, help="number of devices (default 8)")
    p.add_argument("--mesh", default=None, metavar="D,T,E", help="data,tensor,expert sizes (default: by devices)")
    p.add_argument("--batch", type=int, default=16, help="sequences decoded together (default 16)")
    p.add_argument("--context", type=int, default=65536, help="tokens per sequence (default 65536)")
    p.add_argument("--prefill", action="store_true",
                   help="also compile the chunked prefill of `--context` tokens (abstract shapes, simulated CPU "
                   "devices) and report XLA's temporaries per device (minutes for a large model)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prefill chunk, a power of two (default: jaxspec.model.prefill.prefill_chunk of the preset)")
    p.add_argument("--draft", choices=("mtp", "dspark"), default="mtp",
                   help="the draft to count: the model's own MTP block, or the DSpark drafter DeepSeek released "
                   "(block 5, 3 stages, rank 256; v4-flash: target layers 40-42, v41-flash: 37-39 and the stages' "
                   "own 128 experts) with its per-stage rings")
    p.add_argument("--device-memory", type=float, default=DEVICE_GIB, metavar="GIB",
                   help="memory of one device, for the fits / does-not-fit verdict (default 140: an H200; an "
                   "H100 has 80)")
    add_weights_args(p, default="fp8")
    add_format_argument(p)
    p.set_defaults(func=run)


def _simulate_devices(n: int) -> None:
    """Simulated CPU devices for the prefill's compile (only before jax starts its backends)."""
    import os

    import jax

    # Only the buffer assignment is read: skip the slow LLVM work (read when jax starts its backends).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true").strip()
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass
    devices = jax.devices("cpu") if jax.default_backend() == "cpu" else jax.devices()
    if len(devices) < n:
        raise ValueError(f"--devices {n}: this process has {len(devices)} device(s) (jax started before the mesh "
                         "could be simulated)")


def _prefill_memory(args: argparse.Namespace, cfg: Any, shape: tuple[int, int, int], batch: int) -> Any:
    """XLA's memory analysis of the prefill program on `shape`."""
    from jaxspec import sharding
    from jaxspec.model.prefill_plan import prefill_memory

    mesh = sharding.make_mesh(*shape) if args.devices > 1 else None
    return prefill_memory(cfg, batch, args.context, args.prefill_chunk, mesh=mesh, weights=args.weights,
                          experts=args.experts)


def run(args: argparse.Namespace, console: Console) -> int:
    from jaxspec import sharding
    from jaxspec.core.config import ModelConfig
    from jaxspec.model.placement import memory_plan

    positive("devices", args.devices)
    positive("batch", args.batch)
    positive("context", args.context)
    if not args.device_memory > 0:
        raise ValueError(f"--device-memory must be > 0 GiB, got {args.device_memory}")
    if args.prefill_chunk is not None:
        from jaxspec.model.prefill import check_chunk

        check_chunk(args.prefill_chunk)
    cfg = ModelConfig.preset(args.preset)
    draft = None
    if args.draft == "dspark":
        if not args.preset.startswith(("v4-flash", "v41-flash")):
            raise ValueError(f"--draft dspark counts the DSpark drafter DeepSeek released for V4-Flash and "
                             f"V4.1-Flash; --preset {args.preset} has none known (use --preset v4-flash / v41-flash, "
                             "or --draft mtp)")
        from jaxspec.cost.terms import default_dspark

        draft = default_dspark(cfg)
    if args.prefill and args.devices > 1:
        _simulate_devices(args.devices)
    if args.mesh is None:
        shape = sharding.default_mesh_shape(args.devices, cfg)
    else:
        shape = sharding.parse_mesh(args.mesh)
        used = shape[0] * shape[1] * shape[2]
        if used != args.devices:
            raise ValueError(f"--mesh {args.mesh} spans {used} devices but --devices is {args.devices}")
    plan = memory_plan(cfg, shape, args.batch, args.context, weights=args.weights, experts=args.experts, draft=draft)
    temp = None
    if args.prefill:
        with console.status("compiling the prefill program"):
            pm = _prefill_memory(args, cfg, shape, plan.batch)
        temp = (pm.chunk, pm.temp_bytes)
    gib = 2.0**30
    peak = plan.bytes_per_device + (temp[1] if temp else 0)
    fits = peak <= args.device_memory * gib
    what = "its MTP block" if args.draft == "mtp" else "its DSpark drafter"
    if draft is None and not cfg.has_mtp:
        what = "none (no MTP block; --draft dspark counts its DSpark drafter)"
    if args.format == "json":
        print_json({
            "preset": args.preset, "weights": args.weights, "experts": args.experts, "draft": args.draft,
            "devices": args.devices, "mesh": list(shape), "batch": plan.batch, "context": plan.context,
            "per_device": {"parameters": dict(plan.param_groups), "decode_state": dict(plan.state_groups),
                           "parameter_bytes": plan.param_bytes, "decode_state_bytes": plan.state_bytes,
                           "prefill_temporary_bytes": temp[1] if temp else None, "total_bytes": peak},
            "device_memory_gib": args.device_memory, "fits": fits,
            "unsharded": {"parameter_bytes": plan.total_param_bytes, "decode_state_bytes": plan.total_state_bytes},
        })
        return 0
    console.print(
        f"[bold]jaxspec plan[/]: {args.preset} ({weights_label(cfg, args)}; draft: {what}) on {args.devices} "
        f"devices, mesh data={shape[0]} tensor={shape[1]} expert={shape[2]}; batch {plan.batch}, context "
        f"{plan.context}", highlight=False)
    table = Table(title="per device")
    table.add_column("what")
    table.add_column("bytes", justify="right")
    table.add_column("GiB", justify="right")
    for title, groups in (("parameters", plan.param_groups), ("decode state", plan.state_groups)):
        for name, n in groups.items():
            table.add_row(f"{title}: {name}", f"{n:,}", f"{n / gib:.3f}")
    console.print(compact(table))
    for name, n in (("parameters", plan.param_bytes), ("decode state", plan.state_bytes),
                    ("total", plan.bytes_per_device)):
        console.print(f"{name} per device: {n:,} bytes ({n / gib:.2f} GiB)", highlight=False)
    if temp:
        console.print(
            f"prefill ({temp[0]}-token chunks, {plan.context} tokens) temporaries per device: {temp[1]:,} "
            f"bytes ({temp[1] / gib:.2f} GiB, XLA memory analysis); peak with parameters and decode state: "
            f"{peak / gib:.2f} GiB", highlight=False)
    used = peak / (args.device_memory * gib)
    share = f"{peak / gib:.2f} of {args.device_memory:g} GiB per device ({100 * used:.0f}%)"
    if fits:
        console.print(f"[green]fits[/] on every device: {share}; activations and the speculation scratch come on top "
                      "(a few GiB): keep some headroom", highlight=False)
    else:
        console.print(f"[bold red]does not fit[/]: {share}; spread it over more devices (--devices / --mesh), keep the "
                      "weights as released (--weights fp8), or lower --batch / --context", highlight=False)
    console.print(
        f"[dim]unsharded: parameters {plan.total_param_bytes / gib:.1f} GiB, decode state "
        f"{plan.total_state_bytes / gib:.1f} GiB; "
        f"{'decode activations' if args.prefill else 'activations'} and the speculation scratch are not included[/]"
    )
    return 0
