"""Chunked prefill measurements behind docs/prefill.md (each mode prints one JSON line per result).

    python bench/prefill.py time [CHUNK]          # tiny-v4 fp32: warm prefill of 1,024 / 7,168 tokens
    python bench/prefill.py spec                  # tiny-v4 fp32: 7,168-token prompt + 64 tokens, greedy s3_k2_d6
    python bench/prefill.py long [TOKENS]         # random tiny, 131,072 positions: generate from a 65,536-token prompt
    python bench/prefill.py flops CHUNK S...      # XLA cost analysis, one-shot vs chunked, tiny fp32
    python bench/prefill.py memory STATE:PROMPT:CHUNK[:dense] ...   # XLA memory analysis of the prefill, tiny
    python bench/prefill.py equal tiny|v4-ratios CHUNK...   # chunked == one-shot at 1 .. 3000 tokens (-CHUNK: dense)
    python bench/prefill.py equal-width v4-ratios WIDTH CHUNK...  # the same at hidden size WIDTH

Run pinned: XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" taskset -c 1 ...
"""

from __future__ import annotations

import json
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec as js
from jaxspec.model import network as model
from jaxspec.model import prefill
from jaxspec.model.state import abstract_state, init_state
from jaxspec.testing import one_shot_greedy, randomize


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _checkpoint():
    ckpt = js.load_checkpoint("checkpoints/tiny-v4", dtype="float32", cpu_experts=True)
    return ckpt.cfg, ckpt.params


def time_prefill(chunk: int = 0) -> None:
    cfg, params = _checkpoint()
    cfg = cfg.replace(prefill_chunk=chunk)
    rng = np.random.default_rng(0)
    res = {}
    for n, max_len in ((1024, 2048), (7168, 8192)):
        tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, (1, n)), jnp.int32)
        lengths = jnp.asarray([n], jnp.int32)

        def run(tokens=tokens, lengths=lengths, max_len=max_len):
            return prefill.prefill_program(params, cfg, init_state(cfg, 1, max_len), tokens, lengths)

        t0 = time.perf_counter()
        jax.block_until_ready(run())
        first = time.perf_counter() - t0
        best = 1e9
        for _ in range(2):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            best = min(best, time.perf_counter() - t0)
        res[n] = {"first_s": first, "warm_s": best, "ms_per_token": 1e3 * best / n}
    res["ratio_7k_over_1k"] = res[7168]["ms_per_token"] / res[1024]["ms_per_token"]
    print(json.dumps({**{str(k): v for k, v in res.items()}, "maxrss_gb": _rss_gb()}))


def spec() -> None:
    cfg, params = _checkpoint()
    prompt = [np.random.default_rng(0).integers(2, cfg.vocab_size, 7168).tolist()]
    t0 = time.perf_counter()
    out = js.speculative_generate(params, cfg, prompt, "s3_k2_d6", max_new_tokens=64)
    res = {"spec_s": time.perf_counter() - t0, "tau": out.stats["mean_accepted_length"],
           "maxrss_gb_after_spec": _rss_gb()}
    ref = js.generate(params, cfg, prompt, max_new_tokens=64)
    res.update(identical_to_generate=bool(np.array_equal(out.tokens, ref.tokens)), maxrss_gb=_rss_gb())
    print(json.dumps(res))


def long(n: int = 65536) -> None:
    cfg = js.ModelConfig.preset("tiny", max_position_embeddings=131072)
    params = js.init_params(cfg, jax.random.key(0))
    prompt = [np.random.default_rng(0).integers(0, cfg.vocab_size, n).tolist()]
    t0 = time.perf_counter()
    out = js.generate(params, cfg, prompt, max_new_tokens=16)
    print(json.dumps({"prompt_tokens": n, "new_tokens": int(out.lengths[0]),
                      "wall_s_with_compile": time.perf_counter() - t0, "maxrss_gb": _rss_gb()}))


def flops(chunk: int, *sizes: int) -> None:
    from jaxspec.model.network import abstract_params

    cfg = js.ModelConfig.preset("tiny", dtype="float32", max_position_embeddings=131072)
    params, c = abstract_params(cfg), cfg.replace(prefill_chunk=chunk)
    for s in sizes:
        tok = jax.ShapeDtypeStruct((1, s), jnp.int32)
        row = {"tokens": s}
        if s <= 8192:
            row["one_shot_gflop"] = model.jitted_one_shot_logits.lower(params, cfg, tok).cost_analysis()["flops"] / 1e9
        body = prefill.prefill_program.lower(params, c, abstract_state(c, 1, s), tok,
                                             jax.ShapeDtypeStruct((1,), jnp.int32)).cost_analysis()["flops"]
        n = -(-s // prefill.effective_chunk(c, s))  # a while loop's body counts once
        row.update(chunks=n, per_chunk_gflop=body / 1e9, chunked_gflop=body * n / 1e9)
        print(json.dumps(row), flush=True)


def memory(*specs: str) -> None:
    from jaxspec.model.prefill_plan import prefill_memory

    cfg = js.ModelConfig.preset("tiny", max_position_embeddings=131072)
    for spec_ in specs:  # STATE:PROMPT:CHUNK, or STATE:PROMPT:CHUNK:dense for the dense reference path
        state, prompt, chunk = (int(x) for x in spec_.split(":")[:3])
        banded = not spec_.endswith(":dense")
        m = prefill_memory(cfg, 1, state, chunk, prompt=prompt, banded=banded)
        print(json.dumps({"state": state, "prompt": prompt, "chunk": m.chunk, "banded": banded,
                          "temp_MB": m.temp_bytes / 2**20, "gflop_chunk": m.flops_per_chunk / 1e9}), flush=True)


def equal_config(name: str, width: int = 0) -> js.ModelConfig:
    """tiny, or the 2-layer (CSA, HCA) config with V4-Flash's window 128, CSA 4 / HCA 128, top-512
    (`v4-ratios`); width > 0: hidden size and q / o ranks scaled down to it (the ratios kept)."""
    cfg = js.ModelConfig.preset("tiny")
    if name == "v4-ratios":
        cfg = cfg.replace(num_layers=2, layer_types=("csa", "hca"), sliding_window=128, csa_ratio=4, hca_ratio=128,
                          index_topk=512, num_hash_layers=1)
    if width:
        cfg = cfg.replace(hidden_size=width, q_lora_rank=width // 2, o_lora_rank=width // 4,
                          moe_intermediate_size=width)
    return cfg


def equal(name: str, *chunks: int, width: int = 0, new_tokens: int = 16) -> None:
    """Logits of rows of 1 .. 3000 tokens, chunked (banded where the chunk is > 2 blocks, dense at
    the chunks given as -CHUNK), against the one-shot dense prefill of the 3000-token row; then the
    greedy continuation of the 1000- and 3000-token prompts by `generate` (chunked) against
    `testing.one_shot_greedy` (one dense extend of the whole prompt, then decode steps)."""
    cfg = equal_config(name, width)
    params = randomize(js.init_params(cfg, jax.random.key(0)), jax.random.key(1))
    lengths = [1, 31, 32, 33, 127, 128, 129, 1000, 3000]
    seq = np.random.default_rng(0).integers(0, cfg.vocab_size, 3000).astype(np.int32)
    t0 = time.perf_counter()
    ref = np.asarray(model.one_shot_logits(params, cfg, jnp.asarray(seq[None])))[0]  # causal: prefixes are rows
    res: dict = {"config": name, "width": cfg.hidden_size, "one_shot_s": time.perf_counter() - t0,
                 "maxrss_gb_after_one_shot": _rss_gb()}
    tokens, lens = jnp.asarray(np.tile(seq, (len(lengths), 1))), jnp.asarray(lengths, jnp.int32)
    for chunk in chunks:
        c = cfg.replace(prefill_chunk=abs(chunk))
        run = jax.jit(lambda p, t, n, c=c, b=chunk > 0: prefill.chunked_prefill(
            p, c, init_state(c, len(lengths), 3000), t, n, all_logits=True, banded=b)[0].logits)
        got = np.asarray(run(params, tokens, lens))
        res[f"chunk{chunk}"] = {n: float(np.max(np.abs(got[i, :n] - ref[:n])) / np.max(np.abs(ref[:n])))
                                for i, n in enumerate(lengths)}
        print(json.dumps(res), flush=True)
    first = ref[np.array(lengths) - 1].argmax(-1)  # one-shot argmax at each row's last position
    ragged = js.generate(params, cfg, [seq[:n].tolist() for n in lengths], max_new_tokens=1).tokens
    res["ragged_first_tokens_match_one_shot"] = bool(np.array_equal(ragged[:, 0], first))
    del ref
    for n in (1000, 3000):
        want = one_shot_greedy(params, cfg, seq[:n], new_tokens)
        for chunk in sorted({abs(c) for c in chunks}):
            got = js.generate(params, cfg.replace(prefill_chunk=chunk), [seq[:n].tolist()],
                              max_new_tokens=new_tokens).tokens[0]
            res[f"greedy_{n}_chunk{chunk}_identical"] = bool(np.array_equal(want, got))
        print(json.dumps({**res, "maxrss_gb": _rss_gb()}), flush=True)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode in ("memory", "equal"):
        {"memory": memory, "equal": lambda n, *c: equal(n, *map(int, c))}[mode](*rest)
    elif mode == "equal-width":  # equal-width NAME WIDTH CHUNK...: the same check at a smaller hidden size
        equal(rest[0], *map(int, rest[2:]), width=int(rest[1]))
    else:
        {"time": time_prefill, "spec": spec, "long": long, "flops": flops}[mode](*map(int, rest))
