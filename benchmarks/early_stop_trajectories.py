"""Probe trajectories: what the probe says after every chunk of the full-budget trace.

    .venv/bin/python benchmarks/early_stop_trajectories.py --seed 1 --limit 50 --budget 96 --chunk 16 --json OUT
    .venv/bin/python benchmarks/early_stop_trajectories.py --load OUT     # replay only

Probing almost never changes the trace (``run_probe`` commits the newest token alone before it
forks; greedy decoding from an empty cache is bit-reproducible; measured on seed 0, 49 of 50
probed traces were the unprobed ones), so one full-budget run that probes every chunk and never
stops holds what a ``probe`` rule would see at that chunk size or a multiple of it. The script
records, per problem, every probe's text, token logprobs and finish, and the full-budget
answer; then it replays a grid of rules offline (chunk, equal probes needed,
``probe_confidence``, ``probe_tokens``): tokens per problem (thinking up to the stop, the
probes' completions, and the answer request when no stop fires) and agreement with the full
answer, the bench's accounting, and the ``ceiling``: what an oracle that knew the full answer
would spend at this chunk size (no probe rule does better at agreement 1.00). Use it to choose
a rule on one seed, then report the rule on a disjoint one (``sgl-reason bench early-stop
--seed``). reasoning-gym draws item i from seed + i: seeds closer than ``--limit`` share
problems (seed 1 shares 49 of 50 with seed 0), so use seeds far apart (0, 1000, 2000).

Caveat, measured: the trace is the same whatever is probed, but not whatever the chunk size.
Each chunk boundary computes one token's KV in a one-token prefill instead of a decode step, and
bf16 rounds the two differently: on seed 1, chunks of 8 and of 16 gave different thinking on 11
of 50 problems (from the first boundaries on) and different full answers on 3. Replay a chunk
size from a recording at that size; replaying chunks of 16 from a chunk-8 recording (every
other probe) is an approximation.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sgl_reason.bench.early_stop import GREEDY, problem_set
from sgl_reason.connection import connect
from sgl_reason.data import answers_match
from sgl_reason.early_stop import EarlyStop, Probe, Signal, StopDecision
from sgl_reason.early_stop.base import Chunk, register
from sgl_reason.programs import ThinkingBudget, think_then_answer
from sgl_reason.programs.common import resolve_profile
from sgl_reason.vote import extract_answer, normalize_answer


def _key(text: str, cut: bool = False) -> str | None:
    answer = extract_answer(text, cut=cut) if text.strip() else None
    return normalize_answer(answer) if answer else None


def _full_answers(trajectories: list[dict]) -> int:
    """Read each full answer again from its text the way the programs read it today, so that
    recordings made before cut answers were read from their complete lines replay with the
    bench's answers (a recording without ``answer_cut`` counts a full answer limit as a cut).
    Returns how many answers changed."""
    changed = 0
    for t in trajectories:
        cut = t.get("answer_cut", t["answer_tokens"] >= ANSWER_TOKENS)
        answer = _key(t["answer_text"], cut)
        changed += answer != t["answer"]
        t["answer"] = answer
    return changed


ANSWER_TOKENS = 16  # the answer limit of recordings made before ``answer_cut`` was recorded
_CURRENT = threading.local()  # the log of the trace this thread is recording


@register("record_probes")
class RecordProbes(Signal):
    """Probes after every chunk but the last, and never stops: what the ``probe`` signal sees.

    The last chunk is not probed, as the real signal does not probe it (a probe there would
    commit the newest token alone before the answer request, which the bench's runs do not)."""

    needs_probe = True

    def __init__(self, config):
        super().__init__(config)
        self.log = _CURRENT.log  # set by the thread that runs the problem

    def observe(self, chunk: Chunk) -> StopDecision | None:
        probe = chunk.probe()
        self.log.append({"at": chunk.tokens_so_far, "text": chunk.text, "probe": probe.text,
                         "logprobs": list(probe.logprobs), "finished": probe.finished})
        return None


def replay(traj: dict, stride: int, agree: int, min_conf: float, probe_tokens: int,
           recorded_tokens: int, cues: tuple[str, ...] = ()) -> tuple[int, str | None, bool]:
    """(tokens, answer, stopped) of a ``probe`` rule on one recorded trajectory, judged by the
    real :class:`ProbeSignal`: a chunk every ``stride`` recorded chunks (probed when the signal
    says so: always, or after one of ``cues``), at most ``probe_tokens`` (<= the recorded
    limit) per probe; a longer recorded probe is cut there. Approximate for cue rules: the
    live signal reads the trace cut before the cue, the recording has the chunk-end probe."""
    signal = EarlyStop(signal="probe", probe_agree=agree, probe_cues=cues,
                       probe_confidence=min_conf, probe_tokens=probe_tokens).build()
    spent, text = 0, ""
    for i, step in enumerate(traj["probes"]):
        text += step.get("text", "")
        if (i + 1) % stride:
            continue
        lps = tuple(step["logprobs"])
        cut = len(lps) > probe_tokens or (len(lps) == recorded_tokens and not step["finished"])
        probe = Probe(step["probe"], lps[:probe_tokens], finished=not cut)
        asked = []

        def read(drop=0, p=probe):  # a cue rule's probe cut before the cue (drop > 0) was
            asked.append(p)  # not recorded: the chunk-end probe stands in for it
            return p

        decision = signal.observe(Chunk(text=text, tokens_so_far=step["at"], probe=read))
        text = ""
        spent += sum(len(p.logprobs) for p in asked)
        if decision is not None:
            return step["at"] + spent, _key(decision.answer_text), True
    return traj["thinking_tokens"] + spent + traj["answer_tokens"], traj["answer"], False


def ceiling(traj: dict) -> int:
    """Tokens of an oracle that knows the full answer: it stops at the first chunk from which
    every probe states that answer and pays that one probe; it runs a trace that never settles
    to the full budget without probing. No probe rule at this chunk size spends less at
    agreement 1.00."""
    settled = None
    for step in reversed(traj["probes"]):
        if not step["finished"] or _key(step["probe"]) != traj["answer"]:
            break
        settled = step
    if settled is None:
        return traj["thinking_tokens"] + traj["answer_tokens"]
    return settled["at"] + len(settled["logprobs"])


def first_stated(traj: dict) -> int:
    """Tokens of an oracle that stops at the first chunk whose probe states the full answer
    (lucky early guesses included) and pays that probe: the most any rule probing at chunk ends
    could save at agreement 1.00, however it decides."""
    for step in traj["probes"]:
        if step["finished"] and _key(step["probe"]) == traj["answer"]:
            return step["at"] + len(step["logprobs"])
    return traj["thinking_tokens"] + traj["answer_tokens"]


def _correct(answer: str | None, traj: dict) -> bool:
    return "gold" in traj and answers_match(answer, traj["gold"])


def report(trajectories: list[dict], chunk: int, probe_tokens: int, cues=()) -> None:
    n = len(trajectories)
    full = sum(t["thinking_tokens"] + t["answer_tokens"] for t in trajectories) / n
    accuracy = sum(_correct(t["answer"], t) for t in trajectories) / n
    print(f"full: {full:.1f} tokens/problem, accuracy {accuracy:.3f}")
    best = sum(ceiling(t) for t in trajectories) / n
    print(f"ceiling (an oracle probe rule, agreement 1.00): {best:.1f} tokens, saved {1 - best / full:.1%}")
    first = sum(first_stated(t) for t in trajectories) / n
    print(f"first probe stating the full answer (an oracle): {first:.1f} tokens, saved {1 - first / full:.1%}")
    last = [t for t in trajectories if t["probes"]]
    same = sum(t["probes"][-1]["finished"] and _key(t["probes"][-1]["probe"]) == t["answer"] for t in last)
    print(f"the last probe (one chunk before the budget ends) states the full answer on {same} of {len(last)}")
    rows = []
    grid = itertools.product((1, 2), (1, 2, 3), (0.0, 0.3, 0.4, 0.5, 0.7, 0.8, 0.9, 0.95),
                             (probe_tokens, 8), ((), tuple(cues)) if cues else ((),))
    for stride, agree, min_conf, cap, cue in grid:
        if agree == 1 and min_conf == 0:
            continue  # refused by EarlyStop: the first probe would always stop
        runs = [replay(t, stride, agree, min_conf, cap, probe_tokens, cue) for t in trajectories]
        tokens = sum(r[0] for r in runs) / n
        agreement = sum(r[1] == t["answer"] for r, t in zip(runs, trajectories)) / n
        correct = sum(_correct(r[1], t) for r, t in zip(runs, trajectories)) / n
        line = (f"chunk={chunk * stride:>2} agree={agree} probe_confidence={min_conf:.2f} "
                f"probe_tokens={cap:>2} cues={'yes' if cue else 'no '}: {tokens:6.1f} tokens, "
                f"saved {1 - tokens / full:6.1%}, agreement {agreement:.3f}, accuracy "
                f"{correct:.3f}, stopped {sum(r[2] for r in runs) / n:.2f}")
        rows.append((1 - tokens / full, agreement, line))
    for _, _, line in sorted(rows, key=lambda r: (-r[1], -r[0])):
        print(line)


def record(backend, problem, budget: int, answer_tokens: int, config: EarlyStop) -> dict:
    """Run one problem with a probe after every chunk; its trajectory."""
    _CURRENT.log = log = []
    think = ThinkingBudget(max_thinking_tokens=budget, max_answer_tokens=answer_tokens, mode="two")
    s = think_then_answer(problem.question, budget=think, backend=backend, sampling=GREEDY,
                          early_stop=config).samples[0]
    return {
        "question": problem.question, "family": problem.family, "gold": problem.gold,
        "probes": log, "answer": normalize_answer(s.answer) if s.answer else None,
        "answer_text": s.answer_text, "answer_cut": s.finish_reason == "length",
        "thinking_tokens": s.thinking_tokens, "answer_tokens": s.answer_tokens,
        "thinking": s.thinking, "forced": s.forced,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="reasoner", help="embedded server's model")
    parser.add_argument("--data", default=None, help="graded JSONL problems (default: --dataset)")
    parser.add_argument("--families", default=None, help="with --data: these families only")
    parser.add_argument("--dataset", default="chain_sum,basic_arithmetic,leg_counting")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--limit", type=int, default=50, help="problems per family")
    parser.add_argument("--budget", type=int, default=1536, help="thinking tokens (the bench's --budget)")
    parser.add_argument("--answer-tokens", type=int, default=192)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--probe-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cues", default="Check,Wait",
                        help="transition cues of the replayed cue rules (the reasoner's)")
    parser.add_argument("--json", help="write the trajectories here")
    parser.add_argument("--load", help="replay trajectories from this file instead of running")
    args = parser.parse_args()
    cues = tuple(c for c in args.cues.split(",") if c)
    if args.load:
        trajectories = json.loads(Path(args.load).read_text())
        changed = _full_answers(trajectories)
        print(f"full answers read differently than when recorded: {changed} of {len(trajectories)}")
        report(trajectories, args.chunk, args.probe_tokens, cues)
        return
    families = args.families.split(",") if args.families else None
    problems = problem_set(args.data, args.dataset.split(","), args.limit, args.seed, families)
    config = EarlyStop(signal="record_probes", chunk_tokens=args.chunk, window=args.chunk,
                       probe_tokens=args.probe_tokens)
    with connect(model=args.model) as backend:
        resolve_profile(backend, None)
        backend.flush_cache()
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            trajectories = list(pool.map(
                lambda p: record(backend, p, args.budget, args.answer_tokens, config), problems))
    for t in trajectories:
        print(t["family"], [_key(x["probe"]) for x in t["probes"]], "full:", t["answer"],
              "gold:", t["gold"])
    if args.json:
        Path(args.json).write_text(json.dumps(trajectories, indent=1))
    report(trajectories, args.chunk, args.probe_tokens, cues)


if __name__ == "__main__":
    main()
