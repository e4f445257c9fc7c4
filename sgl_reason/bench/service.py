"""``sgl-reason bench service``: what the OpenAI-compatible gateway costs and how it holds load.

One reasoner server (``--thinking-kv-policy keep``) and the gateway on a thread of this process,
bound to 127.0.0.1. Three parts, in one run:

1. **Prefix sharing through the API**: the same request (the prompt-drift bench's few-shot
   system prompt and a question) with ``n = 1`` and ``n = 8`` (each after a cache flush); ``prefill_ratio_n8_vs_n1`` is the ratio of the prefill computed, read
   from each reply's ``usage``.
2. **Gateway overhead**: the same greedy request through the gateway (the ``openai`` client)
   and by calling :func:`~sgl_reason.think_then_answer` directly, alternated ``--reps`` times
   after a warm-up; ``time_ratio_service_vs_direct`` is the ratio of the summed wall times.
3. **Load**: ``--requests`` requests of mixed tiers (low, medium, high in turn, each its own
   question) sent by an asyncio client that keeps ``--concurrency`` in flight: throughput,
   latency percentiles by tier, errors.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time

from sgl_reason.backend import ReasonBackend
from sgl_reason.bench import publish
from sgl_reason.bench.prompt_drift import SYSTEM
from sgl_reason.profiles import Sampling
from sgl_reason.programs.budget import ThinkingBudget
from sgl_reason.programs.think_then_answer import think_then_answer

logger = logging.getLogger(__name__)

QUESTION = "State the final answer to the following arithmetic problem: 58 + 27 - 39 ="
# A service's requests carry a system prompt; the few-shot one of the prompt-drift bench
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def _questions(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"State the final answer to the following arithmetic problem: {rng.randint(10, 99)} "
            f"+ {rng.randint(10, 99)} - {rng.randint(1, 9)} =" for _ in range(n)]


def _percentiles(values: list[float]) -> dict:
    v = sorted(values)

    def at(q):
        return round(v[min(len(v) - 1, int(q * len(v)))], 2)
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": round(v[-1], 2)}


def prefill_sharing(client, backend: ReasonBackend, budget: int) -> dict:
    rows = {}
    for n in (1, 8):
        backend.flush_cache()
        r = client.chat.completions.create(
            model="reasoner", n=n, messages=MESSAGES, max_tokens=64, extra_body={"max_thinking_tokens": budget})
        ledger = r.usage.model_extra["sgl_reason"]
        rows[f"n{n}"] = {"computed_prefill_tokens": ledger["computed_prefill_tokens"],
                         "prompt_tokens": r.usage.prompt_tokens,
                         "completion_tokens": r.usage.completion_tokens,
                         "requests": ledger["requests"]}
    rows["prefill_ratio_n8_vs_n1"] = round(
        rows["n8"]["computed_prefill_tokens"] / rows["n1"]["computed_prefill_tokens"], 4)
    return rows


def overhead(client, backend: ReasonBackend, budget: int, reps: int) -> dict:
    messages = MESSAGES
    plan = ThinkingBudget(max_thinking_tokens=budget, max_answer_tokens=64)

    def direct():
        return think_then_answer(messages, budget=plan, backend=backend,
                                 sampling=Sampling(temperature=0)).samples[0].text

    def service():
        r = client.chat.completions.create(
            model="reasoner", messages=messages, max_tokens=64, temperature=0,
            extra_body={"max_thinking_tokens": budget})
        return r.choices[0].message

    direct(), service()  # warm: the prompt is cached for both from here on
    times = {"direct": [], "service": []}
    for _ in range(reps):
        for name, call in (("direct", direct), ("service", service)):
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {"reps": reps, "direct_seconds": [round(x, 3) for x in times["direct"]],
            "service_seconds": [round(x, 3) for x in times["service"]],
            "time_ratio_service_vs_direct": round(sum(times["service"])
                                                  / sum(times["direct"]), 4)}


async def _load(url: str, requests: int, concurrency: int, seed: int) -> dict:
    import httpx

    tiers = ("low", "medium", "high")
    questions = _questions(requests, seed)
    latencies: dict[str, list[float]] = {t: [] for t in tiers}
    errors, tokens = [], 0
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, http):
        nonlocal tokens
        tier = tiers[i % 3]
        body = {"model": "reasoner", "reasoning_effort": tier, "max_tokens": 64,
                "messages": [{"role": "user", "content": questions[i]}]}
        async with gate:
            start = time.perf_counter()
            r = await http.post(url + "/v1/chat/completions", json=body)
            took = time.perf_counter() - start
        if r.status_code != 200:
            errors.append(f"{r.status_code}: {r.text[:200]}")
            return
        latencies[tier].append(took)
        tokens += r.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=3600) as http:
        await asyncio.gather(*(one(i, http) for i in range(requests)))
    seconds = time.perf_counter() - start
    done = sum(len(v) for v in latencies.values())
    return {"requests": requests, "concurrency": concurrency, "errors": len(errors),
            "error_samples": errors[:3], "seconds": round(seconds, 1),
            "requests_per_s": round(done / seconds, 4),
            "completion_tokens_per_s": round(tokens / seconds, 2),
            "latency_by_tier": {t: _percentiles(v) for t, v in latencies.items() if v}}


def run(backend: ReasonBackend, reps: int = 3, requests: int = 24, concurrency: int = 4,
        budget: int = 64, seed: int = 0) -> dict:
    import openai

    from sgl_reason.service import Gateway, Service, ServiceConfig

    service = Service(backend, ServiceConfig(max_concurrency=max(8, concurrency)), "reasoner")
    with Gateway(service) as gateway:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
        sharing = prefill_sharing(client, backend, budget)
        cost = overhead(client, backend, budget, reps)
        load = asyncio.run(_load(gateway.url, requests, concurrency, seed))
    return {"model": backend.get_model_name(), "thinking_budget": budget,
            "prefill_ratio_n8_vs_n1": sharing["prefill_ratio_n8_vs_n1"],
            "time_ratio_service_vs_direct": cost["time_ratio_service_vs_direct"],
            "sharing": sharing, "overhead": cost, "load": load}


def table(report: dict) -> str:
    s, o, load = report["sharing"], report["overhead"], report["load"]
    lines = [
        f"prefill computed: n=1 {s['n1']['computed_prefill_tokens']}, n=8 "
        f"{s['n8']['computed_prefill_tokens']} -> {report['prefill_ratio_n8_vs_n1']:.3f}x",
        f"gateway vs direct ({o['reps']} reps each, median {statistics.median(o['service_seconds']):.2f}"
        f" s vs {statistics.median(o['direct_seconds']):.2f} s): "
        f"{report['time_ratio_service_vs_direct']:.3f}x",
        f"load: {load['requests']} requests at concurrency {load['concurrency']} in "
        f"{load['seconds']} s, {load['requests_per_s']} req/s, "
        f"{load['completion_tokens_per_s']} completion tok/s, errors {load['errors']}",
    ]
    for tier, p in load["latency_by_tier"].items():
        lines.append(f"  {tier:6} latency p50 {p['p50']} s, p90 {p['p90']} s, p99 {p['p99']} s")
    return "\n".join(lines)


def main(args) -> int:
    from sgl_reason.connection import connect

    conn = connect(args.url) if args.url else connect(
        model=args.model, extra_args=["--thinking-kv-policy", "keep", *args.server_arg])
    with conn as backend:
        report = run(backend, reps=args.reps, requests=args.requests,
                     concurrency=args.concurrency)
    publish(report, table(report), args.json)
    return 0
