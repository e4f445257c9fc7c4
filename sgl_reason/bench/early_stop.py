"""``sgl-reason bench early-stop``: tokens saved by each signal, and what it costs in answers.

On a graded problem set (``--data FILE.jsonl``, or reasoning-gym families with ``--dataset``;
default: the tiny reasoner's three arithmetic families), against one server, greedy decoding:

- ``full``: think_then_answer at the model's natural thinking length (a ``--budget`` that does
  not bind), chunked like the signals (the ``none`` signal), so that only the stop differs;
- ``half_budget``: the blind cut a signal has to beat: ``full`` with a thinking budget of half
  its median natural thinking length (measured in the same run);
- ``entropy``, ``probe``, ``confidence``: the same with the signal watching chunked thinking
  at its defaults (Dynasor-CoT's probe every chunk, 2 equal answers); ``probe_agree3`` needs 3
  equal probes; ``probe_confident`` counts only probes whose mean token probability is >= 0.4,
  read within 8 tokens (chosen on SmolLM2, docs/benchmarks.md); ``probe_cue`` probes only
  after the model's own transition words (the profile's ``transition_cues``, DEER's trigger)
  and stops on the first probe whose mean token probability is >= 0.9: the rule registered
  for the reasoner before its held-out run (docs/benchmarks.md);
- ``full_repeat``: ``full`` again (not a default row): the noise floor of the agreement column
  at this concurrency;
- ``consensus``, ``deepconf_low``, ``deepconf_high``: self-consistency (n samples at the
  profile's temperature, thinking) stopped by the ``consensus`` signal or by DeepConf online
  (``SC_ROWS``) against full n-sample voting, on the first ``--sc-limit`` problems of each
  family.

Tokens are everything decoded for a problem (thinking, probes, answer). ``tokens_saved`` is
1 - tokens / full tokens; ``agreement_with_full`` compares the final answers problem by
problem; ``accuracy`` is against the gold answer, also per family (``by_family``).

Every row starts from an empty radix cache. One problem at a time (``--concurrency 1``) greedy
decoding is bit-reproducible here; with several in flight, batches differ and bf16 rounds
differently, which flips some answers of a weak model: ``full_repeat`` measures how many.
"""

from __future__ import annotations

import logging
import statistics
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from sgl_reason.bench import publish
from sgl_reason.data import Problem, gym_problems, load_jsonl, load_reasoning_gym
from sgl_reason.early_stop import EarlyStop
from sgl_reason.profiles import Sampling
from sgl_reason.programs import ThinkingBudget, self_consistency, think_then_answer
from sgl_reason.programs.common import resolve_profile
from sgl_reason.vote import normalize_answer

logger = logging.getLogger(__name__)

GREEDY = Sampling(temperature=0.0, top_p=1.0)
REASONER_FAMILIES = ("chain_sum", "basic_arithmetic", "leg_counting")

# Rows of the bench: signal rows (the signal is the name up to "_") with their knobs;
# "profile" as probe_cues means the served model's transition cues.
SIGNAL_ROWS = {
    "entropy": {}, "probe": {}, "probe_agree3": {"probe_agree": 3},
    "probe_confident": {"probe_confidence": 0.4, "probe_tokens": 8},
    "probe_cue": {"probe_cues": "profile", "probe_agree": 1, "probe_confidence": 0.9},
    "confidence": {},
}
# Self-consistency rows (n samples, thinking) against full n-sample voting: ESC/Adaptive-
# Consistency's consensus windows of n/2; DeepConf online, n/2 warm-up traces setting the
# threshold that keeps their top 10% (DeepConf-low) or 90% (DeepConf-high).
def _deepconf(keep_top: float):
    return lambda n, chunk: EarlyStop(signal="confidence", chunk_tokens=chunk, window=chunk,
                                      warmup=max(1, n // 2), keep_top=keep_top)


SC_ROWS = {
    "consensus": lambda n, chunk: EarlyStop(signal="consensus", batch=max(2, n // 2)),
    "deepconf_low": _deepconf(0.1),
    "deepconf_high": _deepconf(0.9),
}
ROWS = ("half_budget", *SIGNAL_ROWS, "full_repeat", *SC_ROWS)
DEFAULT_ROWS = tuple(r for r in ROWS if r != "full_repeat")


def check_rows(rows) -> tuple[str, ...]:
    """The rows to run, in bench order; unknown names raise with the valid ones."""
    rows = DEFAULT_ROWS if rows is None else tuple(rows)
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        what = f"unknown bench row(s) {', '.join(unknown)}" if unknown else "no bench rows given"
        raise ValueError(f"{what}: choose from {', '.join(ROWS)}")
    return tuple(r for r in ROWS if r in rows)


def problem_set(data: str | None = None, datasets=REASONER_FAMILIES, limit: int = 50,
                seed: int = 0, families=None) -> list[Problem]:
    """``limit`` problems per family: the first ones of each family of a JSONL file (``data``,
    filtered to ``families``), or reasoning-gym's ``datasets`` from ``seed``; a family of the
    tiny reasoner gets the reasoner's generator config (sgl_reason/reasoner/traces.py)."""
    if data is not None:
        kept, seen = [], defaultdict(int)
        for p in load_jsonl(data):
            if (families is None or p.family in families) and seen[p.family] < limit:
                seen[p.family] += 1
                kept.append(p)
        if not kept:
            which = f" of the families {', '.join(families)}" if families else ""
            raise ValueError(f"{data} has no problem{which}")
        return kept
    from sgl_reason.reasoner.traces import FAMILIES, dataset

    problems = []
    for name in datasets:
        if name in FAMILIES:
            problems += gym_problems(name, dataset(name, limit, seed))
        else:
            problems += load_reasoning_gym(f"{name}?size={limit}&seed={seed}")
    return problems


def _norm(answer):
    return normalize_answer(answer) if answer else None


def _row(problems, results, reference=None) -> dict:
    n = len(problems)
    tokens = sum(r.cost.decode_tokens for r in results) / n
    row = {
        "tokens": round(tokens, 1),
        "thinking_tokens": round(sum(r.cost.thinking_tokens for r in results) / n, 1),
        "accuracy": round(sum(p.grade(r.answer) for p, r in zip(problems, results)) / n, 4),
        "computed_prefill_tokens": round(sum(r.cost.computed_prefill_tokens for r in results) / n, 1),
        "requests": round(sum(r.cost.requests for r in results) / n, 2),
    }
    if reference is not None:
        row["tokens_saved"] = round(1 - tokens / reference["tokens"], 4) if reference["tokens"] else 0.0
        same = [_norm(a.answer) == _norm(b.answer) for a, b in zip(results, reference["_results"])]
        row["agreement_with_full"] = round(sum(same) / n, 4)
    by_family = defaultdict(list)
    for i, p in enumerate(problems):
        by_family[p.family].append(i)
    if len(by_family) > 1:
        row["by_family"] = {
            family: {"problems": len(ids),
                     "tokens": round(sum(results[i].cost.decode_tokens for i in ids) / len(ids), 1),
                     "accuracy": round(sum(problems[i].grade(results[i].answer) for i in ids) / len(ids), 4),
                     **({"agreement_with_full": round(sum(same[i] for i in ids) / len(ids), 4)}
                        if reference is not None else {})}
            for family, ids in by_family.items()}
    return row


def run(backend, problems: list[Problem], budget: int = 1536, chunk: int = 16,
        answer_tokens: int = 192, n: int = 8, concurrency: int = 8, rows=None,
        sc_limit: int = 10) -> dict:
    rows = check_rows(rows)
    profile = resolve_profile(backend, None)

    def over(fn, subset=problems):
        backend.flush_cache()  # every row starts from the same (empty) cache
        pool = ThreadPoolExecutor(max_workers=concurrency)
        try:
            return list(pool.map(fn, subset))
        finally:  # on Ctrl-C / SIGTERM, finish only the problems in flight, not the whole row
            pool.shutdown(wait=True, cancel_futures=True)

    def think_rows(config, thinking_budget=budget):
        think = ThinkingBudget(max_thinking_tokens=thinking_budget, max_answer_tokens=answer_tokens,
                               mode="two")
        return over(lambda p: think_then_answer(p.question, budget=think, backend=backend,
                                                sampling=GREEDY, early_stop=config))

    baseline = EarlyStop(signal="none", chunk_tokens=chunk, window=chunk)
    full_results = think_rows(baseline)
    full = _row(problems, full_results)
    full["median_thinking_tokens"] = statistics.median(r.cost.thinking_tokens for r in full_results)
    full["closed_itself"] = sum(not r.samples[0].forced for r in full_results) / len(problems)
    logger.info("full: %s", full)
    full["_results"] = full_results
    signals = {}
    if "half_budget" in rows:  # the blind cut: same chunking, half the natural thinking
        half = max(chunk, int(full["median_thinking_tokens"]) // 2)
        signals["half_budget"] = {**_row(problems, think_rows(baseline, half), full),
                                  "thinking_budget": half}
        logger.info("half_budget: %s", signals["half_budget"])
    for name, knobs in SIGNAL_ROWS.items():
        if name not in rows:
            continue
        if knobs.get("probe_cues") == "profile":
            knobs = {**knobs, "probe_cues": profile.transition_cues}
        config = EarlyStop(signal=name.split("_")[0], **{"chunk_tokens": chunk, "window": chunk,
                                                          **knobs})
        results = think_rows(config)
        signals[name] = _row(problems, results, full)
        signals[name]["stopped_early"] = round(
            sum(r.samples[0].stopped is not None for r in results) / len(problems), 4)
        logger.info("%s: %s", name, signals[name])
    if "full_repeat" in rows:
        signals["full_repeat"] = _row(problems, think_rows(baseline), full)

    report = {"problems": len(problems), "families": sorted({str(p.family) for p in problems}),
              "thinking_budget": budget, "answer_tokens": answer_tokens, "chunk_tokens": chunk,
              "concurrency": concurrency, "model": backend.get_model_name(),
              "full": full, "signals": signals}
    if any(r in rows for r in SC_ROWS):
        seen, subset = defaultdict(int), []
        for p in problems:
            if seen[p.family] < sc_limit:
                seen[p.family] += 1
                subset.append(p)
        think = ThinkingBudget(max_thinking_tokens=budget, max_answer_tokens=answer_tokens)
        sc = lambda config: over(lambda p: self_consistency(  # noqa: E731
            p.question, n=n, think=think, backend=backend, early_stop=config), subset)
        sc_full_results = sc(None)
        sc_full = _row(subset, sc_full_results)
        sc_full["_results"] = sc_full_results
        for name, make in SC_ROWS.items():
            if name not in rows:
                continue
            results = sc(make(n, chunk))
            signals[name] = _row(subset, results, sc_full)
            signals[name]["samples_drawn"] = sum(r.info["samples_drawn"] for r in results) / len(subset)
            logger.info("%s: %s", name, signals[name])
        sc_full.pop("_results")
        report["self_consistency_full"] = {**sc_full, "n": n, "problems": len(subset)}
    full.pop("_results")
    return report


def table(report: dict) -> str:
    lines = [f"{report['problems']} problems ({', '.join(report['families'])}), "
             f"{report['model']}, thinking budget {report['thinking_budget']}, chunks of "
             f"{report['chunk_tokens']}, {report['concurrency']} in flight",
             f"{'run':22} {'tokens':>8} {'saved':>7} {'accuracy':>9} {'agree w/ full':>14}"]
    f = report["full"]
    lines.append(f"{'full (think_then_answer)':22} {f['tokens']:>8} {'':>7} {f['accuracy']:>9.3f} {'':>14}")
    for name, r in report["signals"].items():
        if name == next((n for n in SC_ROWS if n in report["signals"]), None):
            sc = report["self_consistency_full"]
            lines.append(f"{'full self-consistency':22} {sc['tokens']:>8} {'':>7} {sc['accuracy']:>9.3f} {'':>14}")
        lines.append(f"{name:22} {r['tokens']:>8} {r['tokens_saved']:>7.1%} {r['accuracy']:>9.3f} "
                     f"{r['agreement_with_full']:>14.3f}")
    return "\n".join(lines)


def main(args) -> int:
    from sgl_reason.connection import connect

    try:
        problems = problem_set(args.data, args.dataset, args.limit, args.seed, args.families)
    except ValueError as error:  # DataError included: a bad file, family or seed
        print(f"sgl-reason: error: {error}", file=sys.stderr)
        return 2
    model = None if args.url else args.model
    with connect(args.url, model=model, extra_args=args.server_arg) as backend:
        report = run(backend, problems, budget=args.budget, chunk=args.chunk,
                     answer_tokens=args.answer_tokens, n=args.n, concurrency=args.concurrency,
                     rows=args.rows, sc_limit=args.sc_limit)
    publish(report, table(report), args.json)
    return 0
