"""How reproducible is the early-stop bench's agreement column? ``full`` twice, then ``probe``.

    .venv/bin/python benchmarks/early_stop_noise.py [--concurrency 1] [--limit 50]

One embedded server, the bench's think-then-answer setup (budget 96, chunks of 16, greedy). The
second ``full`` run is identical to the first except that its prompts are now in the radix
cache, so its agreement with the first is the column's noise floor at this concurrency.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

from sgl_reason import EmbeddedRuntime
from sgl_reason.bench.early_stop import GREEDY, _row
from sgl_reason.data import load
from sgl_reason.early_stop import EarlyStop
from sgl_reason.programs import ThinkingBudget, think_then_answer

BUDGET, CHUNK = 96, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--limit", type=int, default=50)
    args = parser.parse_args()
    problems = load(f"reasoning-gym:basic_arithmetic?size={args.limit}&seed=0")
    think = ThinkingBudget(max_thinking_tokens=BUDGET, max_answer_tokens=16, mode="two")
    with EmbeddedRuntime() as rt:
        def run(signal: str) -> list:
            config = EarlyStop(signal=signal, chunk_tokens=CHUNK, window=CHUNK)
            with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                return list(pool.map(lambda p: think_then_answer(
                    p.question, budget=think, backend=rt.endpoint, sampling=GREEDY,
                    early_stop=config), problems))

        full = _row(problems, first := run("none"))
        full["_results"] = first
        print("full      ", {k: v for k, v in full.items() if k != "_results"})
        print("full again", _row(problems, run("none"), full))
        print("probe     ", _row(problems, run("probe"), full))


if __name__ == "__main__":
    main()
