"""``sgl-reason bench early-stop``: tokens saved by each signal, and what it costs in answers.

On a seeded reasoning-gym set, in one process against one server, greedy decoding:

- ``full``: think_then_answer with the whole thinking budget, chunked like the signals (the
  ``none`` signal), so that only the stop differs;
- ``entropy``, ``probe``, ``confidence``: the same with the signal watching chunked thinking;
  ``probe_agree3`` is ``probe`` needing 3 consecutive equal probes instead of 2;
  ``probe_confident`` is ``probe`` counting only probes whose mean token probability is >= 0.4,
  read within 8 tokens (chosen with ``benchmarks/early_stop_trajectories.py``, see
  docs/benchmarks.md);
- ``half_budget``: the blind cut a signal has to beat, the ``full`` run with half the thinking
  budget (reported under ``baselines``);
- ``self_consistency`` (n samples, temperature sampling) full vs ``consensus``.

``rows`` (``--rows``) runs a subset; ``full`` always runs, as every row is compared with it.

Tokens are everything decoded for a problem (thinking, probes, answer). ``tokens_saved`` is
1 - tokens / full tokens; ``agreement_with_full`` compares the final answers problem by problem.

Every row starts from an empty radix cache and, by default, runs one problem at a time: then
greedy decoding is bit-reproducible here (``full`` run twice agrees 1.00), so the agreement
column measures the signals and nothing else. Concurrent rows batch differently and a bf16
prefill split at a cached prefix rounds differently, which alone flipped 12-16% of this weak
model's answers (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from sgl_reason.bench import publish
from sgl_reason.data import load
from sgl_reason.early_stop import EarlyStop
from sgl_reason.profiles import Sampling
from sgl_reason.programs import ThinkingBudget, self_consistency, think_then_answer
from sgl_reason.vote import normalize_answer

logger = logging.getLogger(__name__)

GREEDY = Sampling(temperature=0.0, top_p=1.0)
ANSWER_TOKENS = 16  # the answer request after thinking


def _norm(answer):
    return normalize_answer(answer) if answer else None


def _row(problems, results, reference=None) -> dict:
    n = len(problems)
    tokens = sum(r.cost.decode_tokens for r in results) / n
    row = {
        "tokens": round(tokens, 1),
        "thinking_tokens": round(sum(r.cost.thinking_tokens for r in results) / n, 1),
        "accuracy": sum(p.grade(r.answer) for p, r in zip(problems, results)) / n,
        "computed_prefill_tokens": round(sum(r.cost.computed_prefill_tokens for r in results) / n, 1),
        "requests": round(sum(r.cost.requests for r in results) / n, 2),
    }
    if reference is not None:
        row["tokens_saved"] = round(1 - tokens / reference["tokens"], 4) if reference["tokens"] else 0.0
        row["agreement_with_full"] = sum(
            _norm(a.answer) == _norm(b.answer) for a, b in zip(results, reference["_results"])) / n
    return row


# Rows of the bench: signal rows (the signal is the name up to "_") with their knobs.
SIGNAL_ROWS = {
    "entropy": {}, "probe": {}, "probe_agree3": {"probe_agree": 3},
    "probe_confident": {"probe_confidence": 0.4, "probe_tokens": 8}, "confidence": {},
}
ROWS = ("half_budget", *SIGNAL_ROWS, "consensus")


def check_rows(rows) -> tuple[str, ...]:
    """The rows to run, in bench order; unknown names raise with the valid ones."""
    rows = ROWS if rows is None else tuple(rows)
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        what = f"unknown bench row(s) {', '.join(unknown)}" if unknown else "no bench rows given"
        raise ValueError(f"{what}: choose from {', '.join(ROWS)}")
    return tuple(r for r in ROWS if r in rows)


def run(backend, dataset: str = "basic_arithmetic", limit: int = 50, budget: int = 96,
        chunk: int = 16, n: int = 8, concurrency: int = 1, seed: int = 0, rows=None) -> dict:
    rows = check_rows(rows)
    problems = load(f"reasoning-gym:{dataset}?size={limit}&seed={seed}")

    def over(fn):
        backend.flush_cache()  # every row starts from the same (empty) cache
        pool = ThreadPoolExecutor(max_workers=concurrency)
        try:
            return list(pool.map(fn, problems))
        finally:  # on Ctrl-C / SIGTERM, finish only the problems in flight, not the whole row
            pool.shutdown(wait=True, cancel_futures=True)

    def think_rows(config, thinking_budget=budget):
        think = ThinkingBudget(max_thinking_tokens=thinking_budget, max_answer_tokens=ANSWER_TOKENS,
                               mode="two")
        return over(lambda p: think_then_answer(p.question, budget=think, backend=backend,
                                                sampling=GREEDY, early_stop=config))

    baseline = EarlyStop(signal="none", chunk_tokens=chunk, window=chunk)
    full_results = think_rows(baseline)
    full = _row(problems, full_results)
    full["_results"] = full_results
    baselines, signals = {}, {}
    if "half_budget" in rows:  # the blind cut a signal has to beat: same chunking, half the budget
        half = max(chunk, budget // 2)
        baselines["half_budget"] = {**_row(problems, think_rows(baseline, half), full),
                                    "thinking_budget": half}
        logger.info("half_budget: %s", baselines["half_budget"])
    for name, knobs in SIGNAL_ROWS.items():
        if name not in rows:
            continue
        config = EarlyStop(signal=name.split("_")[0], chunk_tokens=chunk, window=chunk, **knobs)
        results = think_rows(config)
        signals[name] = _row(problems, results, full)
        signals[name]["stopped_early"] = sum(r.samples[0].stopped is not None for r in results) / len(problems)
        logger.info("%s: %s", name, signals[name])

    report = {"dataset": dataset, "seed": seed, "problems": len(problems), "thinking_budget": budget,
              "chunk_tokens": chunk, "concurrency": concurrency, "model": backend.get_model_name(),
              "full": full, "baselines": baselines, "signals": signals}
    if "consensus" in rows:
        sc_full_results = over(lambda p: self_consistency(p.question, n=n, max_tokens=48, backend=backend))
        sc_full = _row(problems, sc_full_results)
        sc_full["_results"] = sc_full_results
        consensus = EarlyStop(signal="consensus", batch=max(2, n // 2))
        results = over(lambda p: self_consistency(p.question, n=n, max_tokens=48, backend=backend,
                                                  early_stop=consensus))
        signals["consensus"] = _row(problems, results, sc_full)
        signals["consensus"]["samples_drawn"] = sum(r.info["samples_drawn"] for r in results) / len(problems)
        sc_full.pop("_results")
        report["self_consistency_full"] = {**sc_full, "n": n}
    full.pop("_results")
    return report


def table(report: dict) -> str:
    lines = [f"{report['dataset']} (seed {report['seed']}), {report['problems']} problems, "
             f"thinking budget {report['thinking_budget']}, chunks of {report['chunk_tokens']}",
             f"{'run':22} {'tokens':>8} {'saved':>7} {'accuracy':>9} {'agree w/ full':>14}"]
    f = report["full"]
    lines.append(f"{'full (think_then_answer)':22} {f['tokens']:>8} {'':>7} {f['accuracy']:>9.2f} {'':>14}")
    for name, r in [*report.get("baselines", {}).items(), *report["signals"].items()]:
        if name == "consensus":
            sc = report["self_consistency_full"]
            lines.append(f"{'full self-consistency':22} {sc['tokens']:>8} {'':>7} {sc['accuracy']:>9.2f} {'':>14}")
        lines.append(f"{name:22} {r['tokens']:>8} {r['tokens_saved']:>7.1%} {r['accuracy']:>9.2f} "
                     f"{r['agreement_with_full']:>14.2f}")
    return "\n".join(lines)


def main(args) -> int:
    from sgl_reason.connection import connect

    with connect(args.url, extra_args=args.server_arg) as backend:
        report = run(backend, dataset=args.dataset, limit=args.limit, budget=args.budget,
                     chunk=args.chunk, concurrency=args.concurrency, seed=args.seed,
                     rows=args.rows)
    publish(report, table(report), args.json)
    return 0
