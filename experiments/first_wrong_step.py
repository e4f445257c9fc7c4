"""Where a reasoner's wrong arithmetic traces first go wrong.

Reads `sgl-reason eval` records (JSONL) and, for every wrong chain_sum or basic_arithmetic
problem, finds the first place in its thinking where something written is false:

- an *order sign* between two single digits (``5<1``, ``9>9``), as the traces write before a
  borrow or in a comparison;
- a *fact*: ``a op b = c`` with op ``+ - *`` (and v3's ``a*b+c = d``), classified by the line
  it is on: a ``Check:`` line (the steps were right on what they read, so the expression was
  rewritten wrongly), or by its operator.

    .venv/bin/python experiments/first_wrong_step.py results/reasoner-v4/reasoner_greedy.jsonl

Prints, per file, the count of each (family, first error) pair. The rule reads text only: a
wrong step the trace never writes as a fact (a dropped operand) counts as ``neither`` unless
a later fact is false.
"""

from __future__ import annotations

import collections
import json
import operator
import re
import sys

SIGN = re.compile(r"(?<![\d*+\-])(-?\d)([<>=])(-?\d)(?![\d+*])")
FACT = re.compile(r"(?<![\d)])(-?\d+)\s*([+\-*])\s*(-?\d+)(?:\s*\+\s*(\d+))?\s*=\s*(-?\d+)")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
ORDER = {"<": operator.lt, ">": operator.gt, "=": operator.eq}
FAMILIES = ("chain_sum", "basic_arithmetic")


def first_error(thinking: str) -> str:
    signs = [m.start() for m in SIGN.finditer(thinking)
             if not ORDER[m[2]](int(m[1]), int(m[3]))]
    facts = []
    for m in FACT.finditer(thinking):
        a, op, b, carry, result = m.groups()
        value = OPS[op](int(a), int(b)) + int(carry or 0)
        if value != int(result):
            facts.append(m)
    sign_at = signs[0] if signs else len(thinking)
    if facts and facts[0].start() < sign_at:
        fact = facts[0]
        line = thinking[:fact.start()].rsplit("\n", 1)[-1]
        if line.startswith("Check"):
            return "fact on the check line"
        return f"fact {fact[2]}" + (" with carry" if fact[4] else "")
    return "order sign" if signs else "neither"


def main(paths: list[str]) -> None:
    for path in paths:
        counts: collections.Counter = collections.Counter()
        for line in open(path):
            r = json.loads(line)
            if r["correct"] or r["family"] not in FAMILIES:
                continue
            thinking = r["samples"][0]["text"].split("</think>")[0]
            counts[(r["family"], first_error(thinking))] += 1
        print(path)
        for key, n in sorted(counts.items()):
            print(f"  {key[0]:17} {key[1]:24} {n}")


if __name__ == "__main__":
    main(sys.argv[1:])
