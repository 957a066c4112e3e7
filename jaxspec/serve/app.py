"""The OpenAI-compatible HTTP layer over an `Engine` (FastAPI; `jaxspec serve` runs it under uvicorn).

/v1/completions and /v1/chat/completions (JSON, or server-sent events with the text each cycle commits),
/v1/models, /health and /metrics (Prometheus text). A bad request gets HTTP 400 with an OpenAI-style
error naming the field; a full queue 429; the engine keeps serving every other request either way. A
request whose client disconnects is cancelled and its slot freed.

Beyond OpenAI's fields (vLLM's names): top_k, stop_token_ids. Unsupported: n > 1, logprobs, echo, best_of.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from jaxspec.serve.engine import Engine, QueueFull
from jaxspec.serve.engine import Request as EngineRequest
from jaxspec.speculation.inputs import SamplingParams

Number = StrictInt | StrictFloat


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send fields we do not read (user, ...)

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    n: StrictInt | None = None
    logprobs: Any = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None


class CompletionBody(_Body):
    prompt: StrictStr | Annotated[list[StrictInt], Field(min_length=1)]
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: StrictStr


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def _error(message: str, param: str | None, status: int, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "seed", "prompt", "messages")


def create_app(engine: Engine, *, model_name: str, encode: Callable[[str], list[int]],
               decode: Callable[[list[int]], str], render_chat: Callable[[list[dict[str, str]]], str],
               drain_seconds: float = 30.0) -> FastAPI:
    """The app over `engine` (started and shut down with the app). encode: prompt text -> ids (BOS first
    where the model wants one); decode: ids -> text (special tokens dropped); render_chat: messages -> text."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:  # graceful: let live requests finish for a while, then cancel what is left
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown, drain_seconds)

    app = FastAPI(title="jaxspec", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [x for x in first.get("loc", ()) if x != "body"]
        param = str(loc[0]) if loc else None
        if first.get("type") == "missing":
            return _error(f"{param}: required", param, 400)
        if param is None:
            return _error(f"the body must be a JSON object of the request's fields ({first.get('msg')})", None, 400)
        shown = repr(first.get("input"))
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return _error(f"{param}: invalid value {shown} ({first.get('msg', 'invalid')})", param, 400)

    @app.exception_handler(BadRequest)
    async def bad(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(exc.message, exc.param, exc.status, exc.kind)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(engine.started),
                                             "owned_by": "jaxspec"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = [f"# jaxspec engine: spec {engine.spec_name}, {engine.num_slots} slots"]
        for name, value in engine.metrics().items():
            kind = "counter" if name.endswith("_total") and name != "slots_total" else "gauge"
            lines += [f"# TYPE jaxspec_{name} {kind}", f"jaxspec_{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    requests = _Requests(engine, model_name, decode)

    @app.post("/v1/completions")
    async def completions(http: Request, body: CompletionBody):
        ids = body.prompt if isinstance(body.prompt, list) else encode(body.prompt)
        if not ids:
            raise BadRequest("prompt: encodes to no tokens", "prompt")
        return await requests.run(http, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(http: Request, body: ChatBody):
        ids = encode(render_chat([m.model_dump() for m in body.messages]))
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await requests.run(http, body, ids, max_tokens, chat=True)

    return app


class _Requests:
    """What the two completion routes share: checking a request, running it, answering it."""

    def __init__(self, engine: Engine, model_name: str, decode: Callable[[list[int]], str]):
        self.engine, self.model_name, self.decode = engine, model_name, decode

    def prepare(self, body: _Body, prompt_ids: list[int], max_tokens: int | None) -> tuple[SamplingParams, list[str]]:
        engine, model_name = self.engine, self.model_name
        if body.model != model_name:
            raise BadRequest(f"model: unknown model {body.model!r}; this server serves {model_name!r}", "model")
        for field, ok in (("n", body.n in (None, 1)), ("best_of", body.best_of in (None, 1)),
                          ("logprobs", body.logprobs in (None, False, 0)), ("echo", not body.echo)):
            if not ok:
                raise BadRequest(f"{field}: not supported by this server", field)
        if max_tokens is not None and max_tokens < 1:
            chat_limit = getattr(body, "max_completion_tokens", None) is not None
            field = "max_completion_tokens" if chat_limit else "max_tokens"
            raise BadRequest(f"{field}: must be >= 1, got {max_tokens}", field)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stops) or len(stops) > 4:
            raise BadRequest("stop: at most 4 non-empty strings", "stop")
        try:
            params = SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else engine.max_len,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=body.top_k, top_p=body.top_p, stop_token_ids=tuple(body.stop_token_ids or ()), seed=body.seed)
            if max_tokens is None:  # no limit asked for: as many as the context holds
                room = engine.max_len - engine.stepper.width - len(prompt_ids)
                params = dataclasses.replace(params, max_tokens=max(room, 1))
            engine.check(prompt_ids, params)
        except ValueError as e:
            raise BadRequest(str(e), _param_of(str(e))) from None
        return params, stops

    async def run(self, http: Request, body: _Body, prompt_ids: list[int], max_tokens: int | None, chat: bool):
        engine, model_name, decode = self.engine, self.model_name, self.decode
        params, stops = self.prepare(body, prompt_ids, max_tokens)
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def on_update(new: list[int], reason: str | None) -> None:  # on the engine's thread
            loop.call_soon_threadsafe(updates.put_nowait, (new, reason))

        try:
            request = engine.submit(prompt_ids, params, on_update)
        except QueueFull as e:
            raise BadRequest(f"the server is busy: {e}; retry later", None, 429, "rate_limit_error") from None
        except ValueError as e:
            raise BadRequest(str(e), _param_of(str(e))) from None
        text = _Text(decode, stops)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream:
            return StreamingResponse(_events(engine, request, updates, text, rid, created, model_name, chat),
                                     media_type="text/event-stream")
        reason = None
        try:
            while reason is None:
                try:
                    new, reason = await asyncio.wait_for(updates.get(), timeout=0.25)
                except TimeoutError:
                    if await http.is_disconnected():
                        engine.cancel(request)
                        return _error("client disconnected", None, 499)
                    continue
                if text.add(new):
                    engine.cancel(request)
                    reason = "stop"
        except asyncio.CancelledError:
            engine.cancel(request)
            raise
        if reason == "error":
            return _error("the engine failed; see the server's log", None, 500, "server_error")
        reason = text.reason or reason
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(request.tokens),
                 "total_tokens": len(prompt_ids) + len(request.tokens)}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text.final()}, "finish_reason": reason,
                      "logprobs": None}
            return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text.final(), "finish_reason": reason, "logprobs": None}
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [choice], "usage": usage}


def _param_of(message: str) -> str | None:
    m = re.match(r"(\w+)[: ]", message)
    return m.group(1) if m and m.group(1) in _FIELDS else None


class _Text:
    """A request's text as tokens arrive: decoded whole each time (a character split across tokens is held
    back until complete), cut at the first stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode, stops
        self.tokens: list[int] = []
        self.text, self.sent, self.reason = "", 0, None

    def add(self, new: list[int]) -> bool:
        """Take new tokens -> whether a stop string ended the text."""
        if self.reason is not None:
            return True
        self.tokens.extend(new)
        self.text = self.decode(self.tokens)
        for stop in self.stops:
            at = self.text.find(stop)
            if at >= 0:
                self.text, self.reason = self.text[:at], "stop"
        return self.reason is not None

    def delta(self, final: bool = False) -> str:
        """The text not sent yet (held back while it ends in a partial character, unless final)."""
        end = len(self.text)
        if not final and self.reason is None:
            end = len(self.text.rstrip("\ufffd"))
            for stop in self.stops:  # hold back what could be the start of a stop string
                for k in range(min(len(stop) - 1, end), 0, -1):
                    if self.text[:end].endswith(stop[:k]):
                        end -= k
                        break
        out = self.text[self.sent: max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    def final(self) -> str:
        return self.text


async def _events(engine: Engine, request: EngineRequest, updates: asyncio.Queue, text: _Text, rid: str,
                  created: int, model: str, chat: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per round that committed text, a last one with the finish reason, [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, reason: str | None, first: bool = False) -> str:
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
                {} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
        return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model,
                                      "choices": [choice]}) + "\n\n"

    finished = False
    try:
        if chat:
            yield chunk(None, None, first=True)
        reason = None
        while reason is None:
            new, reason = await updates.get()
            if text.add(new):
                engine.cancel(request)
                reason = "stop"
            delta = text.delta(final=reason is not None)
            if delta:
                yield chunk(delta, None)
        yield chunk(None, text.reason or ("stop" if reason == "error" else reason))
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:  # the client went away (the response was cancelled): free the slot
            engine.cancel(request)
