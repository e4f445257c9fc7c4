"""What should scored retention observe? Variants of the release rule on the tiny reasoner.

Runs ``sgl-reason bench thinking-kv --workload problems`` with extra rows: the observation
window (``observe``: the last 1, 8, 32, 64 or all decode steps of the thinking), the head and
layer aggregation (mean or max), and the retention share. Lab notes: experiments/README.md.

    HF_HUB_OFFLINE=1 .venv/bin/python experiments/scored_retention.py --limit 4 \
        --rows scored-10%,obs1-10%,obs128-10%,all-15%,o8-15%,o64-15%,max-15%
"""

from __future__ import annotations

import argparse
import json

from sgl_reason.bench import thinking_kv_problems as bench
from sgl_reason.bench.early_stop import REASONER_FAMILIES, problem_set
from sgl_reason.bench.thinking_kv import HELDOUT

RELEASE = {"thinking_kv_policy": "release-on-answer"}
VARIANTS = {
    "obs1-10%": RELEASE | {"thinking_kv_keep": 0.1, "thinking_kv_observe": 1},
    "obs128-10%": RELEASE | {"thinking_kv_keep": 0.1, "thinking_kv_observe": 128},
    "obs128-10%-max": RELEASE | {"thinking_kv_keep": 0.1, "thinking_kv_observe": 128,
                                 "thinking_kv_score": "max"},
    "15%": RELEASE | {"thinking_kv_keep": 0.15},
    "max-15%": RELEASE | {"thinking_kv_keep": 0.15, "thinking_kv_score": "max"},
    "o8-15%": RELEASE | {"thinking_kv_keep": 0.15, "thinking_kv_observe": 8},
    "o64-15%": RELEASE | {"thinking_kv_keep": 0.15, "thinking_kv_observe": 64},
    "all-15%": RELEASE | {"thinking_kv_keep": 0.15, "thinking_kv_observe": 1024},
    "all-15%-max": RELEASE | {"thinking_kv_keep": 0.15, "thinking_kv_observe": 1024,
                              "thinking_kv_score": "max"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4, help="held-out problems per family")
    parser.add_argument("--rows", required=True, help="comma-separated rows (bench or VARIANTS)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    bench.ROWS.update(VARIANTS)
    problems = problem_set(HELDOUT, limit=args.limit, families=REASONER_FAMILIES)
    report = bench.run(problems, rows=args.rows.split(","))
    print(bench.table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
