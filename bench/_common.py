"""What every benchmark shares: the machine it ran on, the flags every script has, the console,
argument checks and the JSON record.

The scripts import it as `_common` (their own folder is on `sys.path` when run as
`python bench/<script>.py`; `kernels.py`, which the tests load by path, adds the folder itself).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
from rich.console import Console

# ---------------------------------------------------------------------------------------------
# Machine facts
# ---------------------------------------------------------------------------------------------


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def machine_facts() -> dict[str, Any]:
    """Backend, devices and jax version, for a benchmark's JSON record."""
    backend = jax.default_backend()
    devices = jax.devices()
    return {
        "backend": backend,
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind if devices else "?",
        "cpu_numbers": backend == "cpu",
        "cpu_cores_usable": usable_cores(),
        "jax_version": jax.__version__,
    }


def machine_header(facts: dict[str, Any], cpu_caveat: str) -> str:
    """Rich markup: the backend line, plus a warning that CPU numbers are not `cpu_caveat`."""
    header = (f"backend: {facts['backend']}  devices: {', '.join(facts['devices'])} ({facts['device_kind']})  "
              f"jax {facts['jax_version']}")
    if facts["cpu_numbers"]:
        header += (f"\n[bold yellow]CPU numbers[/] ({facts['cpu_cores_usable']} cores usable, {platform.machine()}): "
                   f"not representative of {cpu_caveat}")
    return header


# ---------------------------------------------------------------------------------------------
# Command line, console, JSON
# ---------------------------------------------------------------------------------------------


def parser(doc: str, preset: str | None = "tiny", preset_help: str | None = None,
           seed_help: str = "random seed") -> argparse.ArgumentParser:
    """An ArgumentParser described by `doc`'s first paragraph, with the flags every bench has:
    --preset (default `preset`), --json PATH and --seed (default 0). Scripts add their own."""
    p = argparse.ArgumentParser(description=" ".join(doc.strip().split("\n\n")[0].split()))
    p.add_argument("--preset", default=preset,
                   help=preset_help or f"model config preset (default {preset})")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--seed", type=int, default=0, help=f"{seed_help} (default 0)")
    return p


def check_positive(p: argparse.ArgumentParser, args: argparse.Namespace, names: Iterable[str]) -> None:
    """`p.error` (exit 2) unless every attribute in `names` (an int, or a list of ints) is >= 1."""
    for name in names:
        value = getattr(args, name)
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, list | tuple):
            if any(v < 1 for v in value):
                p.error(f"{flag} values must be >= 1")
        elif value < 1:
            p.error(f"{flag} must be >= 1")


def console() -> Console:
    """A rich Console; when the output is not a terminal (piped, logged) at least 160 columns wide,
    so tables are not squeezed into 80."""
    c = Console()
    return c if c.is_terminal else Console(width=max(c.width, 160))


def write_json(path: str | os.PathLike | None, result: Any, console: Console | None = None) -> None:
    """Write `result` as indented JSON to `path` (nothing when `path` is None) and say so on `console`."""
    if not path:
        return
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    if console is not None:
        console.print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------
# Whole generations, one prompt at a time
# ---------------------------------------------------------------------------------------------


def prompt_rounds(methods: Iterable[str], prompts: Sequence[Any], call: Callable[[str, Any], Mapping[str, Any]],
                  repeats: int) -> tuple[dict[str, list[Any]], dict[str, float], dict[str, Any]]:
    """Every method once on every prompt (compiles; its records kept), then `repeats` timed rounds, each
    going over the prompts with every method round-robin on each, under a `measure.Watch`. `call(method,
    prompt)` -> a `harness.eval.run_batch` record ("seconds", "stats"); one method must be "ar".
    -> (the first pass's records per method, seconds per method: the median over rounds summed over the
    prompts, the verdict with "ar"'s rounds as the reference)."""
    import numpy as np

    from jaxspec.core import measure

    methods = list(methods)
    first = {m: [call(m, p) for p in prompts] for m in methods}
    seconds = {m: np.zeros((repeats, len(prompts))) for m in methods}
    with measure.Watch() as watch:
        for r in range(repeats):
            for i, p in enumerate(prompts):
                for m in methods:
                    seconds[m][r, i] = call(m, p)["seconds"]
    total = {m: float(np.median(seconds[m], axis=0).sum()) for m in methods}
    return first, total, watch.verdict(measure.Timing(tuple(seconds["ar"].sum(axis=1))))


# ---------------------------------------------------------------------------------------------
# One cycle, as the loop builds it
# ---------------------------------------------------------------------------------------------


def cycle_of(params: Any, cfg: Any, spec: Any, draft: Any = None, rule: str = "greedy") -> tuple[Any, Any]:
    """(Speculator, Models) of a cycle of `spec` as `speculative_generate` builds it: `draft` (a
    `load_checkpoint(...).draft`; None = the MTP block of `params`, uncalibrated), ranked by the draft's
    calibration where it has one (the spec's scores resolved as the loop resolves them)."""
    from jaxspec.core.spec import SpecConfig
    from jaxspec.model.network import Models
    from jaxspec.speculation.cycle import Speculator
    from jaxspec.speculation.generate import calibration_of, draft_of
    from jaxspec.speculation.policy import Policy
    from jaxspec.speculation.values import resolve_scores

    draft = draft_of(params, cfg, draft)
    spec = SpecConfig.parse(spec) if isinstance(spec, str) else spec
    spec.validate_for(cfg)
    draft.drafter.check(cfg, spec)
    spec, values = resolve_scores(spec, calibration_of(draft, None, spec, cfg))
    return (Speculator(cfg, spec, draft.drafter, Policy(rule, values)),
            Models(target=params.replace(mtp=None), drafter=draft.params))
