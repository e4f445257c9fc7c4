"""``sgl-reason bench prompt-drift``: what whitespace drift in a shared prefix costs the prefix
cache, and what normalization gets back.

A stream of requests shares a few-shot system prompt, as a service's requests do; each request
asks its own question. Real clients build that prefix through different code paths, so copies
drift in ways no one sees: ``\\r\\n`` line endings, a trailing space, a double space, a no-break
space, a decomposed accent, an extra blank line (:data:`DRIFTS`, each request drawing its own
mix). Three streams, each after a cache flush and sent one request at a time (greedy answers
then depend on the prompt alone, not on batching):

| stream | prefix | program normalizes |
|---|---|---|
| ``drift_free`` | the clean prefix | no |
| ``raw`` | drifted copies | no (``normalize_prompt=False``) |
| ``normalized`` | the same drifted copies | yes (the default) |

Hit rate is the server's ``cached_tokens / prompt_tokens`` over the stream. ``answers_identical``
compares the normalized stream's generated text with the drift-free stream's, request by request;
``answers_changed_by_drift`` counts how many the raw stream changed.
"""

from __future__ import annotations

import logging
import random
import unicodedata

from sgl_reason.backend import ReasonBackend
from sgl_reason.bench import publish
from sgl_reason.cost import Cost
from sgl_reason.profiles import Sampling
from sgl_reason.programs.budget import ThinkingBudget
from sgl_reason.programs.think_then_answer import think_then_answer

logger = logging.getLogger(__name__)

SYSTEM = """You are a careful arithmetic tutor at the Café Lumière study club.
Work through each problem step by step, one operation at a time, and check your result.

Here are solved examples in the house style.

Example 1. Problem: 12 + 7 - 5 =
Steps: 12 + 7 = 19. 19 - 5 = 14. Check: 14 + 5 = 19, and 19 - 7 = 12.
Answer: 14

Example 2. Problem: 40 - 13 + 8 =
Steps: 40 - 13 = 27. 27 + 8 = 35. Check: 35 - 8 = 27, and 27 + 13 = 40.
Answer: 35

Example 3. Problem: 6 + 9 + 21 - 4 =
Steps: 6 + 9 = 15. 15 + 21 = 36. 36 - 4 = 32. Check: 32 + 4 = 36, 36 - 21 = 15, 15 - 9 = 6.
Answer: 32

Example 4. Problem: 55 - 18 - 7 =
Steps: 55 - 18 = 37. 37 - 7 = 30. Check: 30 + 7 = 37, and 37 + 18 = 55.
Answer: 30

State the final answer on its own last line as "The answer is N"."""


def _crlf(text: str, rng: random.Random) -> str:
    return text.replace("\n", "\r\n")


def _trailing_space(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    i = rng.randrange(len(lines))
    body = lines[i].removesuffix("\r")  # the spaces go before a \r\n line ending
    lines[i] = body + " " * rng.randint(1, 3) + lines[i][len(body):]
    return "\n".join(lines)


def _double_space(text: str, rng: random.Random) -> str:
    at = [i for i, c in enumerate(text) if c == " "]
    i = rng.choice(at)
    return text[:i] + "  " + text[i + 1:]


def _no_break_space(text: str, rng: random.Random) -> str:
    return text.replace(". ", ".\u00a0", 1)


def _decomposed(text: str, rng: random.Random) -> str:
    return unicodedata.normalize("NFD", text)


def _blank_line(text: str, rng: random.Random) -> str:
    return text.replace("\n\n", "\n\n\n", 1) if rng.random() < 0.5 else "\n" + text + "\n"


def _tab(text: str, rng: random.Random) -> str:
    return text.replace("Steps: ", "Steps:\t", 1)


DRIFTS = (_crlf, _trailing_space, _double_space, _no_break_space, _decomposed, _blank_line, _tab)


def drifted(text: str, rng: random.Random, p_clean: float = 0.2) -> str:
    """A copy of ``text`` as one client would send it: clean with probability ``p_clean``, else
    with one to three drifts."""
    if rng.random() < p_clean:
        return text
    for drift in rng.sample(DRIFTS, rng.randint(1, 3)):
        text = drift(text, rng)
    return text


def questions(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        terms = [rng.randint(2, 99) for _ in range(rng.randint(3, 4))]
        expr = " ".join(f"{'+' if k == 0 or rng.random() < 0.6 else '-'} {t}" if k else str(t)
                        for k, t in enumerate(terms))
        out.append(f"State the final answer to the following arithmetic problem: {expr} =")
    return out


def _stream(backend: ReasonBackend, prompts: list[tuple[str, str]], normalize: bool,
            budget: ThinkingBudget) -> tuple[Cost, list[str]]:
    backend.flush_cache()
    total, texts = Cost(), []
    for system, question in prompts:
        result = think_then_answer(question, system=system, budget=budget, backend=backend,
                                   sampling=Sampling(temperature=0), normalize_prompt=normalize)
        total = total + result.cost
        texts.append(result.samples[0].text)
    return total, texts


def _row(cost: Cost) -> dict:
    return {"hit_rate": round(cost.cached_tokens / cost.prompt_tokens, 4),
            "prompt_tokens": cost.prompt_tokens, "cached_tokens": cost.cached_tokens,
            "computed_prefill_tokens": cost.computed_prefill_tokens,
            "decode_tokens": cost.decode_tokens, "seconds": round(cost.seconds, 2)}


def run(backend: ReasonBackend, requests: int = 24, seed: int = 0, thinking: int = 48,
        answer: int = 32) -> dict:
    rng = random.Random(seed)
    qs = questions(requests, seed)
    copies = [drifted(SYSTEM, rng) for _ in qs]
    budget = ThinkingBudget(max_thinking_tokens=thinking, max_answer_tokens=answer)
    clean, clean_texts = _stream(backend, [(SYSTEM, q) for q in qs], False, budget)
    raw, raw_texts = _stream(backend, list(zip(copies, qs)), False, budget)
    normed, normed_texts = _stream(backend, list(zip(copies, qs)), True, budget)
    rows = {"drift_free": _row(clean), "raw": _row(raw), "normalized": _row(normed)}
    return {
        "model": backend.get_model_name(), "requests": requests, "seed": seed,
        "distinct_prefixes": len(set(copies)), "thinking_budget": thinking,
        "hit_rate_drift_free": rows["drift_free"]["hit_rate"],
        "hit_rate_raw": rows["raw"]["hit_rate"],
        "hit_rate_normalized": rows["normalized"]["hit_rate"],
        "normalized_vs_drift_free": round(rows["normalized"]["hit_rate"]
                                          / rows["drift_free"]["hit_rate"], 4),
        "prefill_ratio_raw_vs_normalized": round(raw.computed_prefill_tokens
                                                 / normed.computed_prefill_tokens, 3),
        "answers_identical": normed_texts == clean_texts,
        "answers_changed_by_drift": sum(a != b for a, b in zip(raw_texts, clean_texts)),
        "rows": rows,
    }


def table(report: dict) -> str:
    lines = [f"{'stream':11} {'hit rate':>9} {'prompt':>8} {'cached':>8} {'computed':>9} "
             f"{'decoded':>8} {'seconds':>8}"]
    for name, r in report["rows"].items():
        lines.append(f"{name:11} {r['hit_rate']:>9.3f} {r['prompt_tokens']:>8} "
                     f"{r['cached_tokens']:>8} {r['computed_prefill_tokens']:>9} "
                     f"{r['decode_tokens']:>8} {r['seconds']:>8.1f}")
    lines.append(
        f"{report['requests']} requests, {report['distinct_prefixes']} distinct prefixes: "
        f"normalized/drift-free hit rate {report['normalized_vs_drift_free']:.3f}, prefill "
        f"raw/normalized {report['prefill_ratio_raw_vs_normalized']:.2f}x, answers identical: "
        f"{report['answers_identical']}, changed by raw drift: {report['answers_changed_by_drift']}")
    return "\n".join(lines)


def main(args) -> int:
    from sgl_reason.connection import connect

    model = None if args.url else args.model
    with connect(args.url, model=model, extra_args=args.server_arg) as backend:
        report = run(backend, requests=args.requests, seed=args.seed)
    publish(report, table(report), args.json)
    return 0
