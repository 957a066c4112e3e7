"""Greedy identity in bfloat16: where speculation and `generate` part, it is at a near tie.

Token identity holds in float32 (`load_checkpoint(..., dtype="float32")`, the other tests). In bfloat16 a
tree verify (D rows) and a one-row decode step round differently: the logits carry a relative error of
about 2^-8 (bf16's 8-bit mantissa), so an argmax whose top two logits are closer than that may flip. The
shipped checkpoint as loaded (bf16): measured on 16 held-out GSM8K / MBPP prompts x 64 tokens, s7_k1_d8
and s7_k2_d8 each part from `generate` on 2 rows, at float32 top-2 gaps of 5e-4 and 2.3e-3 of the top
logit. The bound held here: every first divergence sits at a float32 relative top-2 gap below 2^-7 (twice
bf16's rounding), and at most a quarter of the rows diverge.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import jaxspec as js

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tiny-v4")
NEAR_TIE = 2.0**-7
NEW_TOKENS = 48


def _prompts(tokenizer, count):
    from jaxspec.harness.eval import encode_prompts
    from jaxspec.training.data import HELDOUT_SPLITS, data_available, load_dataset

    if not data_available():  # the shared data is absent: a few hand-written prompts, said so
        texts = ["Q: Tom has 3 apples and buys 5 more. How many apples?\nA:", "def add(a, b):\n    return",
                 "Write a function that reverses a list.", "Natalia sold clips to 48 of her friends in April"]
        return [tokenizer.encode(t).ids for t in texts][:count]
    out = []
    for name in ("gsm8k", "mbpp"):
        out += encode_prompts(tokenizer, load_dataset(name, HELDOUT_SPLITS[name])[: count // 2], 128)
    return out


def _divergences(ck, ck32, prompts, spec):
    ref = js.generate(ck.params, ck.cfg, prompts, max_new_tokens=NEW_TOKENS)
    out = js.speculative_generate(ck.params, ck.cfg, prompts, spec, max_new_tokens=NEW_TOKENS, draft=ck.draft)
    gaps = []
    for prompt, a, b in zip(prompts, out.tokens, ref.tokens, strict=True):
        if np.array_equal(a, b):
            continue
        at = int(np.argmax(a != b))
        logits = np.asarray(js.prefill_logits(ck32.params, ck32.cfg, np.asarray([prompt + b[:at].tolist()])))[0, -1]
        first, second = np.sort(logits)[-1], np.sort(logits)[-2]
        gaps.append(float((first - second) / abs(first)))
    return gaps


@pytest.mark.long  # two and a half minutes (four loops compiled in two dtypes); CI holds float32 identity elsewhere
@pytest.mark.parametrize("spec,count", [("s7_k2_d8", 6)])
def test_bf16_divergences_are_near_ties(spec, count):
    ck = js.load_checkpoint(SHIPPED)
    assert ck.cfg.dtype == "bfloat16"
    ck32 = js.load_checkpoint(SHIPPED, dtype="float32")
    prompts = _prompts(ck.tokenizer, count)
    gaps = _divergences(ck, ck32, prompts, spec)
    assert all(g < NEAR_TIE for g in gaps), gaps
    assert len(gaps) <= len(prompts) // 4 + 1, gaps
    # float32 is exact on the same prompts
    ref = js.generate(ck32.params, ck32.cfg, prompts, max_new_tokens=NEW_TOKENS)
    out = js.speculative_generate(ck32.params, ck32.cfg, prompts, spec, max_new_tokens=NEW_TOKENS, draft=ck32.draft)
    np.testing.assert_array_equal(out.tokens, ref.tokens)


@pytest.mark.long
@pytest.mark.parametrize("spec", ["s7_k1_d8", "s7_k2_d8"])
def test_bf16_divergences_are_near_ties_long(spec):
    ck = js.load_checkpoint(SHIPPED)
    ck32 = js.load_checkpoint(SHIPPED, dtype="float32")
    prompts = _prompts(ck.tokenizer, 16)
    gaps = _divergences(ck, ck32, prompts, spec)
    assert all(g < NEAR_TIE for g in gaps) and len(gaps) <= len(prompts) // 4, gaps
