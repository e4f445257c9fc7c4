"""``sgl-reason bench prefix-sharing``: what sharing one prefill across N samples saves.

Three rows in one run, each after a cache flush, all with ``ignore_eos`` so every sample decodes
exactly ``new_tokens``:

- ``single``: one sample of the prompt.
- ``naive``: N independent requests, sent concurrently, that share no cache (each prompt starts
  with its own request number, so no prefix matches; this is what a client without prefix
  sharing, or a server ignoring ``n``, pays).
- ``shared``: :func:`self_consistency` with N forks off one committed prefill.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from sgl_reason.backend import ReasonBackend
from sgl_reason.bench import publish
from sgl_reason.cost import Cost
from sgl_reason.profiles import PROMPTED, Sampling
from sgl_reason.programs.self_consistency import self_consistency

logger = logging.getLogger(__name__)

QUESTION = "Using the facts above, how many of the listed numbers are even? Answer with a number."


def long_context(backend: ReasonBackend, target_tokens: int) -> str:
    """A deterministic context of about ``target_tokens`` tokens (measured by the server)."""
    lines, text = [], ""
    i = 0
    while True:
        lines.append(f"Fact {i}: the number {i * 7 + 3} is {'even' if (i * 7 + 3) % 2 == 0 else 'odd'}.")
        i += 1
        if i % 50 == 0:
            text = "\n".join(lines)
            if len(backend.tokenize(text)) >= target_tokens:
                break
    # trim to the target by whole lines
    while len(lines) > 1 and len(backend.tokenize("\n".join(lines[:-1]))) >= target_tokens:
        lines.pop()
    return "\n".join(lines)


def _row(cost: Cost) -> dict:
    return {
        "computed_prefill_tokens": cost.computed_prefill_tokens,
        "cached_tokens": cost.cached_tokens,
        "prompt_tokens": cost.prompt_tokens,
        "decode_tokens": cost.decode_tokens,
        "requests": cost.requests,
        "seconds": round(cost.seconds, 3),
    }


def run(backend: ReasonBackend, n: int = 8, prompt_tokens: int = 2000, new_tokens: int = 32,
        seed: int = 0) -> dict:
    context = long_context(backend, prompt_tokens)
    sampling = Sampling(temperature=0.7, top_p=0.95, ignore_eos=True)
    profile = PROMPTED.model_copy(update={"answer_format": ""})

    def one(prefix: str = "") -> Cost:
        result = self_consistency(prefix + context + "\n\n" + QUESTION, n=1, max_tokens=new_tokens,
                                  backend=backend, profile=profile, sampling=sampling)
        return result.cost

    backend.flush_cache()
    single = one()

    backend.flush_cache()
    with ThreadPoolExecutor(max_workers=n) as pool:
        import time

        start = time.perf_counter()
        costs = list(pool.map(lambda i: one(f"Request {i}.\n"), range(n)))
        naive = sum(costs, Cost()).model_copy(update={"seconds": time.perf_counter() - start})

    backend.flush_cache()
    shared = self_consistency(context + "\n\n" + QUESTION, n=n, max_tokens=new_tokens,
                              backend=backend, profile=profile, sampling=sampling).cost

    return {
        "n": n, "prompt_tokens": single.prompt_tokens, "new_tokens": new_tokens,
        "model": backend.get_model_name(),
        "single": _row(single), "naive": _row(naive), "shared": _row(shared),
        "prefill_ratio_shared_vs_single": shared.computed_prefill_tokens / single.computed_prefill_tokens,
        "prefill_ratio_naive_vs_single": naive.computed_prefill_tokens / single.computed_prefill_tokens,
        "time_ratio_shared_vs_naive": shared.seconds / naive.seconds,
        "time_ratio_shared_vs_single": shared.seconds / single.seconds,
    }


def table(report: dict) -> str:
    rows = [f"{'run':8} {'prefill computed':>17} {'cached':>8} {'decoded':>8} {'requests':>9} {'seconds':>8}"]
    for name in ("single", "naive", "shared"):
        r = report[name]
        rows.append(f"{name:8} {r['computed_prefill_tokens']:>17} {r['cached_tokens']:>8} "
                    f"{r['decode_tokens']:>8} {r['requests']:>9} {r['seconds']:>8.2f}")
    rows.append(
        f"n={report['n']}, prompt {report['prompt_tokens']} tokens, {report['new_tokens']} new tokens: "
        f"prefill shared/single = {report['prefill_ratio_shared_vs_single']:.3f}, "
        f"naive/single = {report['prefill_ratio_naive_vs_single']:.2f}, "
        f"time shared/naive = {report['time_ratio_shared_vs_naive']:.2f}"
    )
    return "\n".join(rows)


def main(args) -> int:
    from sgl_reason.connection import connect

    with connect(args.url, extra_args=args.server_arg) as backend:
        report = run(backend, n=args.n, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
    publish(report, table(report), args.json)
    return 0
