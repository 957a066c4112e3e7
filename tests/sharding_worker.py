"""Runs in its own process with 8 simulated CPU devices (see tests/test_sharding_8dev.py).

    python tests/sharding_worker.py OUT.json [--meshes 2,2,2 1,2,4 8,1,1 1,8,1] [--long]

Generates with the `test`-style model (8 heads, 8 o_groups, 8 experts) on one device, then on
each mesh, and writes per-mesh tokens and HLO findings as JSON for the test to assert on.
"""

from __future__ import annotations

import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import json  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxspec as js  # noqa: E402
from jaxspec import sharding  # noqa: E402
from jaxspec.model import placement, runner  # noqa: E402
from jaxspec.model.sampling import Sampling  # noqa: E402
from jaxspec.speculation.generate import LoopShape, _speculative_loop  # noqa: E402
from jaxspec.speculation.inputs import length_bucket, prepare_prompts  # noqa: E402
from jaxspec.testing import mtp_models, mtp_speculator  # noqa: E402

# 8 heads / groups / experts split on every mesh; CSA (hash-routed) + HCA layers, MTP (sliding).
CFG = js.ModelConfig.preset(
    "test", num_heads=8, o_groups=8, n_routed_experts=8, num_layers=2, layer_types=("csa", "hca")
)
PROMPTS = [[5, 17, 3, 9, 60], [7, 8, 9], [int(t) for t in np.random.default_rng(0).integers(0, 96, 19)]]
NEW_TOKENS = 12
SPEC = js.SpecConfig.parse("s2_k2_d4")
COLLECTIVE_OP = re.compile(
    r"=\s+(\S+\[[\d,]*\])\S*\s+(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
)
GROUPS = re.compile(
    r"replica_groups=(\{[\d,{}]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
    r"|mesh\[[^\]]*\](?:, device_ids=\([^)]*\)\)?)? \{[^}]*\})"
    r"|source_target_pairs=(\{[\d,{}]*\})"
)


def _params():
    from jaxspec.testing import randomize

    return randomize(js.init_params(CFG, jax.random.key(0)), jax.random.key(1))


def _iota(text: str) -> np.ndarray:
    """[dims]T(perm) / [shape]<=[dims]T(perm) iota device lists -> array of ids."""
    m = re.fullmatch(r"(?:\[([\d,]+)\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(-1) if m.group(1) is None else ids.reshape([int(x) for x in m.group(1).split(",")])


def _groups(text: str) -> list[list[int]]:
    """One HLO collective's replica_groups / source_target_pairs -> lists of partition ids.

    Forms: explicit {{0,1},{2,3}}; iota [G,S]<=[dims]T(perm); mesh['axis_0'=2,'axis_1'=4] {'axis_1'},
    optionally with device_ids=([dims]T(perm)) (else devices numbered row-major over the axes); one
    group per setting of the axes not named in braces.
    """
    if text.startswith("mesh["):
        head, named = text.rsplit(" {", 1)
        axes = re.findall(r"'(\w+)'=(\d+)", head.split("]", 1)[0])
        names, dims = [a for a, _ in axes], [int(n) for _, n in axes]
        device_ids = re.search(r"device_ids=\((.*)\)", head)
        ids = (_iota(device_ids.group(1)) if device_ids else np.arange(int(np.prod(dims)))).reshape(dims)
        grouped = [names.index(a) for a in re.findall(r"'(\w+)'", named)]
        rest = [i for i in range(len(dims)) if i not in grouped]
        size = int(np.prod([dims[i] for i in grouped], dtype=int))
        return ids.transpose(rest + grouped).reshape(-1, size).tolist()
    if text.startswith("["):
        return _iota(text).tolist()
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", text)]


def hlo_findings(hlo: str, mesh, params, cfg, specs=None) -> dict:
    """Collectives of a compiled program: which cross data shards, which gather a full parameter."""
    per_data = mesh.shape["tensor"] * mesh.shape["expert"]
    specs = placement.param_specs(cfg, mesh) if specs is None else specs
    full_param_shapes = set()
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    for x, spec in zip(jax.tree.leaves(params), flat_specs, strict=True):
        if any(e is not None for e in spec):  # a split parameter: gathering it whole is the bug
            dtype = {"float32": "f32", "bfloat16": "bf16", "int32": "s32"}[str(x.dtype)]
            full_param_shapes.add(f"{dtype}[{','.join(map(str, x.shape))}]")
    kinds: dict[str, int] = {}
    cross_data, param_gathers = [], []
    unparsed = []
    for line in hlo.splitlines():
        m = COLLECTIVE_OP.search(line)
        if not m:
            continue
        shape, kind = m.group(1), m.group(2)
        kinds[kind] = kinds.get(kind, 0) + 1
        if kind == "all-gather" and shape in full_param_shapes:
            param_gathers.append(shape)
        g = GROUPS.search(line)
        if not g:
            unparsed.append(line.strip()[:300])
            continue
        if any(len({p // per_data for p in group}) > 1 for group in _groups(g.group(1) or g.group(2))):
            cross_data.append(f"{kind} {shape}")
    return {"kinds": kinds, "cross_data": cross_data, "param_gathers": param_gathers,
            "num_split_params": len(full_param_shapes), "unparsed": unparsed}


def controls() -> dict:
    """The detectors must fire on programs that do what the model must not."""
    mesh = js.make_mesh(2, 4, 1)
    w = jax.ShapeDtypeStruct((16, 256), jnp.float32)
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tensor"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    gather = jax.jit(lambda x: x * 2, in_shardings=split, out_shardings=whole).lower(w).compile().as_text()
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    cross = jax.jit(lambda x: x.sum(0), in_shardings=rows, out_shardings=whole).lower(w).compile().as_text()
    fake_params = {"w": w}
    specs = {"w": jax.sharding.PartitionSpec(None, "tensor")}
    return {
        "param_gather": hlo_findings(gather, mesh, fake_params, None, specs)["param_gathers"],
        "cross_data": hlo_findings(cross, mesh, fake_params, None, specs)["cross_data"],
    }


def checkpoints(params, mesh) -> dict:
    """orbax and safetensors loads straight into the mesh's parameter shardings."""
    from jaxspec.checkpoint import save_hf_checkpoint

    want = placement.param_shardings(CFG, mesh)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        js.save_checkpoint(os.path.join(tmp, "orbax"), CFG, params)
        _, loaded, _ = js.load_checkpoint(os.path.join(tmp, "orbax"), mesh=mesh)
        save_hf_checkpoint(os.path.join(tmp, "hf"), CFG, params)
        _, hf_loaded = js.load_hf_checkpoint(os.path.join(tmp, "hf"), mesh=mesh)
        for name, tree in (("orbax", loaded), ("safetensors", hf_loaded)):
            leaves = jax.tree.leaves(tree)
            out[name] = {
                "shardings": all(
                    x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(leaves, jax.tree.leaves(want), strict=True)
                ),
                "equal": all(
                    np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(leaves, jax.tree.leaves(params), strict=True)
                ),
                "split_leaves": sum(len({d for d in x.sharding.device_set}) > 1 and not x.sharding.is_fully_replicated
                                    for x in leaves),
            }
    return out


def kernel_per_shard(mesh) -> dict:
    """A Pallas kernel (interpret mode) run per shard by shard_kernel equals the unsharded call."""
    from jax.experimental import pallas as pl

    def call(q, k, extra, *, bias, scale):  # q [B,T,H,c], k [B,T,1,c], extra {"m": [B,T]}, bias [H, 1]
        def kernel(q_ref, k_ref, m_ref, b_ref, o_ref):
            o_ref[...] = q_ref[...] * scale + k_ref[...] + m_ref[...][:, :, None, None] + b_ref[...]

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), interpret=True)(
            q, k, extra["m"], bias)

    sharded_call = sharding.shard_kernel(
        call, [("batch", None, "heads", None), ("batch", None, None, None), None], ("batch", None, "heads", None),
        kw_axes={"bias": ("heads", None)},
    )

    @jax.jit
    def program(q, k, m, bias):
        return sharded_call(q, k, {"m": m}, bias=bias, scale=2.0)

    key = jax.random.split(jax.random.key(3), 4)
    # batch 4, 8 heads (a leading dim equal to the batch would be taken as batch-split)
    q, k = jax.random.normal(key[0], (4, 3, 8, 16)), jax.random.normal(key[1], (4, 3, 1, 16))
    m, bias = jax.random.normal(key[2], (4, 3)), jax.random.normal(key[3], (8, 1))
    args = (q, k, m, bias)
    got = runner.run_sharded(program, mesh, args, batch=4, cfg=CFG)
    text = runner.lower_program(program, mesh, args, batch=4, cfg=CFG).as_text()
    want = call(q, k, {"m": m}, bias=bias, scale=2.0)
    return {"equal": bool(np.array_equal(np.asarray(got), np.asarray(want))),
            "shard_map": "shard_map" in text or "sdy.manual_computation" in text}


def pallas_loop(params, mesh) -> dict:
    """The speculative loop with the Pallas tree-attention kernel (interpret mode on CPU), which
    shard_kernel runs per tensor shard on its own heads: tokens equal the one-device run."""
    cfg = CFG.replace(kernels="pallas")
    one = js.speculative_generate(params, cfg, PROMPTS[:2], SPEC, max_new_tokens=6)
    placed = js.shard_params(params, cfg, mesh)
    many = js.speculative_generate(placed, cfg, PROMPTS[:2], SPEC, max_new_tokens=6, mesh=mesh)
    return {"one_device": one.tokens.tolist(), "mesh": many.tokens.tolist()}


def dspark_run(params, mesh) -> dict:
    """A DSpark tree (`testing.agreeing_dspark`: drafts accepted at every depth) on the mesh and unsharded."""
    from jaxspec.core.dspark import DSparkConfig
    from jaxspec.speculation.dspark import dspark_draft
    from jaxspec.testing import agreeing_dspark

    dcfg = DSparkConfig(block_size=4, noise_token_id=CFG.vocab_size - 1, target_layers=(0, 1),
                        markov_rank=CFG.hidden_size, num_stages=1)
    draft = dspark_draft(agreeing_dspark(params, CFG, dcfg, jax.random.key(5)), dcfg)
    one = js.speculative_generate(params, CFG, PROMPTS, "s3_k2_d6", max_new_tokens=NEW_TOKENS, draft=draft)
    placed = js.speculative_generate(params, CFG, PROMPTS, "s3_k2_d6", max_new_tokens=NEW_TOKENS, draft=draft,
                                     mesh=mesh)
    return {"single": one.tokens.tolist(), "sharded": placed.tokens.tolist(),
            "tau": one.stats["mean_accepted_length"]}


def v41_dspark_run(mesh) -> dict:
    """DeepSeek-V4.1 (v41-test: every layer kind, Engram, shared pools, candidates; continuous) with its own
    DSpark drafter right about half the time (`testing.v41_mixed_acceptance`), a K = 2 tree on the mesh and
    unsharded."""
    import dataclasses

    from jaxspec.core.dspark import DSparkConfig
    from jaxspec.speculation.dspark import dspark_draft
    from jaxspec.testing import v41_mixed_acceptance

    cfg = js.ModelConfig.preset("v41-test", dtype="float32")
    cfg = cfg.replace(v41=dataclasses.replace(cfg.v41, qat=False))
    dcfg = DSparkConfig(block_size=5, noise_token_id=cfg.vocab_size - 1, target_layers=(5, 6, 7),
                        markov_rank=cfg.hidden_size)
    params, dp = v41_mixed_acceptance(js.init_params(cfg, jax.random.key(0)), cfg, dcfg, jax.random.key(1))
    draft = dspark_draft(dp, dcfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (9, 14, 21, 6)]
    one = js.speculative_generate(params, cfg, prompts, "s4_k2_d8", max_new_tokens=16, draft=draft)
    many = js.speculative_generate(js.shard_params(params, cfg, mesh), cfg, prompts, "s4_k2_d8", max_new_tokens=16,
                                   draft=draft, mesh=mesh)
    ref = js.generate(params, cfg, prompts, max_new_tokens=16)
    return {"single": one.tokens.tolist(), "sharded": many.tokens.tolist(), "generate": ref.tokens.tolist(),
            "tau": one.stats["mean_accepted_length"]}


def harness_run(params, mesh) -> dict:
    """What `jaxspec calibrate / sweep / tune --mesh` run: calibration's chain-cycle records and a sweep
    batch (`run_batch` given the mesh) on the mesh and on one device."""
    from jaxspec.harness.calibrate import collect
    from jaxspec.harness.eval import run_batch

    placed = js.shard_params(params, CFG, mesh)
    one = collect(params, CFG, PROMPTS, 0.0, cycles=3, batch_size=4, num_steps=3, topk=2)
    many = collect(placed, CFG, PROMPTS, 0.0, cycles=3, batch_size=4, num_steps=3, topk=2, mesh=mesh)
    batch_one = run_batch(params, CFG, None, PROMPTS, NEW_TOKENS)
    batch_mesh = run_batch(placed, CFG, None, PROMPTS, NEW_TOKENS, devices=mesh)
    return {"collect_equal": sorted(one) == sorted(many) and all(
                np.allclose(one[k], many[k], atol=1e-5) for k in one),
            "nodes": int(one["label"].size),
            "run_batch_equal": batch_one["tokens"].tolist() == batch_mesh["tokens"].tolist(),
            "run_batch_devices": batch_mesh["devices"]}


def v41_release_run(mesh) -> dict:
    """A tiny V4.1 release folder (official names and formats, `testing.write_v41_release`) loaded over the mesh
    (each leaf placed shard by shard) and on one device: the same leaves, each in its declared sharding, the
    same prefill logits and DSpark drafter; with weights "fp8" too (values and scales of each stored leaf
    placed by the leaf's axes)."""
    import tempfile

    from jaxspec.testing import write_v41_release

    with tempfile.TemporaryDirectory() as folder:
        write_v41_release(folder)
        one = js.load_release(folder, dtype="float32")
        many = js.load_release(folder, dtype="float32", mesh=mesh)
        stored = js.load_release(folder, dtype="float32", mesh=mesh, weights="fp8")  # BlockScaled leaves too
    cfg = one.cfg

    def placed(params):
        want = placement.param_shardings(cfg, mesh, params=params)
        return all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(
            jax.tree.leaves(params), jax.tree.leaves(want), strict=True))

    in_place = placed(many.params) and placed(stored.params) and placed(stored.draft.params)
    split = sum(len({d for d in x.sharding.device_set}) == 8 and not x.sharding.is_fully_replicated
                for x in jax.tree.leaves(many.params))
    pairs = zip(jax.tree.leaves((one.params, one.draft.params)), jax.tree.leaves((many.params, many.draft.params)),
                strict=True)
    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in pairs)  # bitwise: NaN padding too
    tokens = np.asarray([[5, 9, 14, 3, 7, 11, 2, 8, 6, 12, 4, 10]])
    single = np.asarray(js.prefill_logits(one.params, cfg, tokens))
    diff = max(np.max(np.abs(np.asarray(js.prefill_logits(p.params, cfg, tokens, mesh=mesh)) - single))
               for p in (many, stored))
    return {"in_place": bool(in_place), "split_leaves": int(split), "same_leaves": bool(same),
            "prefill_max_abs_diff": float(diff), "draft": many.draft is not None}


def main() -> None:
    from jaxspec.testing import high_acceptance

    out_path = sys.argv[1]
    named = [m for m in sys.argv[3:] if m != "--long"] if "--meshes" in sys.argv else [
        "2,2,2", "1,2,4", "8,1,1", "1,8,1"]
    meshes = [tuple(int(x) for x in m.split(",")) for m in named]
    params = high_acceptance(_params())  # drafts are accepted at every depth: the tree commit runs
    prefill_tokens = np.asarray([PROMPTS[2][:16], PROMPTS[2][3:19]])
    result: dict = {"devices": len(jax.devices()), "meshes": {}}
    t0 = time.perf_counter()
    ref = js.generate(params, CFG, PROMPTS, max_new_tokens=NEW_TOKENS)
    # accept="block" (sampled drafts, the default at T > 0) for greedy too: its greedy branch is the argmax walk,
    # and the sampled runs below reuse the program.
    ref_spec = js.speculative_generate(params, CFG, PROMPTS, SPEC, max_new_tokens=NEW_TOKENS, accept="block")
    # Sampling settings are traced: these reuse the greedy programs.
    sampled = dict(max_new_tokens=NEW_TOKENS, temperature=1.0, rng=jax.random.key(7))
    ref_sampled = js.generate(params, CFG, PROMPTS, **sampled)
    ref_spec_sampled = js.speculative_generate(params, CFG, PROMPTS, SPEC, **sampled)
    result["reference"] = {
        "generate": ref.tokens.tolist(), "generate_lengths": ref.lengths.tolist(),
        "speculative": ref_spec.tokens.tolist(), "speculative_lengths": ref_spec.lengths.tolist(),
        "generate_sampled": ref_sampled.tokens.tolist(), "speculative_sampled": ref_spec_sampled.tokens.tolist(),
        "tau": ref_spec.stats["mean_accepted_length"], "seconds": time.perf_counter() - t0,
    }
    for shape in meshes:
        t0 = time.perf_counter()
        mesh = js.make_mesh(*shape)
        placed = js.shard_params(params, CFG, mesh)
        gen = js.generate(placed, CFG, PROMPTS, max_new_tokens=NEW_TOKENS, mesh=mesh)
        spec = js.speculative_generate(placed, CFG, PROMPTS, SPEC, max_new_tokens=NEW_TOKENS, mesh=mesh,
                                       accept="block")
        gen_sampled = js.generate(placed, CFG, PROMPTS, **sampled, mesh=mesh)
        spec_sampled = js.speculative_generate(placed, CFG, PROMPTS, SPEC, **sampled, mesh=mesh)
        # The compiled speculative loop (already compiled by the call above: a cache hit).
        batch = runner.pad_batch(prepare_prompts(CFG, PROMPTS, NEW_TOKENS, overshoot=SPEC.num_steps + 1), mesh)
        max_len = length_bucket(
            batch.tokens.shape[1] + NEW_TOKENS + SPEC.num_steps + 1, CFG.max_position_embeddings, minimum=64
        )
        sp = mtp_speculator(CFG, SPEC, "block")
        args = (mtp_models(placed), sp, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths),
                LoopShape(NEW_TOKENS, max_len), jnp.int32(-1),
                Sampling(jnp.float32(0.0), jnp.int32(0), jnp.float32(1.0), jax.random.key(0)), np.int32(0))
        compiled = runner.lower_program(_speculative_loop, mesh, args, batch=len(batch.lengths), cfg=CFG).compile()
        kept = all(
            a.is_equivalent_to(b, x.ndim)
            for a, b, x in zip(jax.tree.leaves(compiled.input_shardings[0][0].target),
                               jax.tree.leaves(placement.param_shardings(CFG, mesh, params=params.replace(mtp=None))),
                               jax.tree.leaves(params.replace(mtp=None)), strict=True)
        )
        result["meshes"][",".join(map(str, shape))] = {
            "generate": gen.tokens.tolist(), "generate_lengths": gen.lengths.tolist(),
            "speculative": spec.tokens.tolist(), "speculative_lengths": spec.lengths.tolist(),
            "generate_sampled": gen_sampled.tokens.tolist(), "speculative_sampled": spec_sampled.tokens.tolist(),
            "tau": spec.stats["mean_accepted_length"],
            "param_shardings_kept": bool(kept),
            "spec_loop_hlo": hlo_findings(compiled.as_text(), mesh, params, CFG),
            "seconds": time.perf_counter() - t0,
        }
    t0 = time.perf_counter()
    # One mesh with every axis split for the rest: each call compiles its own programs.
    mesh = js.make_mesh(2, 2, 2)
    logits = np.asarray(js.prefill_logits(params, CFG, prefill_tokens, mesh=mesh))
    result["prefill_max_abs_diff"] = float(np.max(np.abs(logits - np.asarray(js.prefill_logits(
        params, CFG, prefill_tokens)))))
    sections = {
        "checkpoints": lambda: checkpoints(params, mesh),
        "kernel": lambda: kernel_per_shard(mesh),
        "v41_release": lambda: v41_release_run(mesh),
        "controls": controls,
    }
    if "--long" in sys.argv:
        # CI holds the per-shard kernel and the one-device Pallas loop (test_pallas); for the drafters' trees, the
        # speculative loop on the mesh (above), V4.1's leaves and its DSpark drafter placed by their axes
        # (v41_release) and every V4.1 param and state leaf's declared axes (test_sharding.py); for the harness,
        # the same runner (`runner.run_sharded`) under generate and the speculative loop above.
        sections.update(pallas_loop=lambda: pallas_loop(params, mesh), dspark=lambda: dspark_run(params, mesh),
                        v41_dspark=lambda: v41_dspark_run(mesh), harness=lambda: harness_run(params, mesh))
    result["section_seconds"] = {}
    for name, run in sections.items():
        t1 = time.perf_counter()
        result[name] = run()
        result["section_seconds"][name] = time.perf_counter() - t1
    result["extras_seconds"] = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
