"""How accurate is each chain way of a reasoner when its plan line is forced? (issue #16,
session 35, written for v10)

    .venv/bin/python experiments/forced_plan.py URL DATA.jsonl OUT.jsonl [--family chain_sum]
    .venv/bin/python experiments/forced_plan.py URL DATA.jsonl --probe-only

First it reads, per problem, the served model's probability of each way's first plan token
after ``Plan:`` (top-5 logprobs at temperature 1): greedy takes the likelier way, and training
meant these to match ``traces.ORDER_WEIGHTS``. It prints their mean and how many problems each
way wins.

Greedy takes one way only, so a greedy run measures one way. This script then writes each
problem's prompt, the opened thinking and a plan line naming one way (``traces.ORDERS``), and
lets the served model go on greedily (up to 1,536 + 192 new tokens, no budget forcing), once
per way. It
prints per way: accuracy, and per problem pair whether the ways fail apart (one right, the
other wrong), which is what a vote over the ways can gain from. Records (one per problem and
way) go to OUT.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
from concurrent.futures import ThreadPoolExecutor

import requests

from sgl_reason.data import load
from sgl_reason.reasoner.train import chat_prompt
from sgl_reason.reasoner.traces import ORDERS, THINK_END, chain_plan
from sgl_reason.vote.extract import extract_answer


def first_token_odds(url: str, problem) -> dict[str, float]:
    """P(first token of each way's name | prompt, opened thinking, ``Plan:``)."""
    out = requests.post(f"{url}/generate", timeout=600, json={
        "text": chat_prompt(problem.question) + "Plan:",
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True, "top_logprobs_num": 5, "return_text_in_logprobs": True}).json()
    first = out["meta_info"]["output_top_logprobs"][0]
    top = {text: math.exp(logprob) for logprob, _, text in first}
    return {way: top.get(" " + ORDERS[way].split()[0], 0.0) for way in ORDERS}


def run_one(url: str, problem, way: str) -> dict:
    prefix = chain_plan(way) + "\n"
    out = requests.post(f"{url}/generate", timeout=1800, json={
        "text": chat_prompt(problem.question) + prefix,
        "sampling_params": {"max_new_tokens": 1536 + 192, "temperature": 0}}).json()
    text = prefix + out["text"]
    thinking, closed, answer_text = text.partition(THINK_END)
    answer = extract_answer(answer_text) if closed else None
    return {"id": problem.id, "way": way, "gold": problem.gold, "answer": answer,
            "correct": bool(answer is not None and problem.grade(answer)),
            "closed": bool(closed), "tokens": out["meta_info"]["completion_tokens"],
            "text": text}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("data")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--probe-only", action="store_true")
    parser.add_argument("--family", default="chain_sum")
    parser.add_argument("--concurrency", type=int, default=12)
    args = parser.parse_args()
    problems = [p for p in load(args.data) if p.family == args.family]
    with ThreadPoolExecutor(args.concurrency) as pool:
        odds = list(pool.map(lambda p: first_token_odds(args.url, p), problems))
    for way in ORDERS:
        mean = sum(o[way] for o in odds) / len(odds)
        wins = sum(o[way] > max(v for w, v in o.items() if w != way) for o in odds)
        print(f"{way:6s} first plan token: mean probability {mean:.3f}, likelier on {wins} of "
              f"{len(odds)} problems")
    if args.probe_only:
        return
    if args.out is None:
        parser.error("OUT.jsonl is needed unless --probe-only")
    jobs = [(p, way) for p in problems for way in ORDERS]
    with ThreadPoolExecutor(args.concurrency) as pool:
        records = list(pool.map(lambda job: run_one(args.url, *job), jobs))
    with open(args.out, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    by = {(r["id"], r["way"]): r["correct"] for r in records}
    for way in ORDERS:
        right = [by[(p.id, way)] for p in problems]
        print(f"{way:6s} accuracy {sum(right) / len(right):.3f} ({sum(right)} of {len(right)})")
    a, b = list(ORDERS)
    apart = [(by[(p.id, a)], by[(p.id, b)]) for p in problems]
    print(f"both right {sum(x and y for x, y in apart)}, both wrong "
          f"{sum(not x and not y for x, y in apart)}, only {a} right "
          f"{sum(x and not y for x, y in apart)}, only {b} right "
          f"{sum(y and not x for x, y in apart)} (of {len(apart)} problems)")


if __name__ == "__main__":
    main()
