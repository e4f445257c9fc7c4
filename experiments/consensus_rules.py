"""Which consensus rule for self-consistency? A grid replayed on one n = 8 run (issue #19's
self-consistency bar: the accuracy of the full n = 8 vote with >= 30% fewer tokens).

    .venv/bin/python experiments/consensus_rules.py SC_RECORDS.jsonl DATA.jsonl [BATCH,LEVEL]

Each rule is ``EarlyStop(signal="consensus", batch=B, confidence_level=L)``: samples drawn in
windows of B, stopping when a window is unanimous or the Beta posterior puts L on the leader's
majority (``ConsensusSignal.settled``), replayed on the run's samples in their order by
``verified_vote.consensus`` (the samples are independent draws, so the first B are distributed
as a live first window). For each rule: accuracy, agreement of its answer with the full vote's,
and the share of thinking-plus-answer tokens it does not decode.

Selection, fixed before the tuning run was read: among the rules whose tuning accuracy is at
least the full vote's, the one that saves the most tokens; a tie goes to the larger window
(fewer rounds of decoding). With ``BATCH,LEVEL`` it replays that one rule only (the held-out
check of a registered rule).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from sgl_reason.data import load
from sgl_reason.early_stop import EarlyStop
from sgl_reason.programs import Sample
from sgl_reason.vote import normalize_answer

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from verified_vote import consensus, tokens  # noqa: E402


def _norm(answer: str | None) -> str | None:
    return normalize_answer(answer) if answer else None


GRID = [(b, level) for b in (2, 3, 4) for level in (0.8, 0.9, 0.95)]


def replay(records: list[dict], problems: dict, batch: int, level: float) -> dict:
    rule = EarlyStop(signal="consensus", batch=batch, confidence_level=level)
    cols = defaultdict(lambda: defaultdict(float))
    for r in records:
        problem = problems[r["id"]]
        samples = [Sample(**s) for s in r["samples"]]
        answer, drawn = consensus(samples, rule)
        for family in (r["family"], "all"):
            c = cols[family]
            c["problems"] += 1
            c["full vote"] += float(r["correct"])
            c["rule"] += float(problem.grade(answer))
            c["same answer"] += float(_norm(answer) == _norm(r["prediction"]))
            c["tokens, all"] += tokens(samples)
            c["tokens, rule"] += tokens(drawn)
            c["samples drawn"] += len(drawn)
    out = {}
    for family, c in cols.items():
        n = c["problems"]
        out[family] = {"problems": int(n), "full_vote": round(c["full vote"] / n, 4),
                       "accuracy": round(c["rule"] / n, 4),
                       "same_answer": round(c["same answer"] / n, 4),
                       "tokens_saved": round(1 - c["tokens, rule"] / c["tokens, all"], 4),
                       "samples_drawn": round(c["samples drawn"] / n, 2)}
    return out


def main(sc_path: str, data_path: str, only: str | None = None) -> dict:
    problems = {p.id: p for p in load(data_path)}
    records = [r for r in map(json.loads, open(sc_path))
               if r["id"] in problems and problems[r["id"]].question == r["question"]]
    if len(records) != len(problems):
        sys.exit(f"{sc_path} has records of {len(records)} of the {len(problems)} problems of "
                 f"{data_path}: finish the eval first (it resumes)")
    grid = [(int(only.split(",")[0]), float(only.split(",")[1]))] if only else GRID
    results = {f"batch {b}, level {level}": replay(records, problems, b, level)
               for b, level in grid}
    print("| rule | accuracy (full vote) | same answer | tokens saved | samples drawn | "
          "per family: accuracy / saved |")
    print("|---|---|---|---|---|---|")
    for name, res in results.items():
        a = res["all"]
        fam = ", ".join(f"{f} {v['accuracy']:.3f} / {v['tokens_saved']:.0%}"
                        for f, v in sorted(res.items()) if f != "all")
        print(f"| {name} | {a['accuracy']:.3f} ({a['full_vote']:.3f}) | {a['same_answer']:.3f} | "
              f"{a['tokens_saved']:.1%} | {a['samples_drawn']:.2f} | {fam} |")
    eligible = [(res["all"]["tokens_saved"], int(name.split()[1].rstrip(",")), name)
                for name, res in results.items()
                if res["all"]["accuracy"] >= res["all"]["full_vote"]]
    chosen = max(eligible)[2] if eligible else None
    print(f"chosen: {chosen}")
    print(json.dumps({"chosen": chosen, "rules": results}))
    return results


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    main(*sys.argv[1:])
