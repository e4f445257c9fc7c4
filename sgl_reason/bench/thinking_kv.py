"""``sgl-reason bench thinking-kv``: how many reasoning requests a fixed KV pool runs at once,
under stock SGLang and under each thinking-KV policy, and what each policy costs in answers.

Every request of the workload is forced to the same shape, so rows differ only by policy: a
prompt of about P tokens, exactly T thinking tokens (EOS masked, then the profile's
end-of-thinking marker forced by :class:`BudgetForcingProcessor`), then exactly A answer tokens
(EOS masked until the last, which is forced), greedy. The requests end by EOS, not by
``ignore_eos``, so SGLang's admission estimates their length as it would for real traffic. All
M requests are sent at once to a server whose pool holds only part of them; SGLang's scheduler
admits what fits.

| row | server |
|---|---|
| ``stock`` | ``SGLANG_PLUGINS=sgl_reason_cpu``: SGLang's own radix cache and scheduling, on this project's CPU attention; the thinking-KV plugin is not loaded |
| ``keep``, ``strip``, ``release-on-answer``, ``scored-25%``, ``release-on-pressure`` | one server, ``--thinking-kv-policy keep``; the rule is set per request (``custom_params``): ``scored-25%`` is release-on-answer keeping 25% of the thinking by attention score, ``release-on-pressure`` frees the same tokens as release-on-answer but only when decode runs short |
| ``demote`` | its own server, ``--thinking-kv-policy demote`` (it needs priority eviction) |

While a row runs, ``/v1/loads`` (refreshed every step) is sampled every ``POLL_S``: mean running
requests is the mean of the samples (a time average), over the whole run and over the samples
where requests were still waiting for room (the concurrency the pool supports, without the
run's tail); peak KV tokens is the largest ``num_used_tokens``. Quality against ``keep``: the
final answer (the first number after the marker), the answer tokens position by position, and
the mean NLL of the answer tokens as the model generated them. Greedy bf16 decoding is not
batch-invariant, so concurrent rows differ by noise too: ``stock``, ``strip`` and ``demote``
cannot change a running request's tokens, and their agreement with ``keep`` is that noise floor.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from sgl_reason import EmbeddedRuntime
from sgl_reason.bench import publish
from sgl_reason.profiles import PROMPTED, REASONER, ModelProfile
from sgl_reason.programs.budget import BudgetForcingProcessor
from sgl_reason.runtime.thinking_kv import DEFAULT_SINK, DEFAULT_WINDOW

logger = logging.getLogger(__name__)

POLL_S = 0.25
DEFAULT_SHAPE = (32, 256, 256)
SECOND_SHAPE = (32, 400, 100)
SECOND_SHARE = 0.6  # the second shape runs 60% of the requests: the bench stays under 20 min
# rows on the keep server, each rule set per request (custom_params)
SCORED_KEEP = 0.25  # scored retention's share of the thinking in the forced rows
POLICY_ROWS = {
    "keep": {"thinking_kv_policy": "keep"},
    "strip": {"thinking_kv_policy": "strip"},
    "release-on-answer": {"thinking_kv_policy": "release-on-answer"},
    f"scored-{round(SCORED_KEEP * 100)}%": {"thinking_kv_policy": "release-on-answer",
                                            "thinking_kv_keep": SCORED_KEEP},
    "release-on-pressure": {"thinking_kv_policy": "release-on-pressure"},
}
STOCK_ENV = {"SGLANG_PLUGINS": "sgl_reason_cpu"}
QUESTIONS = [f"What is {a} + {b}?" for a, b in
             [(17, 25), (38, 46), (123, 77), (59, 64), (212, 389), (45, 55), (81, 19), (66, 27),
              (140, 260), (33, 99), (72, 18), (505, 495), (29, 13), (88, 12), (301, 199),
              (47, 53), (64, 36), (250, 125), (91, 9), (73, 84), (11, 89), (150, 350), (5, 95),
              (222, 333)]]
FILLER = " Show every step."


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        p, t, a = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--shape takes P,T,A (three integers), got {text!r}") from None
    if p < 1 or t < 1 or a < 1:
        raise ValueError(f"--shape values must be >= 1, got {text!r}")
    return p, t, a


def ideal_gain(prompt: int, thinking: int, marker: int, answer: int,
               sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW) -> float:
    """Time-averaged KV of one request under ``keep`` over that under ``release-on-answer``:
    at every decode step the request holds its prompt and its tokens so far, less the released
    thinking once the marker is complete."""
    released = max(0, thinking - sink - window)
    steps = range(1, thinking + marker + answer + 1)
    keep = sum(prompt + k for k in steps)
    release = sum(prompt + k - (released if k >= thinking + marker else 0) for k in steps)
    return keep / release


def tokenize(url: str, text: str) -> list[int]:
    r = requests.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                      timeout=30)
    r.raise_for_status()
    return list(r.json()["tokens"])


def chat_prompt(question: str, profile: ModelProfile) -> str:
    """A ChatML user turn, the assistant turn opened and thinking started."""
    return (f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
            f"{profile.think_start}")


class LoadSampler:
    """``/v1/loads`` sampled every ``POLL_S`` on a thread while the block runs: ``samples`` is a
    list of (running requests, used KV tokens, waiting requests)."""

    def __init__(self, url: str):
        self.url, self.samples = url, []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._done.is_set():
            try:
                load = requests.get(self.url + "/v1/loads", timeout=10).json()["loads"][0]
                self.samples.append((load["num_running_reqs"], load["num_used_tokens"],
                                     load["num_waiting_reqs"]))
            except requests.RequestException:
                pass
            self._done.wait(POLL_S)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


class Workload:
    """M forced-shape requests against one server."""

    def __init__(self, url: str, shape: tuple[int, int, int], requests_n: int,
                 profile: ModelProfile = PROMPTED):
        self.url, self.shape, self.n, self.profile = url, shape, requests_n, profile
        self.end_ids = self._tokenize(profile.think_end)
        # a model that closes its thinking by itself (the reasoner) may not before the budget
        marker = self._tokenize(profile.end_marker)
        self.no_early_close = marker if profile.end_token is not None else None
        self.prompts = [self._prompt(QUESTIONS[i % len(QUESTIONS)], shape[0])
                        for i in range(requests_n)]
        self.prompt_tokens = statistics.fmean(len(self._tokenize(p)) for p in self.prompts)
        self.processor = BudgetForcingProcessor().to_str()

    def _tokenize(self, text: str) -> list[int]:
        return tokenize(self.url, text)

    def _prompt(self, question: str, target: int) -> str:
        q = question
        while len(self._tokenize(chat_prompt(q, self.profile))) < target:
            q += FILLER
        return chat_prompt(q, self.profile)

    def body(self, i: int, policy: str | dict | None) -> dict:
        """Request i; ``policy``: a policy name, or ``custom_params`` keys of a rule."""
        _, thinking, answer = self.shape
        params = {"budget": thinking, "end_ids": self.end_ids, "min_answer": answer,
                  "max_answer": answer}
        if self.no_early_close:
            params["eos_ids"] = self.no_early_close  # masked until the forced marker
        if isinstance(policy, dict):
            params.update(policy)
        elif policy is not None:
            params["thinking_kv_policy"] = policy
        return {
            "text": self.prompts[i],
            "sampling_params": {"temperature": 0, "custom_params": params,
                                "max_new_tokens": thinking + len(self.end_ids) + answer},
            "custom_logit_processor": self.processor,
            "return_logprob": True,
        }

    def warm_up(self) -> None:
        """One short request: first-use compilation and caches happen outside the rows."""
        body = self.body(0, None)
        body["sampling_params"]["max_new_tokens"] = 8
        requests.post(self.url + "/generate", json=body, timeout=600).raise_for_status()

    def run(self, policy: str | dict | None) -> dict:
        """Send all requests at once; sample the server's load until the last one finishes."""
        requests.post(self.url + "/flush_cache", timeout=30)

        def send(i):
            r = requests.post(self.url + "/generate", json=self.body(i, policy), timeout=3600)
            r.raise_for_status()
            return r.json()

        start = time.perf_counter()
        with LoadSampler(self.url) as sampler, ThreadPoolExecutor(max_workers=self.n) as pool:
            outs = list(pool.map(send, range(self.n)))
        seconds = time.perf_counter() - start
        samples = sampler.samples
        running = [r for r, _, _ in samples]
        saturated = [r for r, _, waiting in samples if waiting > 0]
        return {
            "seconds": round(seconds, 2),
            "throughput_rpm": round(self.n / seconds * 60, 3),
            "mean_running": round(statistics.fmean(running), 3) if running else 0.0,
            # while requests wait for room: the concurrency the pool supports, without the tail
            # of the run where the queue is empty and fewer requests remain than fit
            "mean_running_saturated": (round(statistics.fmean(saturated), 3) if saturated
                                       else 0.0),
            "peak_kv_tokens": max((u for _, u, _ in samples), default=0),
            "samples": len(samples),
            "completion_tokens": [o["meta_info"]["completion_tokens"] for o in outs],
            "answers": [self.answer_of(o) for o in outs],
        }

    def answer_of(self, out: dict) -> dict:
        """The answer part of one output: its token ids, final answer and mean NLL."""
        logprobs = out["meta_info"]["output_token_logprobs"]
        ids = [t[1] for t in logprobs]
        n = len(self.end_ids)
        at = next((i for i in range(len(ids) - n + 1) if ids[i:i + n] == self.end_ids), None)
        answer = logprobs[at + n:-1] if at is not None else []  # the last is the forced EOS
        text = out["text"].split(self.profile.think_end.strip(), 1)[-1]
        return {
            "ids": [t[1] for t in answer],
            "final": _first_number(text),
            "nll": statistics.fmean(-t[0] for t in answer) if answer else None,
        }


def _first_number(text: str) -> str | None:
    import re

    match = re.search(r"-?\d+(?:\.\d+)?", text)
    return match.group(0) if match else None


def quality(row: dict, keep: dict) -> dict:
    """Answer agreement with ``keep`` (final answers; answer tokens position by position)."""
    pairs = list(zip(row["answers"], keep["answers"]))
    finals = [a["final"] == b["final"] for a, b in pairs]
    tokens = [sum(x == y for x, y in zip(a["ids"], b["ids"])) / max(1, len(b["ids"]))
              for a, b in pairs]
    nll = [a["nll"] for a, _ in pairs if a["nll"] is not None]
    return {
        "answer_agreement": round(statistics.fmean(finals), 3),
        "answer_token_agreement": round(statistics.fmean(tokens), 3),
        "answer_nll": round(statistics.fmean(nll), 4) if nll else None,
    }


def _server(flags: list[str], env: dict | None, pool: int, extra: list[str],
            model: str | None = None) -> EmbeddedRuntime:
    # /v1/loads is a snapshot SGLang refreshes every N decode steps; every step here
    fresh = ["--load-snapshot-publish-interval", "1"]
    return EmbeddedRuntime(model=model,
                           extra_args=["--max-total-tokens", str(pool), *fresh, *flags, *extra],
                           env=env)


def _strip_private(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("answers", "completion_tokens")}


def run(requests_n: int = 10, pool: int = 1400, shape=DEFAULT_SHAPE,
        second_shape=SECOND_SHAPE, extra: list[str] = (), model: str | None = None) -> dict:
    profile = REASONER if model == "reasoner" else PROMPTED
    rows: dict[str, dict] = {}

    def server(flags, env=None):
        return _server(flags, env, pool, extra, model)

    with server([], STOCK_ENV) as rt:
        work = Workload(rt.url, shape, requests_n, profile)
        work.warm_up()
        rows["stock"] = work.run(None)
    with server(["--thinking-kv-policy", "keep", "--enable-metrics"]) as rt:
        work = Workload(rt.url, shape, requests_n, profile)
        work.warm_up()
        for name, params in POLICY_ROWS.items():
            rows[name] = work.run(params)
        second = {}
        if second_shape:
            work2 = Workload(rt.url, second_shape, max(2, round(requests_n * SECOND_SHARE)),
                             profile)
            for policy in ("keep", "release-on-answer"):
                second[policy] = work2.run(policy)
    with server(["--thinking-kv-policy", "demote"]) as rt:
        work = Workload(rt.url, shape, requests_n, profile)
        work.warm_up()
        rows["demote"] = work.run(None)

    marker = len(work.end_ids)
    for name, row in rows.items():
        row.update(quality(row, rows["keep"]))
        for key in ("mean_running", "mean_running_saturated"):
            row[f"{key}_vs_keep"] = (round(row[key] / rows["keep"][key], 3)
                                     if rows["keep"][key] else 0.0)
        expected = shape[1] + marker + shape[2]
        if any(c != expected for c in row["completion_tokens"]):
            raise RuntimeError(f"row {name}: lengths {row['completion_tokens']} are not the "
                               f"forced {expected}; rows would not be comparable")
    report = {
        "model": model or "smollm2",
        "requests": requests_n,
        "max_total_tokens": pool,
        "shape": {"prompt": round(work.prompt_tokens, 1), "thinking": shape[1], "marker": marker,
                  "answer": shape[2], "sink": DEFAULT_SINK, "window": DEFAULT_WINDOW},
        "policies": {name: _strip_private(row) for name, row in rows.items()},
        "ideal_gain": round(ideal_gain(shape[0], shape[1], marker, shape[2]), 3),
        "concurrency_gain_release_vs_keep": _gain(rows, "mean_running"),
        "concurrency_gain_release_vs_keep_while_waiting": _gain(rows, "mean_running_saturated"),
        "throughput_keep_vs_stock": round(
            rows["keep"]["throughput_rpm"] / rows["stock"]["throughput_rpm"], 3),
        "throughput_release_vs_keep": round(
            rows["release-on-answer"]["throughput_rpm"] / rows["keep"]["throughput_rpm"], 3),
    }
    if second:
        for row in second.values():
            row.update(quality(row, second["keep"]))
        report["second_shape"] = {
            "requests": len(work2.prompts),
            "shape": {"prompt": second_shape[0], "thinking": second_shape[1], "marker": marker,
                      "answer": second_shape[2]},
            "policies": {name: _strip_private(row) for name, row in second.items()},
            "ideal_gain": round(ideal_gain(second_shape[0], second_shape[1], marker,
                                           second_shape[2]), 3),
            "concurrency_gain_release_vs_keep": _gain(second, "mean_running"),
            "concurrency_gain_release_vs_keep_while_waiting": _gain(second,
                                                                    "mean_running_saturated"),
        }
    return report


def _gain(rows: dict, key: str) -> float:
    keep = rows["keep"][key]
    return round(rows["release-on-answer"][key] / keep, 3) if keep else 0.0


def table(report: dict) -> str:
    header = ("| shape | row | peak KV tokens | mean running (queue waiting) | mean running "
              "(whole run) | vs keep (queue waiting) | requests/min | answer agreement | "
              "answer-token agreement | answer NLL |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]

    def add(shape, rows):
        s = f"{shape['prompt']},{shape['thinking']},{shape['answer']}"
        for name, r in rows.items():
            lines.append(f"| {s} | {name} | {r['peak_kv_tokens']} | "
                         f"{r['mean_running_saturated']} | {r['mean_running']} | "
                         f"{r.get('mean_running_saturated_vs_keep', '-')} | "
                         f"{r['throughput_rpm']} | {r['answer_agreement']} | "
                         f"{r['answer_token_agreement']} | {r['answer_nll']} |")

    add(report["shape"], report["policies"])
    if "second_shape" in report:
        add(report["second_shape"]["shape"], report["second_shape"]["policies"])
    lines.append("")
    lines.append(f"release-on-answer vs keep, mean running: "
                 f"{report['concurrency_gain_release_vs_keep']} (while requests wait: "
                 f"{report['concurrency_gain_release_vs_keep_while_waiting']}; "
                 f"ideal {report['ideal_gain']})")
    if "second_shape" in report:
        s = report["second_shape"]
        lines.append(f"second shape: {s['concurrency_gain_release_vs_keep']} (while requests "
                     f"wait: {s['concurrency_gain_release_vs_keep_while_waiting']}; "
                     f"ideal {s['ideal_gain']})")
    lines.append(f"keep vs stock, throughput: {report['throughput_keep_vs_stock']}; "
                 f"release-on-answer vs keep: {report['throughput_release_vs_keep']}")
    return "\n".join(lines)


HELDOUT = Path(__file__).resolve().parents[2] / "data" / "reasoner_heldout.jsonl"  # in the repo


def main(args) -> int:
    if args.url:
        raise SystemExit("sgl-reason bench thinking-kv starts its own servers (a stock one and "
                         "policy ones at the same pool); drop --url.")
    if args.workload == "problems":
        from sgl_reason.bench import thinking_kv_problems
        from sgl_reason.bench.early_stop import REASONER_FAMILIES, problem_set

        try:
            thinking_kv_problems.check_rows(args.rows)
        except ValueError as error:
            raise SystemExit(f"--rows: {error}") from None
        problems = problem_set(args.data or HELDOUT, limit=args.limit,
                               families=None if args.data else REASONER_FAMILIES)
        return thinking_kv_problems.main(args, problems)
    report = run(requests_n=args.requests, pool=args.max_total_tokens, shape=args.shape,
                 extra=args.server_arg, model=args.model,
                 second_shape=SECOND_SHAPE if args.shape == DEFAULT_SHAPE else None)
    publish(report, table(report), args.json)
    return 0
