"""Seconds from the stage table: a roofline of the busiest device plus latency terms a person can
multiply out by hand (docs/cost_model.md):

    t = max(FLOPs / peak, busiest bytes / HBM bandwidth)            (roofline)
      + sum over unit passes of kernels[kind] x launch_us           (launch term)
      + sum over collectives of (collective_us + bytes / link bw)   (collective term)
      + passes x pass_us                                            (host dispatch per forward)

Linear in (launch_us, collective_us), which is what `calibrate` fits.
"""

from __future__ import annotations

import dataclasses

from jaxspec.cost.terms import Costs


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # FLOP/s, dense bf16
    bandwidth: float  # HBM bytes/s a decode kernel reaches (a measured copy rate, below nominal)
    link_bandwidth: float  # bytes/s one GPU sends over NVLink, one direction


HARDWARE = {
    # H200 SXM: 989 TFLOP/s dense bf16; 4.8 TB/s HBM3e nominal, ~4.3 TB/s by a device copy; NVLink 4:
    # 18 links x 50 GB/s = 900 GB/s bidirectional, 450 GB/s each way.
    "h200": Hardware("NVIDIA H200", 989e12, 4.3e12, 450e9),
    # B200: 2.25 PFLOP/s dense bf16; 8 TB/s HBM3e nominal, 7.2 used (the H200's 90% of nominal);
    # NVLink 5: 18 links x 100 GB/s = 1.8 TB/s bidirectional, 900 GB/s each way.
    "b200": Hardware("NVIDIA B200", 2250e12, 7.2e12, 900e9),
}

# Kernels one pass through a unit launches (a parameter: counted by hand from the layer's ops as
# a fused GPU program would run them; docs/cost_model.md lists them).
# A draft step also launches its MTP input kernels ("mtp_in": embedding gather, hnorm, h_proj, enorm,
# e_proj) and its selection kernels ("draft_sample": log-softmax max and sum, vocab top-k, scratch kv
# and position scatters; "draft_expand", every step but the last: top-k of the step's candidates,
# gathers of the next inputs and streams), counted from speculation/mtp.py, speculation/tree.py and layers/mtp.py.
# A DSpark cycle (speculation/dspark.py, model/dspark.py): the block's embedding gather and hc expand
# ("dspark_in"); per Markov step, "markov": the W1 row gather, the rank-r product with the base-logit add,
# log-softmax max and sum, the vocab top-k and the confidence head; in the verify one hc-mean per captured
# layer ("capture"); in the commit main_proj and main_norm ("dspark_ctx") and per stage wkv, kv_norm +
# RoPE and the ring write ("dspark_kv").
# V4.1's compressed layers by role, by analogy with V4's counts (not fitted, not counted from a program):
# "reuse" a window layer plus the gather of the picked entries (23); "owner" the compressor, index keys
# and indexer of a CSA layer (34); "reindex" the indexer without compressor (28); an Engram layer adds
# "engram" (class map gather, hash, row gather, wkv, gate norms and dot, add: 6), the candidate source
# "candidates" (block maxima, block top-k, mask: 3).
DEFAULT_KERNELS = {"sliding": 22, "hca": 26, "csa": 34, "head": 4, "mtp_kv": 6, "mtp_in": 5, "draft_sample": 5,
                   "draft_expand": 3, "dspark_in": 1, "markov": 6, "capture": 1, "dspark_ctx": 2, "dspark_kv": 3,
                   "reuse": 23, "owner": 34, "reindex": 28, "engram": 6, "candidates": 3}


@dataclasses.dataclass(frozen=True)
class Latency:
    launch_us: float  # per kernel launch (with CUDA graphs: the gap between kernels)
    collective_us: float  # fixed latency of one all-reduce / all-to-all / all-gather
    pass_us: float = 20.0  # host dispatch per forward pass
    kernels: tuple[tuple[str, int], ...] = tuple(DEFAULT_KERNELS.items())


PRIOR = Latency(launch_us=3.0, collective_us=10.0)  # before calibration (docs/cost_model.md)
# `jaxspec cost --calibrate` on jaxspec/cost/calibration_points.json (tests/test_costmodel.py
# refits and checks these).
H200 = Latency(launch_us=4.35, collective_us=11.5)


def hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise ValueError(f"unknown accelerator {name!r}; known: {sorted(HARDWARE)}")
    return HARDWARE[name]


def split(c: Costs, hw: Hardware, lat: Latency) -> dict[str, float]:
    """-> seconds per term: roofline, launch, collective latency, collective bytes, dispatch."""
    kernels = dict(lat.kernels)
    launches = sum(kernels.get(kind, 0) * n for kind, n in c.layer_passes.items())
    count = sum(n for n, _ in c.collectives.values())
    sent = sum(b for _, b in c.collectives.values())
    return {
        "roofline": max(c.total_flops / hw.peak_flops, c.busiest_bytes / hw.bandwidth),
        "launch": launches * lat.launch_us * 1e-6,
        "collective_latency": count * lat.collective_us * 1e-6,
        "collective_bytes": sent / hw.link_bandwidth,
        "dispatch": c.passes * lat.pass_us * 1e-6,
    }


def seconds(c: Costs, hw: Hardware, lat: Latency) -> float:
    return sum(split(c, hw, lat).values())


def linear_parts(c: Costs, hw: Hardware, lat: Latency) -> tuple[float, float, float]:
    """-> (seconds not fitted, launches, collectives): t = rest + launch_us*1e-6*L + collective_us*1e-6*C."""
    parts = split(c, hw, lat)
    kernels = dict(lat.kernels)
    launches = sum(kernels.get(kind, 0) * n for kind, n in c.layer_passes.items())
    count = sum(n for n, _ in c.collectives.values())
    return parts["roofline"] + parts["collective_bytes"] + parts["dispatch"], float(launches), float(count)
