"""How reproducible is the early-stop bench's agreement column? ``full`` three times.

    .venv/bin/python benchmarks/early_stop_noise.py [--concurrency 1] [--limit 50]

One embedded server, the bench's think-then-answer setup (budget 96, chunks of 16, greedy):

- ``full`` from an empty cache;
- ``full`` again, its prompts now in the radix cache (how the bench ran before it flushed);
- ``full`` again after a flush (how ``sgl-reason bench early-stop`` runs every row).

Each repeat's agreement with the first is the noise floor of the column under that regime.
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
    config = EarlyStop(signal="none", chunk_tokens=CHUNK, window=CHUNK)
    with EmbeddedRuntime() as rt:
        def run() -> list:
            with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                return list(pool.map(lambda p: think_then_answer(
                    p.question, budget=think, backend=rt.endpoint, sampling=GREEDY,
                    early_stop=config), problems))

        rt.flush_cache()
        full = _row(problems, first := run())
        full["_results"] = first
        print("full                 ", {k: v for k, v in full.items() if k != "_results"})
        print("again, prompts cached", _row(problems, run(), full))
        rt.flush_cache()
        print("again, after a flush ", _row(problems, run(), full))


if __name__ == "__main__":
    main()
