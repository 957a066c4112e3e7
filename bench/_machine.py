"""What every benchmark prints and records about the machine it ran on."""

from __future__ import annotations

import os
import platform
from typing import Any

import jax


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
