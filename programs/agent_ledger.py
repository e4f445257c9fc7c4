"""Recipe: a multi-step agent that reasons at every step and carries only its answers.

    .venv/bin/python programs/agent_ledger.py --steps 8 --total-budget 1024

A shop's till over a day: each step adds a sale and takes an expense from the previous step's
total (``{prev}``), thinking first. Earlier steps' thinking is dropped from the context and its
KV stripped, and the per-step budget shrinks as the run's thinking budget is spent
(:func:`sgl_reason.programs.agent_steps`). Prints each step's budget, thinking, answer and the
true running total, then the run's cost. ``--carry everything`` runs the naive program that keeps
all thinking in the context, for comparison (``sgl-reason bench agent`` measures both).
"""

from __future__ import annotations

import argparse

from sgl_reason.bench.agent import plan
from sgl_reason.connection import connect
from sgl_reason.profiles import Sampling
from sgl_reason.programs import agent_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-budget", type=int, default=256)
    parser.add_argument("--total-budget", type=int, default=None)
    parser.add_argument("--carry", choices=("answers", "everything"), default="answers")
    parser.add_argument("--url", default=None, help="a server with --thinking-kv-policy "
                        "(default: start the reasoner with it)")
    args = parser.parse_args()

    context, steps, moves, start = plan(args.steps, args.seed)
    with (connect(args.url) if args.url else
          connect(model="reasoner", extra_args=["--thinking-kv-policy", "keep"])) as backend:
        result = agent_steps(context, steps, first=str(start), step_budget=args.step_budget,
                             total_budget=args.total_budget, carry=args.carry, backend=backend,
                             sampling=Sampling(temperature=0))
    total = start
    for k, (sample, budget, (a, b)) in enumerate(zip(result.samples, result.info["budgets"],
                                                     moves)):
        total += a - b
        print(f"step {k + 1:2}: budget {budget:4}, thought {sample.thinking_tokens:4} "
              f"(forced: {sample.forced!s:5}), answer {sample.answer!s:>6}, true {total}")
    print(result.cost)


if __name__ == "__main__":
    main()
