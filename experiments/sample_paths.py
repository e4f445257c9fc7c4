"""Do a self-consistency run's samples take different paths, and do the paths fail apart?
(issue #16's self-consistency bar; session 29, written for the v8 traces)

    .venv/bin/python experiments/sample_paths.py SC_RECORDS.jsonl DATA.jsonl

A vote gains on a problem whose right answer has a majority of samples and loses on one where
a wrong answer has it, so what a vote can gain is decided by the shape of the per-problem count
of right samples. v6's shape was two spikes, all right or none: every sample took the one
path its traces knew, 17 of its vote's 25 misses had no right sample, and on 14 problems one
wrong answer had a majority of the samples.
v8's traces name one of several ways in the plan line; this script reads, per family:

- right samples per problem: how many problems had k of N samples right, k = 0..N;
- problems with no right sample, and those where one wrong answer has a majority of the
  samples (a systematic miss: the same wrong step again and again), with how many of those took
  one path only;
- each path (a sample's first thinking line, its plan): its share of the samples and its
  accuracy;
- problems whose samples took two paths or more, and among them those where one path was
  right every time and another wrong every time (the paths fail apart);
- a reordering path's own error point: samples whose reordered term list (the ``Terms:`` line)
  is not the same terms as the chain's, one dropped or doubled, and how many of them are wrong.

Greedy records (``--program think_then_answer``, one sample each) read the same way: each
family's paths and their accuracy.

SC_RECORDS and DATA are as for ``verified_vote.py``; every sample is regraded with DATA's
grader. Prints the tables and a JSON line.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter, defaultdict

from sgl_reason.data import load


# the reorder line, v8: "Terms: + 74, + 50, - 47; from the last: - 47, + 50, + 74: -47 ..."
# (v9 numbers the terms: "Terms: 1) + 74, ...; from the last: 3) - 47, ...: -47 ...")
TERMS = re.compile(r"^Terms: (.*?); [^:]*: (.*?):", re.MULTILINE)


def path_of(sample: dict) -> str:
    return (sample.get("thinking") or sample.get("text") or "").split("\n", 1)[0].strip()


def reorder_broken(sample: dict) -> bool | None:
    """Whether the reordered list lost or doubled a term (None: the sample reorders nothing)."""
    m = TERMS.search(sample.get("thinking") or sample.get("text") or "")
    if m is None:
        return None
    terms = [sorted(t.strip() for t in group.split(",")) for group in m.groups()]
    return terms[0] != terms[1]


def main(sc_path: str, data_path: str) -> dict:
    problems = {p.id: p for p in load(data_path)}
    records = [r for r in map(json.loads, open(sc_path))
               if r["id"] in problems and problems[r["id"]].question == r["question"]]
    if len({r["id"] for r in records}) < len(problems):
        sys.exit(f"{sc_path} lacks records of some problems of {data_path}: rerun the eval, "
                 "it resumes")
    out: dict = defaultdict(lambda: {"right samples": Counter(), "no right sample": 0,
                                     "systematic misses": 0,
                                     "systematic, one path": 0, "paths": defaultdict(list),
                                     "problems, 2+ paths": 0, "paths fail apart": 0,
                                     "reorders": Counter()})
    for r in records:
        problem = problems[r["id"]]
        samples = r["samples"]
        right = [bool(problem.grade(s["answer"])) for s in samples]
        by_path = defaultdict(list)
        for s, ok in zip(samples, right):
            by_path[path_of(s)].append(ok)
        for family in (r["family"], "all"):
            f = out[family]
            f["right samples"][sum(right)] += 1
            f["no right sample"] += not any(right)
            wrong = Counter(s["answer"] for s, ok in zip(samples, right) if not ok)
            if wrong and wrong.most_common(1)[0][1] > len(samples) / 2:
                f["systematic misses"] += 1
                f["systematic, one path"] += len(by_path) == 1
            for path, oks in by_path.items():
                f["paths"][path] += oks
            for s, ok in zip(samples, right):
                broken = reorder_broken(s)
                if broken is not None:
                    f["reorders"]["samples"] += 1
                    f["reorders"]["broken"] += broken
                    f["reorders"]["broken, wrong"] += broken and not ok
            if len(by_path) > 1:
                f["problems, 2+ paths"] += 1
                f["paths fail apart"] += (any(all(v) for v in by_path.values())
                                          and any(not any(v) for v in by_path.values()))
    result = {}
    for family in sorted(out, key=lambda f: f == "all"):
        f = out[family]
        n = len(records[0]["samples"])
        paths = {p: {"share": round(len(v) / sum(map(len, f["paths"].values())), 3),
                     "accuracy": round(sum(v) / len(v), 3)} for p, v in f["paths"].items()}
        result[family] = {"right samples": [f["right samples"][k] for k in range(n + 1)],
                          "no right sample": f["no right sample"],
                          "systematic misses": f["systematic misses"],
                          "systematic, one path": f["systematic, one path"],
                          "problems, 2+ paths": f["problems, 2+ paths"],
                          "paths fail apart": f["paths fail apart"], "paths": paths,
                          "reorders": dict(f["reorders"])}
        print(f"{family}: right samples per problem (0..{n}) {result[family]['right samples']}; "
              f"no right sample {f['no right sample']}; a wrong majority {f['systematic misses']} "
              f"({f['systematic, one path']} on one path); {f['problems, 2+ paths']} problems "
              f"took 2+ paths, on {f['paths fail apart']} one path was always right and "
              "another always wrong")
        for p, v in sorted(paths.items(), key=lambda kv: -kv[1]["share"]):
            print(f"  {v['share']:.3f} of samples, accuracy {v['accuracy']:.3f}: {p[:100]}")
        if f["reorders"]:
            print(f"  reordered terms: {f['reorders']['samples']} samples, the list lost or "
                  f"doubled a term in {f['reorders']['broken']} ({f['reorders']['broken, wrong']} "
                  "of them wrong)")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
