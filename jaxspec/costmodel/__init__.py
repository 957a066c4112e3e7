"""The analytic cost model: every stage of a cycle as named terms a person can check by hand
(`terms`), routed experts per device (`routing`), latency terms (`latency`) fitted to published
H200 points (`calibrate`), and projection rows (`project`). See docs/cost_model.md."""

from jaxspec.costmodel.latency import H200, HARDWARE, Latency, hardware
from jaxspec.costmodel.project import projected_seconds
from jaxspec.costmodel.terms import STAGES, Costs, Setup, check_setup, stage_table

__all__ = ["H200", "HARDWARE", "STAGES", "Costs", "Latency", "Setup", "check_setup", "hardware",
           "projected_seconds", "stage_table"]
