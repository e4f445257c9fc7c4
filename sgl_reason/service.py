"""``sgl-reason gateway``: an OpenAI-compatible reasoning service in front of an SGLang server.

``POST /v1/chat/completions`` runs the library's programs on the upstream server (any SGLang
server, or ``sglang-router``; the default is an embedded tiny-reasoner server):

| request field | what it does |
|---|---|
| ``reasoning_effort`` ``low|medium|high`` | the thinking budget tier (4k / 16k / 64k tokens, at most what the model's context leaves) |
| ``max_thinking_tokens`` (extra body) | an explicit budget, instead of the tier |
| ``early_stop`` (extra body) | ``{"signal": ..., ...}``: :class:`~sgl_reason.EarlyStop` fields |
| ``thinking_kv_policy`` (extra body) | the server's thinking-KV policy for this request |
| ``n > 1`` | prefix-shared self-consistency: choice 0 is the voted answer, choices 1..n the samples, each with its ``answer``; ``vote`` names the voter and the agreement |
| ``max_tokens`` / ``max_completion_tokens`` | the answer's tokens (thinking has its own budget) |
| ``stream`` | SSE chunks: ``reasoning_content`` deltas, then ``content`` deltas, then usage |

Every reply separates ``reasoning_content`` from ``content`` and its ``usage`` carries the
program's cost ledger (``usage.sgl_reason``: thinking and answer tokens, prompt tokens cached
and computed, KV token-seconds). Limits (:class:`ServiceConfig`) answer 400 beyond ``max_n``
or a budget, 429 beyond ``max_concurrency`` requests in flight, 504 past ``timeout_s``. A client
that disconnects has its server requests aborted (their KV freed). The gateway binds to
127.0.0.1 unless told otherwise; it runs no client-supplied code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sgl_reason.backend import ProgramCancelled, ReasonBackend
from sgl_reason.early_stop import EarlyStop
from sgl_reason.profiles import ModelProfile, Sampling, profile_for
from sgl_reason.programs.budget import TIERS, ThinkingBudget, check_kv_policy
from sgl_reason.programs.common import ProgramResult, Sample, prompt_texts, sampling_kwargs
from sgl_reason.programs.self_consistency import self_consistency
from sgl_reason.programs.think_then_answer import (
    ThinkPlan, think_then_answer, think_then_answer_program,
)
from sgl_reason.vote import VoteConfig

logger = logging.getLogger(__name__)

EFFORTS = tuple(TIERS)


class ServiceConfig(BaseModel):
    """The gateway's limits (``sgl-reason gateway --help`` sets each)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_n: int = Field(16, ge=1)
    max_thinking_tokens: int = Field(65536, ge=1)
    max_answer_tokens: int = Field(1024, ge=1)
    default_answer_tokens: int = Field(512, ge=1)
    max_concurrency: int = Field(8, ge=1)
    timeout_s: float = Field(600.0, gt=0)
    default_effort: Literal["low", "medium", "high"] = "low"
    normalize_prompt: bool = True

    @model_validator(mode="after")
    def _check(self) -> ServiceConfig:
        if self.default_answer_tokens > self.max_answer_tokens:
            raise ValueError(f"default_answer_tokens ({self.default_answer_tokens}) exceeds "
                             f"max_answer_tokens ({self.max_answer_tokens}): lower it")
        return self


class ServiceError(Exception):
    """An OpenAI-style error reply."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}


class ChatRequest(BaseModel):
    """The fields of an OpenAI chat request that the service reads; others are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[dict[str, Any]]
    n: int = 1
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    max_thinking_tokens: int | None = Field(None, ge=1)
    early_stop: dict[str, Any] | None = None
    thinking_kv_policy: str | None = None
    vote: dict[str, Any] | None = None


class Job(BaseModel):
    """A validated request: what the program will run."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    messages: list[dict[str, str]]
    n: int
    stream: bool
    tier: str  # low / medium / high / custom: the metrics label
    budget: ThinkingBudget
    sampling: Sampling | None
    early_stop: EarlyStop | None
    kv_policy: str | None
    vote: VoteConfig | None


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ServiceError(400, f"messages[{i}].content must be a string or text parts; this "
                       "service reads text only", f"messages[{i}].content")


class Service:
    """Turns chat requests into program calls on one upstream server."""

    def __init__(self, backend: ReasonBackend, config: ServiceConfig, model_id: str,
                 profile: ModelProfile | None = None):
        self.backend, self.config, self.model_id = backend, config, model_id
        self.profile = profile or profile_for(backend.get_model_name())
        self.context_len = _context_len(backend)
        self.in_flight = 0
        self._lock = threading.Lock()
        self.metrics = ServiceMetrics()

    # -- validation ------------------------------------------------------------------------------
    def job(self, body: Any) -> Job:
        try:
            req = ChatRequest.model_validate(body)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise ServiceError(400, f"{where}: {first['msg']}", where) from None
        if req.model not in (self.model_id, self.backend.get_model_name()):
            raise ServiceError(404, f"model {req.model!r} is not served here; use "
                               f"{self.model_id!r} (GET /v1/models)", "model",
                               "model_not_found")
        messages = []
        for i, m in enumerate(req.messages):
            role = {"developer": "system"}.get(m.get("role"), m.get("role"))
            if role not in ("system", "user", "assistant"):
                raise ServiceError(400, f"messages[{i}].role {m.get('role')!r} is not supported:"
                                   " use system, developer, user or assistant",
                                   f"messages[{i}].role")
            messages.append({"role": role, "content": _text(m.get("content"), i)})
        if not messages or messages[-1]["role"] != "user":
            raise ServiceError(400, "the last message must be the user's", "messages")
        c = self.config
        if not 1 <= req.n <= c.max_n:
            raise ServiceError(400, f"n must be between 1 and {c.max_n}, got {req.n}", "n")
        answer = req.max_completion_tokens or req.max_tokens or c.default_answer_tokens
        if answer > c.max_answer_tokens:
            raise ServiceError(400, f"max_tokens {answer} exceeds this service's "
                               f"{c.max_answer_tokens} answer tokens", "max_tokens")
        room = self._room(messages, answer)
        if req.max_thinking_tokens is not None:
            budget, tier = req.max_thinking_tokens, "custom"
            if budget > c.max_thinking_tokens:
                raise ServiceError(400, f"max_thinking_tokens {budget} exceeds this service's "
                                   f"limit of {c.max_thinking_tokens}", "max_thinking_tokens")
            if budget > room:
                raise ServiceError(400, f"max_thinking_tokens {budget} does not fit: the "
                                   f"model's context ({self.context_len}) leaves {room} after "
                                   "the prompt and the answer", "max_thinking_tokens")
        else:
            tier = req.reasoning_effort or c.default_effort
            budget = min(TIERS[tier], c.max_thinking_tokens, room)
            if budget < 1:
                raise ServiceError(400, f"the prompt and {answer} answer tokens fill the "
                                   f"model's context ({self.context_len}): shorten them",
                                   "messages")
        early = None
        if req.early_stop is not None:
            try:
                early = EarlyStop(**req.early_stop)
                if early.signal != "consensus":
                    early.check_budget(budget)
            except (ValueError, TypeError) as error:
                raise ServiceError(400, f"early_stop: {_first_line(error)}", "early_stop") from None
            if early.signal == "consensus" and req.n < 2:
                raise ServiceError(400, "early_stop consensus stops sampling: use it with n > 1",
                                   "early_stop")
        if req.stream and req.n > 1:
            raise ServiceError(400, "stream with n > 1 is not supported: the vote needs every "
                               "sample; send stream=false", "stream")
        try:
            policy = check_kv_policy(req.thinking_kv_policy)
        except ValueError as error:
            raise ServiceError(400, str(error), "thinking_kv_policy") from None
        if policy is not None and not self.backend.thinking_kv:
            raise ServiceError(400, "thinking_kv_policy needs an upstream server with "
                               "sgl-reason's thinking-KV cache (start it with "
                               "--thinking-kv-policy)", "thinking_kv_policy")
        try:
            vote = VoteConfig(**req.vote) if req.vote is not None else None
        except (ValueError, TypeError) as error:
            raise ServiceError(400, f"vote: {_first_line(error)}", "vote") from None
        if (vote is not None and vote.weigh == "confidence" and early is not None
                and early.signal not in ("confidence", "consensus")):
            raise ServiceError(400, f"vote weigh=confidence reads each sample's logprobs from "
                               f"its own request, and early_stop {early.signal!r} splits it "
                               "into chunks: use early_stop confidence or consensus, or none",
                               "vote")
        sampling = None
        asked = {k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p),
                                   ("min_p", req.min_p)) if v is not None}
        if asked:
            sampling = self.profile.sampling.model_copy(update=asked)
        return Job(messages=messages, n=req.n, stream=req.stream, tier=tier,
                   budget=ThinkingBudget(max_thinking_tokens=budget, max_answer_tokens=answer),
                   sampling=sampling, early_stop=early, kv_policy=policy, vote=vote)

    def _room(self, messages: list[dict], answer: int) -> int:
        """Thinking tokens that fit beside the prompt and the answer in the model's context."""
        b, p = self.backend, self.profile
        prompt = len(b.tokenize("\n".join(m["content"] for m in messages)))
        markers = len(b.fixed_ids(p.think_start)) + len(b.fixed_ids(p.think_end)) + 1  # + EOS
        fmt = len(b.fixed_ids(p.answer_format)) if p.answer_format else 0
        template = 8 * len(messages) + 8  # role tags and the assistant's opening, generously
        return self.context_len - prompt - fmt - template - markers - answer

    # -- running -------------------------------------------------------------------------------
    def admit(self) -> None:
        with self._lock:
            if self.in_flight >= self.config.max_concurrency:
                raise ServiceError(429, f"{self.in_flight} requests are in flight, this "
                                   f"service's limit: retry later", None, "rate_limit_error")
            self.in_flight += 1

    def release(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def run(self, job: Job, backend: ReasonBackend) -> ProgramResult:
        common = dict(backend=backend, sampling=job.sampling, kv_policy=job.kv_policy,
                      early_stop=job.early_stop, normalize_prompt=self.config.normalize_prompt)
        if job.n == 1:
            return think_then_answer(job.messages, budget=job.budget, **common)
        return self_consistency(job.messages, n=job.n, think=job.budget,
                                vote_config=job.vote, **common)

    def reply(self, job: Job, result: ProgramResult, rid: str) -> dict:
        samples = result.samples
        choices = []
        if job.n > 1:
            voted = next((x for x in samples if x.answer is not None and result.vote is not None
                          and x.answer == result.vote.answer), samples[0])
            choices.append(_choice(0, voted, answer=result.answer))
        for x in samples:
            choices.append(_choice(len(choices), x, answer=x.answer))
        body = {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_id, "choices": choices, "usage": usage(result)}
        if result.vote is not None:
            v = result.vote
            body["vote"] = {"voter": v.method, "answer": v.answer,
                            "agreement": round(v.agreement, 4), "votes": v.votes,
                            "answered": v.n_answered, "samples": v.n_samples}
        if result.info.get("early_stop"):
            body["early_stop"] = result.info["early_stop"]
        body["thinking_budget"] = job.budget.thinking_tokens
        return body


def _first_line(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        return f"{where}: {first['msg']}" if where else first["msg"]
    return str(error).splitlines()[0]


def _context_len(backend: ReasonBackend) -> int:
    from sglang.utils import http_request

    res = http_request(backend.base_url + "/v1/models", api_key=backend.api_key)
    cards = res.json().get("data") or [{}]
    return int(cards[0].get("max_model_len") or 4096)


def _choice(index: int, x: Sample, answer: str | None) -> dict:
    finish = "length" if x.finish_reason == "length" else "stop"
    return {"index": index, "finish_reason": finish, "answer": answer,
            "message": {"role": "assistant", "content": x.answer_text.strip(),
                        "reasoning_content": x.thinking.strip()},
            "thinking_tokens": x.thinking_tokens, "answer_tokens": x.answer_tokens,
            "forced": x.forced}


def usage(result: ProgramResult) -> dict:
    """OpenAI ``usage`` with the cost ledger beside it."""
    c = result.cost
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.decode_tokens,
        "total_tokens": c.prompt_tokens + c.decode_tokens,
        "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": c.thinking_tokens},
        "sgl_reason": {"thinking_tokens": c.thinking_tokens, "answer_tokens": c.answer_tokens,
                       "cached_tokens": c.cached_tokens,
                       "computed_prefill_tokens": c.computed_prefill_tokens,
                       "requests": c.requests, "kv_token_seconds": round(c.kv_token_seconds, 3),
                       "peak_request_tokens": c.peak_request_tokens,
                       "seconds": round(c.seconds, 3)},
    }


# -- streaming --------------------------------------------------------------------------------
def stream_events(service: Service, job: Job, backend: ReasonBackend, rid: str, emit) -> None:
    """Run ``job`` (n = 1), calling ``emit(chunk)`` with each OpenAI chunk as text arrives.

    On the single-request route the completion streams: text before the end-of-thinking marker
    goes out as ``reasoning_content``, after it as ``content``. Other routes (early stop, a
    server without budget forcing) send both parts when the program ends."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": service.model_id}

    def delta(**fields):
        emit({**base, "choices": [{"index": 0, "delta": fields, "finish_reason": None}]})

    delta(role="assistant", content="")
    messages, _ = prompt_texts(job.messages, None, service.config.normalize_prompt)
    profile = service.profile
    plan = ThinkPlan(backend, profile, job.budget, sampling_kwargs(profile, job.sampling),
                     job.early_stop, job.kv_policy)
    started = time.perf_counter()
    if plan.route != "single":
        result = service.run(job, backend)
        x = result.samples[0]
        delta(reasoning_content=x.thinking)
        delta(content=x.answer_text)
    else:
        state = think_then_answer_program.run(question=messages, plan=plan, system=None,
                                              backend=backend, stream=True)
        splitter = _Splitter(profile.think_end)
        ex = state.stream_executor
        sent = 0
        while True:
            done = ex.is_finished
            text = ex.variables.get("completion") or ""
            if len(text) > sent:
                for kind, piece in splitter.feed(text[sent:]):
                    delta(**{kind: piece})
                sent = len(text)
            if done:
                break
            event = ex.stream_var_event.get("completion") if ex.stream_var_event else None
            if event is not None:
                event.wait(0.05)
                event.clear()
            else:
                time.sleep(0.02)
        for kind, piece in splitter.flush():
            delta(**{kind: piece})
        if ex.error_ is not None:
            raise ex.error_
        x = ex.variables["sample"]
        cost = backend.recorder.snapshot().model_copy(
            update={"seconds": time.perf_counter() - started,
                    "thinking_tokens": x.thinking_tokens, "answer_tokens": x.answer_tokens})
        result = ProgramResult(answer=x.answer, samples=[x], cost=cost, info={})
    x = result.samples[0]
    emit({**base, "choices": [{"index": 0, "delta": {}, "answer": x.answer,
                               "finish_reason": "length" if x.finish_reason == "length"
                               else "stop"}],
          "usage": usage(result)})
    service.metrics.observe(job, result)


class _Splitter:
    """Streamed text into reasoning and content at the end-of-thinking marker, holding back a
    tail that could be the start of a marker split across chunks."""

    def __init__(self, marker: str):
        self.markers = sorted({marker, marker.strip()}, key=len, reverse=True)
        self.buffer, self.after = "", False

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.after:
            return [("content", text)]
        self.buffer += text
        for m in self.markers:
            at = self.buffer.find(m)
            if at >= 0:
                head, tail = self.buffer[:at], self.buffer[at + len(m):]
                self.buffer, self.after = "", True
                return [x for x in (("reasoning_content", head), ("content", tail)) if x[1]]
        keep = min(len(self.buffer), max(len(m) for m in self.markers) - 1)
        cut = len(self.buffer) - keep
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return [("reasoning_content", out)] if out else []

    def flush(self) -> list[tuple[str, str]]:
        out, self.buffer = self.buffer, ""
        if not out:
            return []
        return [("content" if self.after else "reasoning_content", out)]


class ServiceMetrics:
    """Prometheus metrics of the gateway (its own registry, served at the gateway's /metrics;
    the runtime's stay on the upstream server's)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        p = "sgl_reason_service_"
        self.requests = Counter(p + "requests", "Chat requests by effort tier and HTTP status",
                                ["tier", "status"], registry=self.registry)
        self.tokens = Counter(p + "tokens", "Tokens by kind (thinking, answer, prompt_cached, "
                              "prompt_computed)", ["kind"], registry=self.registry)
        self.votes = Counter(p + "votes", "Self-consistency votes (n > 1) by whether the "
                             "samples agreed unanimously", ["unanimous"], registry=self.registry)
        self.early_stops = Counter(p + "early_stops", "Requests an early-stop signal ended "
                                   "early, by signal", ["signal"], registry=self.registry)
        self.latency = Histogram(p + "latency_seconds", "Request latency by tier", ["tier"],
                                 registry=self.registry,
                                 buckets=(0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320, 640))

    def observe(self, job: Job, result: ProgramResult) -> None:
        c = result.cost
        self.requests.labels(job.tier, "200").inc()
        for kind, value in (("thinking", c.thinking_tokens), ("answer", c.answer_tokens),
                            ("prompt_cached", c.cached_tokens),
                            ("prompt_computed", c.computed_prefill_tokens)):
            self.tokens.labels(kind).inc(value)
        if result.vote is not None:
            self.votes.labels(str(result.vote.agreement == 1.0).lower()).inc()
        stopped = result.info.get("early_stop") or next(
            (x.stopped for x in result.samples if x.stopped), None)
        if stopped:
            self.early_stops.labels(stopped.get("signal", "unknown")).inc()
        self.latency.labels(job.tier).observe(c.seconds)

    def failed(self, tier: str, status: int) -> None:
        self.requests.labels(tier, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# -- the HTTP app ---------------------------------------------------------------------------
def create_app(service: Service):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="sgl-reason gateway")

    def error(e: ServiceError, job: Job | None = None) -> JSONResponse:
        service.metrics.failed(job.tier if job else "none", e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": service.model_id, "object": "model", "created": 0, "owned_by": "sgl-reason",
             "root": service.backend.get_model_name(), "max_model_len": service.context_len}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "in_flight": service.in_flight}

    @app.get("/metrics")
    async def metrics():
        text, content_type = service.metrics.render()
        return Response(text, media_type=content_type)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        job = None
        try:
            try:
                body = await request.json()
            except ValueError:
                raise ServiceError(400, "the body is not JSON") from None
            job = await asyncio.to_thread(service.job, body)
            service.admit()
        except ServiceError as e:
            return error(e, job)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        backend, scope = service.backend.cancellable()
        if job.stream:
            return StreamingResponse(_sse(service, job, backend, scope, rid),
                                     media_type="text/event-stream")
        task = asyncio.ensure_future(asyncio.to_thread(service.run, job, backend))
        task.add_done_callback(_released(service))
        deadline = time.monotonic() + service.config.timeout_s
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if task.done():
                break
            if await request.is_disconnected():
                scope.cancel()
                service.metrics.failed(job.tier, 499)
                return Response(status_code=499)
            if time.monotonic() > deadline:
                scope.cancel()
                return error(ServiceError(504, f"the request ran past this service's "
                                          f"{service.config.timeout_s:.0f} s timeout and was "
                                          "aborted", None, "timeout"), job)
        try:
            result = task.result()
        except ProgramCancelled:
            return error(ServiceError(499, "cancelled"), job)
        except Exception as e:  # noqa: BLE001  (the upstream's error, relayed as a 502)
            logger.exception("program failed")
            return error(ServiceError(502, f"the upstream server failed: {_first_line(e)}",
                                      None, "upstream_error"), job)
        service.metrics.observe(job, result)
        return JSONResponse(service.reply(job, result, rid))

    return app


def _released(service: Service):
    def done(task: asyncio.Future) -> None:
        service.release()
        if not task.cancelled():
            task.exception()  # retrieved: a program cancelled after its client left is no news
    return done


class Gateway:
    """The gateway's HTTP server on a thread of this process (tests, notebooks, the bench):
    ``with Gateway(service) as g: ... g.url``; stopped when the block ends."""

    def __init__(self, service: Service, host: str = "127.0.0.1", port: int | None = None):
        import uvicorn

        from sgl_reason.runtime.server import free_port

        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(create_app(service), host=self.host,
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> Gateway:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start on {self.url}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


async def _sse(service: Service, job: Job, backend, scope, rid: str) -> AsyncIterator[bytes]:
    """The SSE body of a streamed request; a client that leaves cancels the program."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    def produce():
        try:
            stream_events(service, job, backend, rid,
                          lambda chunk: loop.call_soon_threadsafe(queue.put_nowait, chunk))
        except ProgramCancelled:
            pass
        except Exception as e:  # noqa: BLE001  (sent to the client as an error event)
            logger.exception("streamed program failed")
            loop.call_soon_threadsafe(queue.put_nowait, ServiceError(
                502, f"the upstream server failed: {_first_line(e)}", None, "upstream_error"))
        finally:
            service.release()
            loop.call_soon_threadsafe(queue.put_nowait, end)

    threading.Thread(target=produce, daemon=True).start()
    finished = False
    try:
        while True:
            item = await asyncio.wait_for(queue.get(), service.config.timeout_s)
            if item is end:
                finished = True
                break
            if isinstance(item, ServiceError):
                service.metrics.failed(job.tier, item.status)
                yield f"data: {json.dumps(item.body())}\n\n".encode()
                continue
            yield f"data: {json.dumps(item)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:  # the client left (or the stream timed out): free the server's KV
            scope.cancel()
            service.metrics.failed(job.tier, 499)
