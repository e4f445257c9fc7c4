"""``sgl-reason bench soak``: mixed load, aborts, disconnects and hostile input against a small
pool, then an account of every request and every KV slot.

Aimed only at servers it starts itself, on 127.0.0.1, with SGLang's strict memory checks on
(a leaked or double-freed slot fails the server) and a pool small enough that SGLang retracts
requests under the load. One row per server:

| row | server |
|---|---|
| ``bf16`` | the tiny reasoner, 16-bit KV, ``--thinking-kv-policy keep`` |
| ``fp8-per-token`` | the same with ``--kv-cache-dtype fp8_e4m3 --kv-scale per-token`` |

Requests (seeded mix, ``--concurrency`` in flight): plain generation; think-then-answer forced
closed by the budget and closing naturally, each under a thinking-KV policy drawn per request;
``fork`` groups (self-consistency, n = 4, thinking); aborts mid-prefill, mid-thinking, mid-answer
and of a whole fork group; client disconnects mid-stream; hostile bodies (wrong types and ranges
in every ``custom_params`` key the plugin reads, a budget past the context, an empty prompt, a
marker longer than the budget, an unknown policy) that must be answered 4xx. At the end, after
the queues drain and a cache flush: KV slots in use must be 0, the server log must hold no error,
and every request must have an outcome (``unaccounted`` counts those that had none, or the wrong
one: a hostile body accepted, a plain request failed).
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import requests

from sgl_reason.backend import ProgramCancelled, ReasonBackend
from sgl_reason.bench import publish
from sgl_reason.profiles import PROFILES
from sgl_reason.programs.budget import KV_POLICIES, BudgetForcingProcessor, ThinkingBudget

logger = logging.getLogger(__name__)

ROWS = {"bf16": [], "fp8-per-token": ["--kv-cache-dtype", "fp8_e4m3", "--kv-scale", "per-token"]}
STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
          "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
KINDS = {  # weight of each kind in the mix
    "plain": 4, "forced": 4, "natural": 1, "fork": 1, "abort_prefill": 1, "abort_thinking": 1,
    "abort_answer": 1, "abort_fork": 1, "disconnect": 1, "hostile": 3,
}
POLICIES = [p for p in KV_POLICIES if p != "demote"]  # demote needs its own server (see docs)
_ERROR_LINE = re.compile(r"Traceback|\bERROR\b|Exception|Error:|Fatal|[Ll]eak")
_REFUSAL = re.compile(r"\[http_server\] Error: ")
_RETRACTED = re.compile(r"Retract requests\. #retracted_reqs: (\d+)")
FILLER = " The shop also sells pens, paper, glue and string, all at fixed prices."
# A request's client timeout. The default shape overloads the pool on purpose (16 in flight,
# room for about two long requests), so a request may queue for many minutes: a 600 s timeout
# turned 22 of 807 requests into client timeouts in the first 1,000-request run. Latency is
# reported instead (p50, p99, max per row); a request past this is still unaccounted.
REQUEST_TIMEOUT_S = 1800


class Soak:
    """One server's soak: builds the requests, sends them, classifies each outcome."""

    def __init__(self, backend: ReasonBackend, seed: int, light: bool = False):
        self.backend, self.url = backend, backend.base_url
        # light (CI): the same kinds with short generations; the full soak's long ones (600-token
        # plain requests, 256-token thinking left running by a disconnect) cost minutes there
        self.long = 64 if light else 600
        self.thinking = 48 if light else 256
        self.natural = 96 if light else 1024  # light: a budget that usually binds
        self.rng = random.Random(seed)
        self.profile = PROFILES["reasoner"]
        self.end_ids = backend.fixed_ids(self.profile.think_end)
        self.marker_ids = backend.fixed_ids(self.profile.end_marker)
        self.processor = BudgetForcingProcessor.to_str()
        self.aborts = 0
        self._lock = threading.Lock()

    # -- request bodies ---------------------------------------------------------------------------
    def prompt(self, question: str, think: bool = True) -> str:
        text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        return text + (self.profile.think_start if think else "")

    def question(self, rng: random.Random) -> str:
        terms = " + ".join(str(rng.randint(2, 99)) for _ in range(rng.randint(3, 4)))
        return f"State the final answer to the following arithmetic problem: {terms} ="

    def forced_body(self, rng, budget: int, answer: int, policy: str | None,
                    question: str | None = None) -> dict:
        params = {"budget": budget, "end_ids": self.end_ids, "marker_ids": self.marker_ids,
                  "max_answer": answer}
        if policy is not None:
            params["thinking_kv_policy"] = policy
        return {"text": self.prompt(question or self.question(rng)),
                "custom_logit_processor": self.processor,
                "sampling_params": {"temperature": 0.7, "custom_params": params,
                                    "max_new_tokens": budget + len(self.end_ids) + answer + 1}}

    def hostile_bodies(self, rng) -> list[tuple[str, dict]]:
        ok = self.forced_body(rng, 16, 8, None)

        def with_params(**changes):
            body = json.loads(json.dumps(ok))
            body["sampling_params"]["custom_params"].update(changes)
            return body

        long_question = self.question(rng) + FILLER * 1200
        return [
            ("budget_str", with_params(budget="16")),
            ("budget_negative", with_params(budget=-3)),
            ("end_ids_str", with_params(end_ids="</think>")),
            ("end_ids_past_vocab", with_params(end_ids=[10 ** 9])),
            ("marker_ids_empty", with_params(marker_ids=[])),
            ("max_answer_zero", with_params(max_answer=0)),
            ("min_answer_above_max", with_params(min_answer=50)),
            ("policy_unknown", with_params(thinking_kv_policy="forget")),
            ("policy_int", with_params(thinking_kv_policy=3)),
            ("window_str", with_params(thinking_kv_window="big")),
            ("sink_negative", with_params(thinking_kv_sink=-1)),
            ("marker_longer_than_budget", with_params(budget=0, end_ids=list(range(5, 40)))),
            ("budget_past_context", {**ok, "sampling_params": {
                **ok["sampling_params"], "max_new_tokens": 10 ** 6}}),
            ("empty_prompt", {"text": "", "sampling_params": {"max_new_tokens": 8}}),
            ("prompt_past_context", {"text": long_question,
                                     "sampling_params": {"max_new_tokens": 8}}),
        ]

    # -- sending ---------------------------------------------------------------------------------
    def abort(self, rid: str) -> None:
        requests.post(self.url + "/abort_request", json={"rid": rid}, timeout=30)
        with self._lock:
            self.aborts += 1

    def generate(self, body: dict) -> str:
        return _status(requests.post(self.url + "/generate", json=body,
                                     timeout=REQUEST_TIMEOUT_S))

    def stream(self, body: dict, stop_after: int | None, abort: bool,
               abort_after_s: float | None = None) -> str:
        """Stream ``body``; after ``stop_after`` chunks (or ``abort_after_s`` seconds, from a
        timer: mid-prefill) abort it, or just leave. Returns the outcome."""
        with self._lock:
            rid = body.setdefault("rid", f"soak-{self.rng.getrandbits(64):016x}")
        timer = None
        if abort_after_s is not None:
            timer = threading.Timer(abort_after_s, self.abort, (rid,))
            timer.start()
        try:
            return self._stream(body, rid, stop_after, abort)
        finally:
            if timer is not None:
                timer.cancel()

    def _stream(self, body: dict, rid: str, stop_after: int | None, abort: bool) -> str:
        chunks = 0
        with requests.post(self.url + "/generate", json={**body, "stream": True}, stream=True,
                           timeout=REQUEST_TIMEOUT_S) as r:
            if r.status_code != 200:
                return f"error:{r.status_code}"
            for line in r.iter_lines():
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    if abort:
                        self.abort(rid)
                        continue  # read on: the server ends the stream with an abort
                    return "disconnected"
                finish = (json.loads(line[5:]).get("meta_info") or {}).get("finish_reason")
                if finish and finish.get("type") == "abort":
                    return "aborted"
        return "aborted" if abort and stop_after is not None else "answered"

    def one(self, i: int, kind: str) -> tuple[str, str, float]:
        """(kind, outcome, seconds) of request ``i``."""
        start = time.monotonic()
        kind, outcome = self._one(i, kind)
        return kind, outcome, time.monotonic() - start

    def _one(self, i: int, kind: str) -> tuple[str, str]:
        rng = random.Random(f"{i}-{kind}")
        policy = rng.choice(POLICIES)
        try:
            if kind == "plain":
                body = {"text": self.prompt(self.question(rng), think=False),
                        "sampling_params": {"max_new_tokens": rng.choice((16, 64, self.long)),
                                            "temperature": 0.7}}  # long ones fill the pool
                return kind, self.generate(body)
            if kind == "forced":
                body = self.forced_body(rng, rng.randint(8, 96), rng.randint(4, 48), policy)
                return kind, self.generate(body)
            if kind == "natural":
                body = self.forced_body(rng, self.natural, 64, policy)
                return kind, self.generate(body)
            if kind == "fork":
                from sgl_reason.programs.self_consistency import self_consistency

                self_consistency(self.question(rng), n=4, backend=self.backend,
                                 think=ThinkingBudget(max_thinking_tokens=rng.randint(16, 64),
                                                      max_answer_tokens=24), kv_policy=policy)
                return kind, "answered"
            if kind == "abort_prefill":
                body = {"text": self.prompt(self.question(rng) + FILLER * 40),
                        "sampling_params": {"max_new_tokens": 64}}
                return kind, self.stream(body, stop_after=None, abort=False,
                                         abort_after_s=rng.uniform(0.0, 0.4))
            if kind == "abort_thinking":
                return kind, self.stream(self.forced_body(rng, self.thinking, 32, policy),
                                         stop_after=rng.randint(3, 40), abort=True)
            if kind == "abort_answer":
                return kind, self.stream(self.forced_body(rng, 8, 96, policy),
                                         stop_after=rng.randint(16, 40), abort=True)
            if kind == "abort_fork":
                return kind, self.abort_fork(rng, policy)
            if kind == "disconnect":
                return kind, self.stream(self.forced_body(rng, self.thinking, 32, policy),
                                         stop_after=rng.randint(2, 30), abort=False)
            if kind == "hostile":
                name, body = rng.choice(self.hostile_bodies(rng))
                r = requests.post(self.url + "/generate", json=body, timeout=REQUEST_TIMEOUT_S)
                told = 400 <= r.status_code < 500 and len(r.text) > 10
                return f"hostile:{name}", "rejected" if told else f"accepted:{r.status_code}"
        except requests.RequestException as error:
            return kind, f"error:{type(error).__name__}"
        raise ValueError(f"unknown kind {kind}")

    def abort_fork(self, rng, policy: str) -> str:
        from sgl_reason.programs.self_consistency import self_consistency

        backend, scope = self.backend.cancellable()
        timer = threading.Timer(rng.uniform(0.2, 3.0), lambda: self.count_cancel(scope))
        timer.start()
        try:
            self_consistency(self.question(rng), n=4, backend=backend,
                             think=ThinkingBudget(max_thinking_tokens=self.thinking,
                                                  max_answer_tokens=24),
                             kv_policy=policy)
            return "answered"  # finished before the abort landed
        except ProgramCancelled:
            return "aborted"
        finally:
            timer.cancel()

    def count_cancel(self, scope) -> None:
        n = scope.cancel()
        with self._lock:
            self.aborts += n


def _status(r: requests.Response) -> str:
    if r.status_code == 200:
        finish = (r.json().get("meta_info") or {}).get("finish_reason") or {}
        return "aborted" if finish.get("type") == "abort" else "answered"
    return f"error:{r.status_code}:{r.text[:120]}"


EXPECTED = {  # the outcomes a kind may have; anything else is unaccounted
    "plain": {"answered"}, "forced": {"answered"}, "natural": {"answered"},
    "fork": {"answered"}, "abort_prefill": {"aborted", "answered"},
    "abort_thinking": {"aborted", "answered"}, "abort_answer": {"aborted", "answered"},
    "abort_fork": {"aborted", "answered"}, "disconnect": {"disconnected", "answered"},
}


def _metric(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text,
                                            re.M))


def soak_row(row: str, extra: list[str], requests_n: int, seconds: float, concurrency: int,
             pool: int, seed: int, light: bool = False) -> dict:
    from sgl_reason.runtime.embedded import EmbeddedRuntime

    log: list[str] = []
    rt = EmbeddedRuntime(model="reasoner", env=STRICT, extra_args=[
        "--thinking-kv-policy", "keep", "--enable-metrics", "--max-total-tokens", str(pool),
        *extra])
    rt.server.log_sink = log.append  # every line, for the error count
    with rt, warnings.catch_warnings():
        # SGLang's executor warns with a traceback for every cancelled fork branch
        warnings.filterwarnings("ignore", message="Error in stream_executor")
        ready_at = len(log)  # start-up notices are not the soak's errors
        soak = Soak(rt.endpoint, seed, light)
        kinds = random.Random(seed).choices(list(KINDS), weights=list(KINDS.values()),
                                            k=requests_n)
        started = time.monotonic()
        workers = ThreadPoolExecutor(max_workers=concurrency)
        try:
            futures = []
            for i, kind in enumerate(kinds):
                if time.monotonic() - started > seconds:
                    break
                futures.append(workers.submit(soak.one, i, kind))
                while sum(not f.done() for f in futures) >= 2 * concurrency:
                    time.sleep(0.05)
            results = [f.result() for f in futures]
        except BaseException:
            # interrupted (Ctrl-C, SIGTERM): drop what has not started, and leave the with-block
            # now, so the server stops and the requests in flight fail at once instead of
            # holding the exit for their timeout
            workers.shutdown(wait=False, cancel_futures=True)
            raise
        workers.shutdown()
        elapsed = time.monotonic() - started
        outcomes = [(k, o) for k, o, _ in results]
        latency = sorted(t for _, _, t in results)
        deadline = time.monotonic() + 120  # drain: aborted and disconnected requests end
        while time.monotonic() < deadline:
            load = requests.get(rt.url + "/v1/loads", timeout=10).json()["loads"][0]
            if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
                break
            time.sleep(0.5)
        rt.flush_cache()
        time.sleep(1.0)
        load = requests.get(rt.url + "/v1/loads", timeout=10).json()["loads"][0]
        metrics = requests.get(rt.url + "/metrics", timeout=10).text
        still_serves = requests.post(rt.url + "/generate", timeout=120, json={
            "text": "2 + 2 =", "sampling_params": {"max_new_tokens": 4}}).status_code == 200
        stopping_at = len(log)  # the stop's own lines (a Ctrl-C traceback) are not the soak's
    counts = Counter(f"{k.split(':')[0]}:{o.split(':')[0]}" for k, o in outcomes)
    unaccounted = [(k, o) for k, o in outcomes
                   if (o not in EXPECTED.get(k, {"rejected"}))]
    after = log[ready_at:stopping_at]
    # "[http_server] Error: ..." is the server telling a client why its request was refused
    # (the hostile bodies' 400s): counted apart, not as server errors
    refusals = [line for line in after if _REFUSAL.search(line)]
    errors = [line for line in after if _ERROR_LINE.search(line) and not _REFUSAL.search(line)]
    return {
        "row": row, "requests": len(outcomes), "seconds": round(elapsed, 1),
        "outcomes": dict(sorted(counts.items())),
        # SGLang 0.5.23 exports no retraction counter here (its gauge resets each interval);
        # the scheduler's warning line names each retraction
        "retractions": sum(int(n) for line in after for n in _RETRACTED.findall(line)),
        "releases": int(_metric(metrics, "sgl_reason:thinking_kv_released_tokens_total")),
        "aborts": soak.aborts,
        "leaked_slots": load["num_used_tokens"],
        "queued_after": load["num_running_reqs"] + load["num_waiting_reqs"],
        "server_errors": len(errors), "server_error_samples": errors[:5],
        "refusals_logged": len(refusals),
        "unaccounted": len(unaccounted),
        # each distinct (kind, outcome) with its count, the hostile body's name included
        "unaccounted_samples": dict(Counter(f"{k} -> {o[:100]}"
                                            for k, o in unaccounted).most_common(10)),
        "serves_after": still_serves, "stray_processes": len(rt.server.group_pids()),
        "pool_tokens": pool,
        "latency_s": {"p50": _quantile(latency, 0.5), "p99": _quantile(latency, 0.99),
                      "max": round(latency[-1], 1) if latency else None},
    }


def _quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of sorted ``values`` (nearest rank)."""
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


def run(requests_n: int = 1000, seconds: float = 3600, concurrency: int = 16, pool: int = 1536,
        seed: int = 0, rows: tuple[str, ...] = tuple(ROWS), extra_args: tuple = (),
        light: bool = False) -> dict:
    """``requests_n`` requests in all, shared evenly by ``rows`` (one server each, in turn);
    ``seconds`` bounds each row's sending."""
    for row in rows:
        if row not in ROWS:
            raise ValueError(f"unknown soak row {row!r}: {', '.join(ROWS)}")
    report = {"seed": seed, "concurrency": concurrency, "pool_tokens": pool, "rows": {}}
    for i, row in enumerate(rows):
        share = requests_n // len(rows) + (i < requests_n % len(rows))
        report["rows"][row] = soak_row(row, [*ROWS[row], *extra_args], share, seconds,
                                       concurrency, pool, seed, light)
        logger.info("%s: %s", row, report["rows"][row])
    keys = ("requests", "retractions", "releases", "aborts", "leaked_slots", "server_errors",
            "unaccounted", "seconds")
    for key in keys:  # the totals over rows, at the top of the report
        report[key] = sum(r[key] for r in report["rows"].values())
    report["outcomes"] = dict(sum((Counter(r["outcomes"]) for r in report["rows"].values()),
                                  Counter()))
    return report


def table(report: dict) -> str:
    lines = [f"{'row':14} {'requests':>8} {'retract':>8} {'released':>9} {'aborts':>7} "
             f"{'leaked':>7} {'errors':>7} {'unacct':>7} {'seconds':>8} {'p50 s':>6} "
             f"{'p99 s':>6} {'max s':>6}"]
    for name, r in report["rows"].items():
        lat = r["latency_s"]
        lines.append(f"{name:14} {r['requests']:>8} {r['retractions']:>8} {r['releases']:>9} "
                     f"{r['aborts']:>7} {r['leaked_slots']:>7} {r['server_errors']:>7} "
                     f"{r['unaccounted']:>7} {r['seconds']:>8} {lat['p50']!s:>6} "
                     f"{lat['p99']!s:>6} {lat['max']!s:>6}")
    lines.append("outcomes: " + ", ".join(f"{k} {v}" for k, v in report["outcomes"].items()))
    return "\n".join(lines)


def main(args) -> int:
    if args.url:
        print("sgl-reason: error: the soak starts its own servers on 127.0.0.1 (with strict "
              "memory checks and a small pool); drop --url")
        return 2
    report = run(requests_n=args.requests, seconds=args.seconds, concurrency=args.concurrency,
                 pool=args.max_total_tokens, seed=args.seed, rows=args.rows,
                 extra_args=tuple(args.server_arg))
    publish(report, table(report), args.json)
    ok = (report["leaked_slots"] == 0 and report["server_errors"] == 0
          and report["unaccounted"] == 0)
    return 0 if ok else 1
