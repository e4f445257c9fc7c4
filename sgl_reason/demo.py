"""``make demo``: start the embedded server, run the reasoning programs once each, report costs, stop.

SmolLM2-135M is a weak model: the demo shows the mechanics and what they cost (shared prefill,
budget forcing, verification), not accuracy.
"""

from __future__ import annotations

import logging
import time

from sgl_reason import EmbeddedRuntime
from sgl_reason.programs import ThinkingBudget, best_of_n, self_consistency, think_then_answer

QUESTION = "Tom has 3 boxes with 4 apples each. He eats 2 apples. How many apples are left?"


def _cost_line(result) -> str:
    c = result.cost
    return (f"{c.requests} requests, prefill {c.computed_prefill_tokens} computed / "
            f"{c.cached_tokens} reused, {c.decode_tokens} decoded "
            f"({c.thinking_tokens} thinking), {c.seconds:.1f} s")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    started = time.monotonic()
    with EmbeddedRuntime() as rt:
        print(f"SGLang server ready at {rt.url} in {time.monotonic() - started:.1f} s "
              f"(model {rt.model_path.name})\n")
        backend = rt.endpoint
        print(f"Q: {QUESTION}\n")

        sc = self_consistency(QUESTION, n=8, max_tokens=64, backend=backend)
        print(f"self_consistency n=8 -> {sc.answer!r} (votes {sc.vote.votes}, agreement "
              f"{sc.vote.agreement:.2f})\n  cost: {_cost_line(sc)}")
        prompt = sc.cost.prompt_tokens // sc.cost.requests
        print(f"  the ~{prompt}-token prompt was prefilled once; 8 independent requests would "
              f"have computed ~{8 * prompt}.\n")

        budget = ThinkingBudget(max_thinking_tokens=48, max_answer_tokens=16)
        tta = think_then_answer(QUESTION, budget=budget, backend=backend)
        s = tta.samples[0]
        print(f"think_then_answer (budget 48, route {tta.info['route']}) -> {tta.answer!r}\n"
              f"  thinking {s.thinking_tokens} tokens{' (closed by budget forcing)' if s.forced else ''}"
              f", answer {s.answer_tokens} tokens: {s.answer_text.strip()[:80]!r}\n"
              f"  cost: {_cost_line(tta)}\n")

        bon = best_of_n(QUESTION, n=4, max_tokens=64, backend=backend)
        scores = ", ".join(f"{x.answer}:{x.score:.2f}" for x in bon.samples)
        print(f"best_of_n n=4, P(Yes) verifier -> {bon.answer!r} (answer:score {scores})\n"
              f"  cost: {_cost_line(bon)}")
    print("\nserver stopped")


if __name__ == "__main__":
    main()
