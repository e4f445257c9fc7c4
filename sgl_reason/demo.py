"""``make demo``: start the embedded server, run the reasoning programs once each, report costs, stop.

It runs sgl-reason's tiny reasoner (``--model reasoner``): a 135M model trained here to think
in ``<think>...</think>``, close its thinking itself and answer from it, on the arithmetic
families it was trained on. It shows the mechanics and what they cost (shared prefill, a
natural and a forced close, verification); its accuracy figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import logging
import time

from sgl_reason import EmbeddedRuntime
from sgl_reason.programs import ThinkingBudget, best_of_n, self_consistency, think_then_answer

QUESTION = ("Your task is to count how many legs there are in total when given a list of "
            "animals.\n\nNow, how many legs are there in total if you have 3 spiders, 2 dogs, "
            "5 chickens?\n")  # 3*8 + 2*4 + 5*2 = 42
THINK = ThinkingBudget(max_thinking_tokens=512, max_answer_tokens=96)


def _cost_line(result) -> str:
    c = result.cost
    return (f"{c.requests} requests, prefill {c.computed_prefill_tokens} computed / "
            f"{c.cached_tokens} reused, {c.decode_tokens} decoded "
            f"({c.thinking_tokens} thinking), {c.seconds:.1f} s")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    started = time.monotonic()
    with EmbeddedRuntime(model="reasoner") as rt:
        print(f"SGLang server ready at {rt.url} in {time.monotonic() - started:.1f} s "
              f"(model {rt.model_path.name})\n")
        backend = rt.endpoint
        print(f"Q: {QUESTION.strip()}\n")

        sc = self_consistency(QUESTION, n=8, think=THINK, backend=backend)
        print(f"self_consistency n=8 -> {sc.answer!r} (votes {sc.vote.votes}, agreement "
              f"{sc.vote.agreement:.2f})\n  cost: {_cost_line(sc)}")
        prompt = sc.cost.prompt_tokens // sc.cost.requests
        print(f"  the ~{prompt}-token prompt was prefilled once; 8 independent requests would "
              f"have computed ~{8 * prompt}.\n")

        for budget in (THINK, ThinkingBudget(max_thinking_tokens=32, max_answer_tokens=96)):
            tta = think_then_answer(QUESTION, budget=budget, backend=backend)
            s = tta.samples[0]
            closed = "closed by budget forcing" if s.forced else "closed by the model"
            print(f"think_then_answer (budget {budget.thinking_tokens}, route "
                  f"{tta.info['route']}) -> {tta.answer!r}\n"
                  f"  thinking {s.thinking_tokens} tokens ({closed}), answer {s.answer_tokens} "
                  f"tokens: {s.answer_text.strip()[:100]!r}\n  cost: {_cost_line(tta)}\n")

        bon = best_of_n(QUESTION, n=4, think=THINK, backend=backend)
        scores = ", ".join(f"{x.answer}:{x.score:.2f}" for x in bon.samples)
        print(f"best_of_n n=4, P(Yes) verifier -> {bon.answer!r} (answer:score {scores})\n"
              f"  cost: {_cost_line(bon)}")
    print("\nserver stopped")


if __name__ == "__main__":
    main()
