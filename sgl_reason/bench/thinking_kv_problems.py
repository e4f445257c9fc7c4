"""``sgl-reason bench thinking-kv --workload problems``: each thinking-KV release rule on the
tiny reasoner at its natural thinking length, graded.

Every row sends the same graded problems (``--data FILE.jsonl``, ``--limit`` per family) to one
server (``--thinking-kv-policy keep``; each row sets its rule per request in ``custom_params``),
greedy, with the budget-forcing processor at a budget that does not bind (so the model closes
its thinking itself and the release happens at its own marker token). All of a row's requests go
in **one** ``/generate`` message, so SGLang admits and batches them the same way in every row:
two rows differ only where a release changed some request's tokens (``keep_repeat``, ``keep``
sent again, measures what is left of batch noise).

| row | rule at the end of thinking |
|---|---|
| ``keep`` / ``keep_repeat`` | nothing is freed |
| ``release-on-answer`` | the window-only rule: all but the first S and last W thinking tokens |
| ``scored-5%`` ... ``scored-50%`` | also keeps that share of the thinking: the tokens the last ``observe`` steps (the marker's included) attended to most (mean over heads and layers) |
| ``scored-10%-max`` | the same, aggregated by max (not a default row) |

Per row: accuracy against the gold answer (also per family), final-answer agreement with
``keep``, mean NLL of the answer tokens, ``released_fraction`` (freed thinking KV over thinking
KV generated, averaged over requests, from each request's thinking length and the rule) beside
the server's own count of freed slots over all thinking tokens, peak KV and mean running
requests (``/v1/loads`` sampled while the row runs).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import requests

from sgl_reason.bench import publish
from sgl_reason.bench.thinking_kv import LoadSampler, chat_prompt, tokenize
from sgl_reason.data import Problem
from sgl_reason.profiles import REASONER
from sgl_reason.programs.budget import BudgetForcingProcessor
from sgl_reason.runtime.thinking_kv.policy import (
    DEFAULT_SINK,
    DEFAULT_WINDOW,
    Policy,
    columns_to_free,
)
from sgl_reason.vote.extract import extract_answer
from sgl_reason.vote import normalize_answer

ROWS = {
    "keep": {"thinking_kv_policy": "keep"},
    "keep_repeat": {"thinking_kv_policy": "keep"},
    "release-on-answer": {"thinking_kv_policy": "release-on-answer"},
    **{f"scored-{p}%": {"thinking_kv_policy": "release-on-answer", "thinking_kv_keep": p / 100}
       for p in (5, 10, 25, 50)},
    "scored-10%-max": {"thinking_kv_policy": "release-on-answer", "thinking_kv_keep": 0.1,
                       "thinking_kv_score": "max"},
}
DEFAULT_ROWS = tuple(r for r in ROWS if r != "scored-10%-max")
RELEASED_METRIC = "sgl_reason:thinking_kv_released_tokens_total"


def check_rows(rows) -> tuple[str, ...]:
    rows = tuple(rows) if rows else DEFAULT_ROWS
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    return ("keep", *[r for r in ROWS if r in rows and r != "keep"])


class ProblemWorkload:
    """The problems of one run against one server, sent as one message per row."""

    def __init__(self, url: str, problems: list[Problem], budget: int, max_answer: int):
        self.url, self.problems = url, problems
        self.budget, self.max_answer = budget, max_answer
        self.end_ids = tokenize(url, REASONER.think_end)
        self.marker_ids = tokenize(url, REASONER.end_marker)
        # what think_then_answer sends the reasoner: ChatML, thinking opened
        self.ids = [tokenize(url, chat_prompt(p.question, REASONER)) for p in problems]
        self.processor = BudgetForcingProcessor().to_str()

    def _metric(self, name: str) -> float:
        import re

        text = requests.get(self.url + "/metrics", timeout=10).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def run(self, params: dict) -> dict:
        requests.post(self.url + "/flush_cache", timeout=30).raise_for_status()
        n = len(self.problems)
        sampling = {"temperature": 0, "max_new_tokens": self.budget + len(self.end_ids)
                    + self.max_answer,
                    "custom_params": {"budget": self.budget, "end_ids": self.end_ids,
                                      "max_answer": self.max_answer, **params}}
        body = {"input_ids": self.ids, "sampling_params": [sampling] * n,
                "custom_logit_processor": [self.processor] * n, "return_logprob": True}
        released_before = self._metric(RELEASED_METRIC)
        start = time.perf_counter()
        with LoadSampler(self.url) as sampler:
            r = requests.post(self.url + "/generate", json=body, timeout=6 * 3600)
            r.raise_for_status()
        seconds = time.perf_counter() - start
        outs, samples = r.json(), sampler.samples
        return {
            "seconds": round(seconds, 1),
            "throughput_rpm": round(n / seconds * 60, 3),
            "mean_running": (round(statistics.fmean(s[0] for s in samples), 3) if samples
                             else 0.0),
            "peak_kv_tokens": max((s[1] for s in samples), default=0),
            "released_server": self._metric(RELEASED_METRIC) - released_before,
            "_outs": [self._read(o) for o in outs],
        }

    def _read(self, out: dict) -> dict:
        logprobs = out["meta_info"]["output_token_logprobs"]
        ids = [t[1] for t in logprobs]
        mark = self.marker_ids[0] if len(self.marker_ids) == 1 else None
        at = ids.index(mark) if mark in ids else None
        answer = logprobs[at + 1:] if at is not None else []
        text = out["text"].split(REASONER.end_marker, 1)[-1] if at is not None else ""
        return {"thinking": at if at is not None else len(ids), "closed": at is not None,
                "answer": extract_answer(text),
                "nll": statistics.fmean(-t[0] for t in answer) if answer else None}


def released_fraction(thinking: int, params: dict) -> float:
    """Share of a request's thinking KV its rule frees: the server's own ``columns_to_free``
    for this thinking length, with the prompt all the tree holds."""
    policy = Policy().override(params)
    if thinking == 0 or not policy.releases:
        return 0.0
    return columns_to_free(0, 0, thinking, policy, None).numel() / thinking


def summarize(problems: list[Problem], row: dict, params: dict, keep: dict | None) -> dict:
    outs = row.pop("_outs")
    n = len(problems)
    correct = [p.grade(o["answer"]) for p, o in zip(problems, outs)]
    thinking = sum(o["thinking"] for o in outs)
    result = {
        **row,
        "accuracy": round(sum(correct) / n, 4),
        "thinking_tokens": round(thinking / n, 1),
        "closed_itself": round(sum(o["closed"] for o in outs) / n, 4),
        "released_fraction": round(statistics.fmean(
            released_fraction(o["thinking"], params) for o in outs), 4),
        "released_fraction_server": round(row["released_server"] / thinking, 4) if thinking else 0,
        "answer_nll": round(statistics.fmean(o["nll"] for o in outs if o["nll"] is not None), 4),
    }
    if keep is not None:
        same = [_norm(a["answer"]) == _norm(b["answer"]) for a, b in zip(outs, keep["_outs"])]
        result["answer_agreement"] = round(sum(same) / n, 4)
    by_family = defaultdict(list)
    for i, p in enumerate(problems):
        by_family[p.family].append(i)
    result["by_family"] = {f: round(sum(correct[i] for i in ids) / len(ids), 4)
                           for f, ids in by_family.items()}
    result["_outs"] = outs
    return result


def _norm(answer):
    return normalize_answer(answer) if answer else None


def run(problems: list[Problem], rows=None, budget: int = 1024, max_answer: int = 192,
        concurrency: int = 16, pool: int = 65536, extra=()) -> dict:
    from sgl_reason import EmbeddedRuntime

    rows = check_rows(rows)
    args = ["--thinking-kv-policy", "keep", "--enable-metrics", "--max-total-tokens", str(pool),
            "--max-running-requests", str(concurrency), "--load-snapshot-publish-interval", "1",
            *extra]
    report_rows: dict[str, dict] = {}
    with EmbeddedRuntime(model="reasoner", extra_args=args) as rt:
        work = ProblemWorkload(rt.url, problems, budget, max_answer)
        warm = ProblemWorkload(rt.url, problems[:1], 16, 8)
        warm.run({})  # first-use compilation outside the rows
        for name in rows:
            raw = work.run(ROWS[name])
            report_rows[name] = summarize(problems, raw, ROWS[name],
                                          report_rows.get("keep"))
    keep = report_rows["keep"]
    for row in report_rows.values():
        row["mean_running_vs_keep"] = (round(row["mean_running"] / keep["mean_running"], 3)
                                       if keep["mean_running"] else 0.0)
    for row in report_rows.values():
        row.pop("_outs")
    return {"workload": "problems", "problems": len(problems), "budget": budget,
            "max_answer": max_answer, "concurrency": concurrency, "max_total_tokens": pool,
            "sink": DEFAULT_SINK, "window": DEFAULT_WINDOW, "policies": report_rows}


def table(report: dict) -> str:
    lines = ["| row | released fraction (server) | accuracy | answer agreement with keep | "
             "answer NLL | thinking tokens | peak KV | mean running | requests/min |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["policies"].items():
        lines.append(f"| {name} | {r['released_fraction']} ({r['released_fraction_server']}) | "
                     f"{r['accuracy']} | {r.get('answer_agreement', '-')} | {r['answer_nll']} | "
                     f"{r['thinking_tokens']} | {r['peak_kv_tokens']} | {r['mean_running']} | "
                     f"{r['throughput_rpm']} |")
    return "\n".join(lines)


def main(args, problems: list[Problem]) -> int:
    report = run(problems, rows=args.rows, concurrency=args.concurrency, extra=args.server_arg)
    publish(report, table(report), args.json)
    return 0
