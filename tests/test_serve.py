"""`jaxspec serve` on the shipped checkpoint (float32): the slot engine and the OpenAI-compatible server,
driven by the official `openai` client against a live uvicorn server."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import uvicorn
from rich.console import Console

import jaxspec as js
from jaxspec.cli import build_parser
from jaxspec.cli.generate import plain_chat, text_ids
from jaxspec.cli.serve import build_app
from jaxspec.model.sampling import Sampling, processed_logprobs, sample_tokens
from jaxspec.serve.engine import Engine, QueueFull, generate_all
from jaxspec.speculation import slots as slots_lib
from jaxspec.speculation.inputs import SamplingParams
from jaxspec.training.tokenizer import decode

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-v4"
SPEC = "s3_k1_d4"
MODEL = "tiny-v4"
TEXTS = [
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?",
    "def add(a, b):",
    "Write a short poem about the sea.",
    "Question: A train travels 60 miles in 2 hours. What is its speed in miles per hour? Explain step by step.",
    "Hello",
    "List three colors:",
    "Question: Sara reads 12 pages a day for 7 days, then 5 pages on the last day. How many pages in all?",
    "# Return the largest element of a list\ndef largest(xs):",
]


@pytest.fixture(scope="module")
def shipped():
    ckpt = js.load_checkpoint(SHIPPED, dtype="float32")
    return ckpt


REFERENCE_TOKENS = 40  # one reference length (one compiled program per prompt bucket); shorter ones are prefixes


def reference(ckpt, ids: list[int], max_tokens: int) -> list[int]:
    """`generate` of the prompt alone (greedy, the model's eos ending it), its first `max_tokens` tokens."""
    assert max_tokens <= REFERENCE_TOKENS
    out = js.generate(ckpt.params, ckpt.cfg, [ids], max_new_tokens=REFERENCE_TOKENS, eos_id=ckpt.cfg.eos_id)
    return out.tokens[0, : out.lengths[0]].tolist()[:max_tokens]


# ---- per-row sampling settings ------------------------------------------------------------------------


def test_per_row_settings_process_each_row_as_its_own_batch_setting():
    logits = jax.random.normal(jax.random.key(0), (4, 3, 50)) * 3
    temperature = jnp.asarray([0.5, 1.0, 1.7, 0.9], jnp.float32)
    top_k, top_p = jnp.asarray([0, 5, 0, 3], jnp.int32), jnp.asarray([1.0, 1.0, 0.6, 0.8], jnp.float32)
    rows = processed_logprobs(logits, temperature, top_k, top_p)
    for r in range(4):
        alone = processed_logprobs(logits[r], temperature[r], top_k[r], top_p[r])
        np.testing.assert_array_equal(np.asarray(rows[r]), np.asarray(alone))
    # a greedy row inside a sampled batch takes the argmax; a per-row key is the row's own
    keys = jax.random.split(jax.random.key(1), 4)
    sampling = Sampling(temperature.at[2].set(0.0), top_k, top_p, keys)
    drawn = sample_tokens(logits[:, 0], sampling.key, sampling.temperature, sampling.top_k, sampling.top_p)
    assert int(drawn[2]) == int(jnp.argmax(logits[2, 0]))
    alone = sample_tokens(logits[1:2, 0], keys[1:2], temperature[1:2], top_k[1:2], top_p[1:2])
    assert int(alone[0]) == int(drawn[1])


def test_sampling_params_checks_and_keywords(shipped):
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(-1,))
    cfg, params = shipped.cfg, shipped.params
    ids = text_ids(TEXTS[1], cfg, shipped.tokenizer)
    by_params = js.generate(params, cfg, [ids], sampling=SamplingParams(max_tokens=12, stop_token_ids=(cfg.eos_id,)))
    by_keywords = js.generate(params, cfg, [ids], max_new_tokens=12, eos_id=cfg.eos_id)
    np.testing.assert_array_equal(by_params.tokens, by_keywords.tokens)
    with pytest.raises(ValueError, match="not both"):
        js.generate(params, cfg, [ids], max_new_tokens=5, sampling=SamplingParams(max_tokens=12))


# ---- the engine ---------------------------------------------------------------------------------------


def test_engine_greedy_mixed_with_sampled_rows_equals_generate_and_sampled_rows_ignore_their_batch(shipped):
    cfg = shipped.cfg
    engine = Engine(shipped.params, cfg, draft=shipped.draft, spec=SPEC, num_slots=4, max_len=256,
                    cycles_per_call=3, max_queue=64)
    prompts = [text_ids(t, cfg, shipped.tokenizer) for t in TEXTS[:6]]
    sampled = SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=11)
    plan = [SamplingParams(max_tokens=m) for m in (20, 9, 16)] + [sampled] + [SamplingParams(max_tokens=12)] * 2
    requests = generate_all(engine, prompts, plan)
    for ids, p, r in zip(prompts, plan, requests, strict=True):
        assert r.finish_reason in ("stop", "length")
        if p.temperature == 0:
            assert r.tokens == reference(shipped, ids, p.max_tokens)
    # the sampled request again, alone and beside other requests in other slots: the same tokens
    alone = generate_all(engine, [prompts[3]], sampled)[0]
    crowd_plan = [SamplingParams(max_tokens=7)] * 2 + [sampled]
    crowd = generate_all(engine, [prompts[0], prompts[1], prompts[3]], crowd_plan)
    assert alone.tokens == requests[3].tokens == crowd[2].tokens
    assert len(alone.tokens) == 14 and len(set(alone.tokens)) > 3
    before = slots_lib.compile_count()
    again = generate_all(engine, [prompts[0], prompts[1], prompts[3]], crowd_plan)
    assert [r.tokens for r in again] == [r.tokens for r in crowd]
    assert slots_lib.compile_count() == before  # the same group and prompt buckets: nothing new compiled
    m = engine.metrics()
    assert m["requests_finished_total"] == 13 and m["slots_live"] == 0 and m["tau"] > 1.0


def test_engine_autoregressive_and_its_limits(shipped):
    cfg = shipped.cfg
    engine = Engine(shipped.params, cfg, spec="none", num_slots=2, max_len=128, cycles_per_call=5, max_queue=2)
    assert engine.spec_name == "ar"
    ids = text_ids(TEXTS[0], cfg, shipped.tokenizer)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit(ids, SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="prompt"):
        engine.submit([cfg.vocab_size], SamplingParams())
    first = engine.submit(ids, SamplingParams(max_tokens=10))
    dropped = engine.submit(ids, SamplingParams(max_tokens=10))
    with pytest.raises(QueueFull):
        engine.submit(ids, SamplingParams(max_tokens=10))
    engine.cancel(dropped)
    assert dropped.finish_reason == "cancelled"
    engine.run_until_done()
    assert first.tokens == reference(shipped, ids, 10)


# ---- the HTTP server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    args = build_parser().parse_args(["serve", "--checkpoint", str(SHIPPED), "--spec", SPEC, "--slots", "8",
                                      "--max-len", "256", "--max-queue", "64", "--model-name", MODEL])
    app = build_app(args, Console(quiet=True))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 120
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield port
    srv.should_exit = True
    thread.join(timeout=120)


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)


def test_concurrent_greedy_completions_equal_generate_alone(server, shipped):
    c = client(server)
    jobs = [(TEXTS[i % len(TEXTS)] + " " * (i // len(TEXTS)), 6 + (7 * i) % 29, i % 3 == 0) for i in range(24)]

    def complete(job):
        text, max_tokens, stream = job
        if stream:
            chunks = list(c.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens, temperature=0,
                                               stream=True))
            return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason
        r = c.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens, temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(complete, jobs))
    longest = max(m for _, m, _ in jobs)
    refs = {t: reference(shipped, text_ids(t, shipped.cfg, shipped.tokenizer), longest) for t, _, _ in jobs}
    for (text, max_tokens, _), (got, reason) in zip(jobs, results, strict=True):
        want = refs[text][:max_tokens]
        assert got == decode(shipped.tokenizer, want), text
        assert reason == ("stop" if want[-1] == shipped.cfg.eos_id else "length")


def test_chat_streamed_equals_plain_and_seeded_sampling_reproduces(server, shipped):
    c = client(server)
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert plain.object == "chat.completion" and plain.choices[0].message.role == "assistant"
    want = reference(shipped, text_ids(plain_chat(messages), shipped.cfg, shipped.tokenizer), 24)
    assert plain.choices[0].message.content == decode(shipped.tokenizer, want)
    assert plain.usage.completion_tokens == len(want)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == plain.choices[0].message.content
    kw = dict(model=MODEL, messages=messages, max_tokens=24, temperature=1.0, top_p=0.95, seed=1234)
    a, b = (c.chat.completions.create(**kw).choices[0].message.content for _ in range(2))
    other = c.chat.completions.create(**{**kw, "seed": 99}).choices[0].message.content
    assert a == b and a != other
    stopped = c.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=40, temperature=0, stop=["apples"])
    full = c.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=40, temperature=0).choices[0].text
    if "apples" in full:
        assert stopped.choices[0].text == full[: full.index("apples")] and stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("bad, param", [
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=10**9), "max_tokens"),
    (dict(model="gpt-5"), "model"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(prompt="word " * 400), "prompt"),
    (dict(n=3), "n"),
])
def test_bad_requests_get_400_naming_the_field_and_the_server_keeps_serving(server, bad, param):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(**{"model": MODEL, "prompt": "Hello", "max_tokens": 4, **bad})
    assert err.value.status_code == 400 and err.value.body["param"] == param and err.value.body["message"]
    assert c.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0).choices[0].text is not None


def _raw(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, data


def test_malformed_bodies_health_models_metrics(server):
    status, data = _raw(server, "POST", "/v1/completions", b"{not json")
    assert status == 400 and "error" in json.loads(data)
    status, data = _raw(server, "POST", "/v1/completions", json.dumps({"model": MODEL}).encode())
    assert status == 400 and json.loads(data)["error"]["param"] == "prompt"
    assert _raw(server, "GET", "/health") == (200, b'{"status":"ok"}')
    assert [m.id for m in client(server).models.list().data] == [MODEL]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server}/metrics", timeout=60).read().decode()
    assert "jaxspec_generated_tokens_total" in metrics and "jaxspec_queue_depth" in metrics


def test_disconnected_stream_is_cancelled_and_load_completes(server):
    def cancelled() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server}/metrics", timeout=60).read().decode()
        return float(re.search(r"^jaxspec_requests_cancelled_total (\S+)$", text, re.M).group(1))

    before = cancelled()
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=120)
    body = {"model": MODEL, "prompt": TEXTS[2], "max_tokens": 200, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    conn.close()
    deadline = time.time() + 60
    while cancelled() <= before:
        assert time.time() < deadline, "the disconnected request was not cancelled"
        time.sleep(0.1)
    # a load of 64 requests of mixed lengths over the 8 slots: every one completes
    c = client(server)
    rng = np.random.default_rng(0)
    jobs = [(TEXTS[int(rng.integers(len(TEXTS)))], int(rng.integers(2, 17))) for _ in range(64)]

    def complete(job):
        r = c.completions.create(model=MODEL, prompt=job[0], max_tokens=job[1], temperature=0.7, seed=7)
        return r.choices[0].finish_reason, r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(complete, jobs))
    for (_, max_tokens), (reason, n) in zip(jobs, results, strict=True):
        assert reason in ("stop", "length") and 1 <= n <= max_tokens
