"""One self-consistency run read six ways: one sample, the vote, best-of-N by the arithmetic
verifier, consensus early stop, greedy, and the oracle (issue #16's self-consistency bar;
best-of-N's verifier; issue #19's early-stopped self-consistency bar).

    .venv/bin/python experiments/verified_vote.py SC_RECORDS.jsonl DATA.jsonl \
        [GREEDY_RECORDS.jsonl] [--partial]

SC_RECORDS: ``sgl-reason eval --program self_consistency --n N`` records (every sample's text is
kept), run on DATA or on a longer file that starts with DATA's problems (records of problems
not in DATA are left out; every problem of DATA must have one). For each problem of DATA:
- one sample: the mean correctness of its N samples, the expected accuracy of one sample at the
  run's temperature (lower variance than a separate n = 1 run, same distribution);
- vote: the exact vote over the N samples (the run's own answer, unless the run weighed it);
- weighted vote, where the run was ``--vote-weights confidence`` (every sample has a score):
  the vote weighted by the samples' confidence, the run's own answer;
- best-of-N, arithmetic: the sample ``pick_best`` chooses when each is scored by
  ``arithmetic_verifier``, the same choice ``best_of_n(..., verifier=arithmetic_verifier)``
  makes on these N candidates (they are drawn the same way: one shared prefill, N forks);
- consensus: ``self_consistency(..., early_stop=EarlyStop(signal="consensus"))`` replayed on the
  samples in their order: windows of 4, stopping once ``ConsensusSignal.settled`` says so, the
  vote over the samples drawn. The samples are independent draws, so the first 4 of a run are
  distributed as a first window would be; "tokens" columns count thinking plus answer tokens
  decoded per problem, all N against the windows consensus draws;
- oracle: some sample is right (pass@N);
- greedy: GREEDY_RECORDS' answer to the same problem, where given.
``--partial``: read a run stopped before its end: only DATA's problems that have a record
(how many are left out is printed first).
Every sample is regraded with DATA's grader. Prints a table per family and a JSON line.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from sgl_reason.data import load
from sgl_reason.early_stop import EarlyStop
from sgl_reason.programs import Sample, arithmetic_verifier
from sgl_reason.programs.best_of_n import pick_best
from sgl_reason.vote import normalize_answer, vote


def consensus(samples: list[Sample], config: EarlyStop) -> tuple[str | None, list[Sample]]:
    """The answer and the samples drawn when self_consistency's consensus loop reads
    ``samples`` in order (the loop of ``programs/self_consistency.py``)."""
    judge, drawn, decision = config.build(), [], None
    while len(drawn) < len(samples) and decision is None:
        window = samples[len(drawn):len(drawn) + config.batch]
        drawn += window
        decision = judge.settled([normalize_answer(x.answer) if x.answer else None for x in drawn],
                                 [normalize_answer(x.answer) if x.answer else None for x in window],
                                 len(drawn))
    return vote([x.answer for x in drawn]).answer, drawn


def tokens(samples: list[Sample]) -> float:
    return float(sum(x.thinking_tokens + x.answer_tokens for x in samples))


def main(sc_path: str, data_path: str, greedy_path: str | None = None,
         partial: bool = False) -> dict:
    problems = {p.id: p for p in load(data_path)}
    greedy = {}
    if greedy_path:
        greedy = {r["question"]: r["correct"] for r in map(json.loads, open(greedy_path))}
    rows = defaultdict(lambda: defaultdict(list))
    records = {}
    for line in open(sc_path):
        r = json.loads(line)
        if r["id"] in problems and problems[r["id"]].question == r["question"]:
            records[r["id"]] = r
    missing = [i for i in problems if i not in records]
    if missing and partial:
        print(f"partial: {len(records)} of {len(problems)} problems have a record; "
              f"{len(missing)} left out (ids {missing[:5]}...)")
    elif missing:
        sys.exit(f"{sc_path} has no record of {len(missing)} problems of {data_path} "
                 f"(ids {missing[:5]}...): rerun the eval, it resumes")
    for r in records.values():
        problem = problems[r["id"]]
        samples = [Sample(**s) for s in r["samples"]]
        right = [problem.grade(s.answer) for s in samples]
        scored = [s.model_copy(update={"score": arithmetic_verifier(r["question"], s.text)})
                  for s in samples]
        answer, drawn = consensus(samples, EarlyStop(signal="consensus"))
        plain = vote([s.answer for s in samples]).answer
        row = {"one sample": sum(right) / len(right), "vote": float(problem.grade(plain))}
        if all(s.score is not None for s in samples):
            row["weighted vote"] = float(r["correct"])
        row |= {"best-of-N, arithmetic": float(right[pick_best(scored)]),
                "consensus": float(problem.grade(answer)), "oracle": float(any(right)),
                "tokens, all N": tokens(samples), "tokens, consensus": tokens(drawn)}
        if greedy:
            if r["question"] not in greedy:
                sys.exit(f"{greedy_path} has no record of {r['question']!r}: run greedy on the "
                         "same problems")
            row["greedy"] = float(greedy[r["question"]])
        for family in (r["family"], "all"):
            for k, v in row.items():
                rows[family][k].append(v)
    result = {f: {k: round(sum(v) / len(v), 4) for k, v in cols.items()} | {"problems": len(
        cols["vote"])} for f, cols in rows.items()}
    cols = [k for k in rows["all"]]
    print("| family | problems | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    for f in sorted(result, key=lambda f: f == "all"):
        print(f"| {f} | {result[f]['problems']} | "
              + " | ".join(f"{result[f][k]:.0f}" if k.startswith("tokens") else
                           f"{result[f][k]:.3f}" for k in cols) + " |")
    if greedy:
        for col in ("vote", "weighted vote"):
            if col in rows["all"]:
                pairs = list(zip(rows["all"][col], rows["all"]["greedy"]))
                print(f"{col} against greedy: {sum(a > g for a, g in pairs)} problems won, "
                      f"{sum(a < g for a, g in pairs)} lost")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--partial"]
    if len(args) not in (2, 3):
        sys.exit(__doc__)
    main(*args, partial="--partial" in sys.argv[1:])
