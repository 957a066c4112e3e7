"""What a cycle costs, two ways. XLA's own count of a jitted program's flops and bytes on abstract
shapes (`xla`). The analytic model: every stage of a cycle (with the MTP draft or a DSpark drafter) as
named terms a person can check by hand (`terms`), routed experts per device (`routing`), latency terms
(`latency`) fitted to published H200 points (`fit`), kernel launches (`kernels`), overlap (`overlap`),
parameter inventory (`inventory`) and projection rows (`project`). See docs/cost_model.md."""

from jaxspec.cost.latency import H200, HARDWARE, Latency, hardware
from jaxspec.cost.project import projected_seconds
from jaxspec.cost.terms import STAGES, Costs, Setup, check_setup, default_dspark, stage_table

__all__ = ["H200", "HARDWARE", "STAGES", "Costs", "Latency", "Setup", "check_setup", "default_dspark", "hardware",
           "projected_seconds", "stage_table"]
