"""Recipe: prefix-shared self-consistency over GSM8K, with JSONL results and a summary.

    .venv/bin/python programs/gsm8k_self_consistency.py --limit 20 --n 4 --out results/gsm8k_sc.jsonl

Without --url it starts the embedded server on --model (default: sgl-reason's tiny reasoner,
which thinks before it answers; GSM8K is harder than the gsm_symbolic problems it was trained
on, so expect low accuracy on CPU: mechanics, not accuracy). Rerunning with the same --out
resumes where it stopped. The GSM8K test split (MIT, see data/gsm8k/LICENSE) ships in the repo.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from sgl_reason.connection import connect
from sgl_reason.data import load
from sgl_reason.evaluate import run
from sgl_reason.programs import ThinkingBudget, self_consistency

DEFAULT_DATA = Path(__file__).resolve().parents[1] / "data" / "gsm8k" / "test.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-thinking-tokens", type=int, default=512)
    parser.add_argument("--max-answer-tokens", type=int, default=128)
    parser.add_argument("--model", default="reasoner", help="reasoner, smollm2 or a folder")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--out", default="results/gsm8k_self_consistency.jsonl")
    parser.add_argument("--url", default=None)
    args = parser.parse_args()

    problems = load(args.data)[: args.limit]
    think = ThinkingBudget(max_thinking_tokens=args.max_thinking_tokens,
                           max_answer_tokens=args.max_answer_tokens)
    with connect(args.url, model=None if args.url else args.model) as backend:
        program = functools.partial(self_consistency, n=args.n, think=think)
        # each problem on its own cancellable copy of the backend: Ctrl-C aborts those in flight
        summary = run(program, problems, args.out, concurrency=args.concurrency, backend=backend)
    print(json.dumps({k: v for k, v in summary.items() if k != "cost"}, indent=2))


if __name__ == "__main__":
    main()
