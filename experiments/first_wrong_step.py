"""Where a reasoner's wrong arithmetic traces first go wrong.

Reads `sgl-reason eval` records (JSONL) and, for every wrong chain_sum or basic_arithmetic
problem, finds the first place in its thinking where something written is false:

- an *order sign* between two single digits (``5<1``, ``9>9``), as the traces write before a
  borrow or in a comparison;
- a *fact*: ``a op b = c`` with op ``+ - *`` (and v3's ``a*b+c = d``), classified by the line
  it is on: a ``Check:`` line (the steps were right on what they read, so the expression was
  rewritten wrongly), or by its operator;
- v5's *rewrite* (``Now: in X, Y is v: Z`` where Z is not X with Y replaced by v; v10: v may be
  a signed term, ``- 47 + 83 is + 36``, replacing the chain's last pair) and *read-out*
  (``Read hundreds 7, tens 5, ones 2. So 94*8=752`` where the digits read are not the number
  after it, or not the digits its columns wrote);
- v8's *reorder* (``Terms: ...: 83 - 47 + 50 + 74``, a chain whose signed terms are not the
  ``Start:`` chain's).

    .venv/bin/python experiments/first_wrong_step.py results/reasoner-v4/reasoner_greedy.jsonl
    .venv/bin/python experiments/first_wrong_step.py --samples DATA.jsonl SC_RECORDS.jsonl

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


# v10's right-to-left steps replace a chain's last two signed terms: "- 47 + 83 is + 36"
REWRITE = re.compile(r"^Now: in (.+?), (.+?) is (-?\d+|[+-] \d+): (.+)$", re.M)
READ = re.compile(r"[Rr]ead ((?:[a-z-]+ \d(?:, )?)+)(?:; (?:[a-z-]+ 0(?:, )?)+ dropped)?"  # v7
                  r"[.,] [Ss]o (?:\S+=)?(-?\d+)")
# a product's header and row labels (``44 is tens 4, ones 4; 71 is tens 7, ones 1: 2 rows.``;
# v12 ``tens row 7: 44*7:``, since ``row 2 of 2, tens 7: 44*7:``): they spell numbers by place,
# not columns, so the scan skips them
LABELS = re.compile(r"\d+ is (?:[a-z-]+ \d(?:, )?)+(?:; |: \d+ rows?\. )"
                    r"|(?:[a-z-]+ row \d|row \d+ of \d+, [a-z-]+ \d): \d+\*\d: ")
COLUMN = re.compile(r"([a-z-]+) [^;.]*?=(\d+)(?:, (\d) carry \d+)?(?=[;.]|$)"  # a column's fact
                    r"|([a-z-]+) (\d)(?=[;.])")  # its last carry, written as a digit


def _rewrite_errors(thinking: str) -> list[int]:
    from sgl_reason.reasoner.traces import _drop_single_parens, _tokens

    out = []
    for m in REWRITE.finditer(thinking):
        before, replaced, value, after = (m[i].strip() for i in range(1, 5))
        if value[0] in "+-" and value[1:2] == " ":  # a signed term: the last pair is replaced
            head, _, tail = before.rpartition(replaced)
            swapped = head + value + tail
        else:
            swapped = before.replace(replaced, value, 1)
        want = " ".join(_drop_single_parens(_tokens(swapped)))
        if replaced not in before or want != " ".join(_tokens(after)):
            out.append(m.start())
    return out


TERMS = re.compile(r"^Start: (.+)\nTerms: .+: (.+)$", re.M)  # v8: a chain in another order


def _reorder_errors(thinking: str) -> list[int]:
    """v8's reordered chains whose terms are not the started chain's, in any order."""
    from sgl_reason.reasoner.traces import _terms

    def signed(chain: str) -> list[int]:
        return sorted(int(n) * (1 if sign == "+" else -1) for sign, n in _terms(chain.split()))

    return [m.start(2) for m in TERMS.finditer(thinking) if signed(m[1]) != signed(m[2])]


def _read_errors(thinking: str) -> list[int]:
    """Read-outs whose digits are not the number they give, or not their columns' digits."""
    out, start = [], 0
    for m in READ.finditer(thinking):
        read = [p.rsplit(" ", 1) for p in m[1].split(", ")]
        written = {}
        for c in COLUMN.finditer(LABELS.sub("", thinking[start:m.start()])):
            if c[1]:
                written[c[1]] = c[3] if c[3] is not None else c[2][-1]
            else:
                written[c[4]] = c[5]
        start = m.end()
        if int("".join(d for _, d in read)) != int(m[2]) or any(
                place in written and written[place] != d for place, d in read):
            out.append(m.start())
    return out


def first_error(thinking: str) -> str:
    signs = [m.start() for m in SIGN.finditer(thinking)
             if not ORDER[m[2]](int(m[1]), int(m[3]))]
    others = sorted([(at, "rewrite") for at in _rewrite_errors(thinking)]
                    + [(at, "read-out") for at in _read_errors(thinking)]
                    + [(at, "reorder") for at in _reorder_errors(thinking)])
    facts = []
    for m in FACT.finditer(thinking):
        a, op, b, carry, result = m.groups()
        value = OPS[op](int(a), int(b)) + int(carry or 0)
        if value != int(result):
            facts.append(m)
    sign_at = signs[0] if signs else len(thinking)
    fact_at = facts[0].start() if facts else len(thinking)
    if others and others[0][0] < min(sign_at, fact_at):
        return others[0][1]
    if facts and facts[0].start() < sign_at:
        fact = facts[0]
        line = thinking[:fact.start()].rsplit("\n", 1)[-1]
        if line.startswith("Check"):
            return "fact on the check line"
        return f"fact {fact[2]}" + (" with carry" if fact[4] else "")
    return "order sign" if signs else "neither"


def main(args: list[str]) -> None:
    """``PATH...``: each wrong record's first sample (greedy runs). ``--samples DATA PATH...``:
    every wrong sample of self-consistency records, each regraded with DATA's grader."""
    problems = None
    if args[:1] == ["--samples"]:
        from sgl_reason.data import load
        problems, args = {p.id: p for p in load(args[1])}, args[2:]
    for path in args:
        counts: collections.Counter = collections.Counter()
        for line in open(path):
            r = json.loads(line)
            if r["family"] not in FAMILIES:
                continue
            if problems is None:
                wrong = [] if r["correct"] else r["samples"][:1]
            else:
                wrong = [x for x in r["samples"] if not problems[r["id"]].grade(x["answer"])]
            for sample in wrong:
                counts[(r["family"], first_error(sample["text"].split("</think>")[0]))] += 1
        print(path)
        for key, n in sorted(counts.items()):
            print(f"  {key[0]:17} {key[1]:24} {n}")


if __name__ == "__main__":
    main(sys.argv[1:])
