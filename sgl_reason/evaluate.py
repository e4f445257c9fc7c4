"""Run a program over a problem set: concurrent, resumable JSONL records, a summary.

Each finished problem is appended to ``OUT.jsonl`` as one line and flushed, so an interrupted
run leaves a valid file, and a rerun with the same ``out`` skips the problems already there.
The summary is written beside it as ``OUT.summary.json``. Given the backend, an interrupt (Ctrl-C,
SIGTERM) also aborts the problems in flight on the server, so it returns at once instead of
after their last token (minutes for a self-consistency problem on the CPU).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from sgl_reason.backend import ReasonBackend
from sgl_reason.cost import Cost
from sgl_reason.data import Problem
from sgl_reason.programs.common import ProgramResult

logger = logging.getLogger(__name__)

# program(question) -> result; with run(..., backend=B): program(question, backend=copy of B)
Program = Callable[..., ProgramResult]


def summary_path(out: Path) -> Path:
    return out.with_name(out.stem + ".summary.json")


def read_records(out: Path) -> list[dict]:
    if not out.exists():
        return []
    records = []
    for line in out.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s: skipping a truncated line (an interrupted write)", out)
    return records


def record_for(problem: Problem, result: ProgramResult) -> dict:
    samples = result.samples
    return {
        "id": problem.id,
        "family": problem.family,
        "question": problem.question,
        "gold": problem.gold,
        "prediction": result.answer,
        "correct": problem.grade(result.answer),
        # per sample means over the program's samples (one for think_then_answer)
        "thinking_tokens": sum(s.thinking_tokens for s in samples) / max(1, len(samples)),
        "answer_tokens": sum(s.answer_tokens for s in samples) / max(1, len(samples)),
        # True when any sample's thinking was closed by budget forcing, not by the model
        "forced": any(s.forced for s in samples),
        "samples": [s.model_dump(exclude_none=True) for s in result.samples],
        "cost": result.cost.model_dump(),
        "info": result.info,
    }


def _accuracy(records: list[dict]) -> dict:
    n = len(records)
    thinking = sorted(r.get("thinking_tokens", 0) for r in records)
    return {
        "problems": n,
        "accuracy": sum(r["correct"] for r in records) / n if n else 0.0,
        "extraction_rate": sum(r["prediction"] is not None for r in records) / n if n else 0.0,
        # share of problems whose thinking the model closed itself (no sample forced)
        "closed_rate": sum(not r.get("forced", False) for r in records) / n if n else 0.0,
        "median_thinking_tokens": thinking[n // 2] if n else 0,
    }


def summarize(records: list[dict], wall_seconds: float) -> dict:
    """``wall_seconds``: the run's wall time (its resumed parts added up)."""
    n = len(records)
    cost = sum((Cost(**r["cost"]) for r in records), Cost())
    families = sorted({r["family"] for r in records if r.get("family")})
    return {
        **_accuracy(records),
        "families": {f: _accuracy([r for r in records if r.get("family") == f]) for f in families},
        "tokens_per_problem": (cost.decode_tokens / n) if n else 0.0,
        "prefill_computed": cost.computed_prefill_tokens,
        "prefill_reused": cost.cached_tokens,
        "requests": cost.requests,
        "wall_seconds": round(wall_seconds, 2),
        # each problem's own wall time, added up: larger than wall_seconds when problems overlap
        "problem_seconds": round(cost.seconds, 2),
        "cost": cost.model_dump(),
    }


def pending(problems: list[Problem], out: str | Path) -> list[Problem]:
    """The problems that have no record in ``out`` yet (a rerun runs only these)."""
    done = {r["id"] for r in read_records(Path(out))}
    return [p for p in problems if p.id not in done]


def finish(problems: list[Problem], out: str | Path, seconds: float = 0.0,
           info: dict | None = None) -> dict:
    """Rewrite ``out`` with one record per problem in input order, and write the summary;
    ``seconds`` of this run are added to the wall time of the runs before it. ``info`` (what
    was run: program, n, budget, data, model) is kept in the summary as ``run``."""
    out = Path(out)
    by_id = {r["id"]: r for r in read_records(out)}
    order = [p.id for p in problems]
    records = [by_id[i] for i in order if i in by_id]
    ours = set(order)
    rest = [r for i, r in by_id.items() if i not in ours]  # other problems' records stay
    staging = out.with_name(out.name + ".tmp")
    staging.write_text("".join(json.dumps(r) + "\n" for r in records + rest))
    staging.replace(out)
    before, old = 0.0, {}
    if summary_path(out).exists():
        try:
            old = json.loads(summary_path(out).read_text())
            before = old.get("wall_seconds", 0.0)
        except json.JSONDecodeError:
            logger.warning("%s: unreadable summary; its wall time is not carried over", out)
    summary = summarize(records, before + seconds)
    if old.get("run") or info:  # the records' first run says what made them
        summary["run"] = old.get("run") or info
    summary_path(out).write_text(json.dumps(summary, indent=2))
    return summary


def run(program: Program, problems: list[Problem], out: str | Path, concurrency: int = 4,
        progress: bool = True, info: dict | None = None,
        backend: ReasonBackend | None = None) -> dict:
    """Run ``program`` on every problem not yet in ``out``; return the summary of all records
    (records in input order, wall time summed over resumed runs).

    ``backend``: each problem runs as ``program(question, backend=copy)`` on its own cancellable
    copy, and an interrupt aborts the problems in flight (their KV freed on the server) before
    it propagates. Without it, ``program(question)`` runs and an interrupt waits for them."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    todo = pending(problems, out)
    done = len(problems) - len(todo)
    started = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(problems), initial=len(problems) - len(todo), unit="problem")
    correct = tokens = finished = 0
    scopes = []
    with open(out, "a") as sink, ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = {}
        for p in todo:
            if backend is None:
                futures[pool.submit(program, p.question)] = p
            else:
                copy, scope = backend.cancellable()
                scopes.append(scope)
                futures[pool.submit(program, p.question, backend=copy)] = p
        try:
            for future in as_completed(futures):
                problem = futures[future]
                record = record_for(problem, future.result())
                sink.write(json.dumps(record) + "\n")
                sink.flush()
                finished += 1
                correct += record["correct"]
                tokens += record["cost"]["decode_tokens"]
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(acc=f"{correct / finished:.2f}", tok=f"{tokens / finished:.0f}")
        except BaseException as error:  # Ctrl-C, or a problem failed (e.g. the server died)
            for future in futures:
                future.cancel()  # problems not started yet are dropped, not run into the error
            if aborted := sum(scope.cancel() for scope in scopes):  # the pool's exit is quick
                logger.warning("aborted %d requests in flight", aborted)
            logger.warning("%s: %s holds %d finished problems; rerun to resume",
                           "interrupted" if isinstance(error, KeyboardInterrupt) else "stopped",
                           out, done + finished)
            raise
        finally:
            if bar is not None:
                bar.close()
    return finish(problems, out, time.perf_counter() - started, info)


def summary_table(summary: dict) -> str:
    rows = [("problems", summary["problems"]), ("accuracy", f"{summary['accuracy']:.3f}"),
            ("extraction rate", f"{summary['extraction_rate']:.3f}"),
            ("closed thinking", f"{summary['closed_rate']:.3f}"),
            ("tokens per problem", f"{summary['tokens_per_problem']:.1f}"),
            ("prefill computed", summary["prefill_computed"]),
            ("prefill reused", summary["prefill_reused"]),
            ("requests", summary["requests"]),
            ("wall seconds", summary["wall_seconds"]),
            ("problem seconds (summed)", summary["problem_seconds"])]
    rows += [(f"accuracy {f}", f"{a['accuracy']:.3f} (closed {a['closed_rate']:.2f}, "
              f"median thinking {a['median_thinking_tokens']})")
             for f, a in summary.get("families", {}).items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
