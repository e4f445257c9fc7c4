"""Reasoning traces written by code, from reasoning-gym problems, to train the tiny reasoner.

A trace is shaped like a real reasoning model's (R1, Qwen3)::

    <think>
    Plan: ...                                   one sentence, naming which of the problem's
                                                ways the trace takes (v8: a chain's term
                                                order, a product's number on top)
    Terms: 1) + 74, 2) - 47, ...; from the      v8: a chain in another order, derived term by
    last: 4) + 83, ...: 83 ...                  term (v9: copied by place)
    Step 1: -59 + 21. 21 is less than 59: ...   one operation a step, digit facts per column
    Now: in -59 + 21 + 40 + -96, -59 + 21 is    the expression rewritten after each step, the
    -38: -38 + 40 + -96                         part it replaces named (v5)
    ...
    Check: ...                                  every step recomputed backwards (the inverse
                                                operation) or the sum in another order
    Wait, 7+6=13, not 12, so ...                ~1 trace in 5: an early slip the check caught,
                                                and the steps after it redone
    </think>
    -59 + 21 = -38, -38 + 40 = 2, ...           the answer copies the thinking's results
    The answer is -94.

Families and their configs are exactly the ones the reasoner is evaluated on (:data:`FAMILIES`).
Seeds: training and this project's evaluations stay below :data:`MAX_SEED`; evaluation by
others uses seeds beyond it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from sgl_reason.reasoner.arith import (
    APPLY, UNTRAINED, Slip, Worked, show, strip_untrained, work,
)

MAX_SEED = 10_000_000
THINK_START, THINK_END = "<think>", "</think>"

FAMILIES: dict[str, dict] = {
    "chain_sum": dict(min_terms=3, max_terms=5, min_digits=1, max_digits=3),
    "basic_arithmetic": dict(min_terms=2, max_terms=4, min_digits=1, max_digits=2,
                             operators=("+", "-", "*"), allow_parentheses=True,
                             allow_negation=False),
    "leg_counting": dict(min_animals=2, max_animals=4, min_instances=1, max_instances=10),
    "gsm_symbolic": {},
}
# about one trace in five slips in an early step (the check catches it); in one in ten the check
# itself slips on a right step, and redoing the step in columns shows the check was wrong
SLIP_RATE, CHECK_SLIP_RATE = 0.2, 0.1
# The project's own held-out sets: ``reasoning-gym:FAMILY?seed=HELD_OUT_SEED`` (up to
# HELD_OUT_SIZE problems). Their questions are never trained on.
HELD_OUT_SEED, HELD_OUT_SIZE = 5_000_000, 200


@dataclass(frozen=True)
class Trace:
    family: str
    question: str
    thinking: str  # between the markers, without them
    answer: str  # after the end marker
    gold: str
    slipped: bool
    # spans of ``thinking`` that training leaves out of the loss: a slip's wrong value
    untrained: tuple[tuple[int, int], ...] = ()
    check_slipped: bool = False  # the check slipped on a right step (the answer stands)

    @property
    def completion(self) -> str:
        """What the assistant writes: thinking in its markers, then the answer."""
        return f"{THINK_START}\n{self.thinking}\n{THINK_END}\n{self.answer}"


@dataclass
class _Step:
    a: int
    op: str
    b: int
    worked: Worked
    before: str  # the expression this step works on
    replaced: str  # the part of ``before`` that the step's value replaces (with its brackets)
    after: str  # the expression that remains (with this step's value in it)
    shown: str | None = None  # the value as it stands in ``after`` where not plain ("+ 36")

    def rewrite(self) -> str:
        """The rewrite as its own line, the replaced part named: v4 rewrote silently and 5 of
        its 24 wrong basic_arithmetic traces dropped an operand there, which no check sees."""
        value = self.shown or self.worked.value
        return f"Now: in {self.before}, {self.replaced} is {value}: {self.after}"


# --- expressions: chain_sum and basic_arithmetic --------------------------------------------

def _tokens(expression: str) -> list[str]:
    return expression.replace("(", " ( ").replace(")", " ) ").split()


def _drop_single_parens(toks: list[str]) -> list[str]:
    changed = True
    while changed:
        changed = False
        for i in range(len(toks) - 2):
            if toks[i] == "(" and toks[i + 2] == ")":
                toks = toks[:i] + [toks[i + 1]] + toks[i + 3:]
                changed = True
                break
    return toks


def _next_op(toks: list[str]) -> int:
    """Index of the operator to apply next: innermost first bracket, ``*`` before ``+ -``,
    left to right (Python's order for these operators)."""
    lo, hi, start = 0, len(toks), 0
    for i, t in enumerate(toks):  # the first ")" closes the innermost group: the last "(" before it
        if t == "(":
            start = i
        elif t == ")":
            lo, hi = start + 1, i
            break
    ops = [i for i in range(lo, hi) if toks[i] in ("+", "-", "*")]
    return next((i for i in ops if toks[i] == "*"), ops[0])


def _evaluate(expression: str, slip_at: int | None, rng: random.Random,
              second_on_top: bool = False) -> list[_Step]:
    toks = _drop_single_parens(_tokens(expression))
    steps: list[_Step] = []
    while len(toks) > 1:
        i = _next_op(toks)
        a, op, b = int(toks[i - 1]), toks[i], int(toks[i + 1])
        slip = Slip(rng) if slip_at == len(steps) else None
        w = work(a, op, b, slip, second_on_top)
        lo, hi = i - 1, i + 2  # the brackets that enclose only this operation go with it
        while lo > 0 and hi < len(toks) and toks[lo - 1] == "(" and toks[hi] == ")":
            lo, hi = lo - 1, hi + 1
        before, replaced = " ".join(toks), " ".join(toks[lo:hi])
        toks = _drop_single_parens(toks[:lo] + [str(w.value)] + toks[hi:])
        steps.append(_Step(a, op, b, w, before, replaced, " ".join(toks)))
    return steps


def _evaluate_from_right(expression: str, slip_at: int | None, rng: random.Random) -> list[_Step]:
    """A flat chain summed from its right end (v10): each step combines the last two signed
    terms into one (``- 47 + 83`` is ``+ 36``), so the chain is never copied in a new order;
    v9's reordered lists lost or doubled a term in 21 of 177 samples."""
    terms = _terms(_tokens(expression))
    steps: list[_Step] = []
    while len(terms) > 1:
        (s1, n1), (op, n2) = terms[-2:]
        a = int(n1) if s1 == "+" else -int(n1)  # the first term's sign is its own
        slip = Slip(rng) if slip_at == len(steps) else None
        w = work(a, op, int(n2), slip)
        rest = terms[:-2]
        if rest:
            sign = "+" if w.value >= 0 else "-"
            terms = rest + [(sign, str(abs(w.value)))]
            replaced, shown = f"{s1} {n1} {op} {n2}", f"{sign} {abs(w.value)}"
        else:
            terms, replaced, shown = [("+", str(w.value))], f"{n1} {op} {n2}", None
        before = expression
        expression = " ".join([terms[0][1]] + [x for pair in terms[1:] for x in pair])
        steps.append(_Step(a, op, int(n2), w, before, replaced, expression, shown))
    return steps


_INVERSE = {"+": "-", "-": "+"}

# v8: a trace works its problem in one of several ways, named in its plan, so that samples of
# one problem take different paths and a systematic error of one path is outvoted by the others
# (v6 and v7 made the same wrong step in every sample: 17 of v6's 25 self-consistency misses had
# no right sample). A flat chain of + and - is summed from its left or from its right end; any
# other expression works each product with its first or its second number on top.
# v10: two chain ways, neither copying the chain in a new order. v9's three ways at 0.7 were
# drawn 56/29/15% and scored 0.86 (left to right), 0.77 (reordered from the last) and 0.62
# (added terms first): a vote over unequal ways only tied greedy.
ORDERS = {
    "left": "left to right",
    "right": "right to left, the last two terms first",
}
# How often a trace takes each way. Greedy takes the way whose plan token is likeliest (v8 drew
# its ways uniformly and its greedy planned its worst way for every chain), so the way greedy
# should take is the more frequent; at 0.7 about a third of samples go the other way.
ORDER_WEIGHTS = {"left": 0.6, "right": 0.4}


def chain_plan(order: str) -> str:
    """A flat chain's plan line, naming its way (a key of :data:`ORDERS`)."""
    return f"Plan: {ORDERS[order]}, one operation a step, then check each step backwards."


def _terms(toks: list[str]) -> list[tuple[str, str]]:
    """A flat chain (no brackets, no ``*``) as (sign, number) pairs; the first term is added."""
    return [("+", toks[0])] + [(toks[i], toks[i + 1]) for i in range(1, len(toks), 2)]


def _check_line(step: _Step, slip: Slip | None = None) -> str:
    """Recompute a step backwards: the result with the inverse operation gives back ``a``
    (products: the other number on top gives the result). A slipped step fails its check; so
    does a right step whose check itself slips (``slip``: its value off by one, untrained)."""
    r = step.worked.value
    if step.op == "*":
        lhs, again, want = f"{step.b} * {step.a}", APPLY["*"](step.b, step.a), r
    else:
        lhs, again, want = f"{r} {_INVERSE[step.op]} {step.b}", APPLY[_INVERSE[step.op]](r, step.b), step.a
    shown = str(again)
    if slip is not None:
        again += slip.delta
        shown = f"{UNTRAINED[0]}{again}{UNTRAINED[1]}"
    return f"{lhs} = {shown}, " + ("right" if again == want else f"not {want}, wrong")


def _again(k: int, s: _Step) -> str:
    """A step redone in columns, as it is written the first time."""
    return f"Step {k} again: {s.a} {s.op} {s.b}. {s.worked.text}."


def _slips(rng: random.Random) -> tuple[bool, bool]:
    """(a slip in an early step, a slip in the check of a right step): at most one of them."""
    r = rng.random()
    return r < SLIP_RATE, SLIP_RATE <= r < SLIP_RATE + CHECK_SLIP_RATE


def _expression_trace(family: str, question: str, expression: str, gold: str,
                      rng: random.Random) -> Trace:
    toks = _drop_single_parens(_tokens(expression))
    lines, on_top, order = [], False, "left"
    if "(" not in toks and "*" not in toks and len(toks) > 3:  # a flat chain of 3+ terms
        order = rng.choices(list(ORDER_WEIGHTS), weights=list(ORDER_WEIGHTS.values()))[0]
        lines += [chain_plan(order), f"Start: {' '.join(toks)}"]
    else:
        on_top = rng.random() < 0.5
        lines += [f"Plan: inner brackets first, * before + and -, one operation a step, a "
                  f"product's {'second' if on_top else 'first'} number on top, then check each "
                  "step backwards.", f"Start: {' '.join(toks)}"]
    expression = " ".join(toks)

    def evaluate(slip_at: int | None) -> list[_Step]:
        if order == "right":
            return _evaluate_from_right(expression, slip_at, rng)
        return _evaluate(expression, slip_at, rng, on_top)

    n_ops = len(evaluate(None))
    slip, check_slip = _slips(rng)
    slip_at = rng.randrange(max(1, (n_ops + 1) // 2)) if n_ops and slip else None
    steps = evaluate(slip_at)
    if slip_at is not None and steps[slip_at].worked.slipped is None:
        slip_at = None  # no digit fact could slip plausibly (e.g. 0+0)
    check_at = rng.randrange(len(steps)) if check_slip and steps else None
    for k, s in enumerate(steps, 1):
        lines.append(f"Step {k}: {s.a} {s.op} {s.b}. {s.worked.text}.")
        if k < len(steps):
            lines.append(s.rewrite())
    lines.append(f"So the result is {steps[-1].worked.value}.")
    lines.append("Check: " + "; ".join(
        _check_line(s, Slip(rng) if i == check_at else None) for i, s in enumerate(steps)) + ".")
    final_steps = steps
    if slip_at is not None:
        # a failed check is settled by redoing the step in columns, never by trusting the check
        fixed = evaluate(None)
        s, f = steps[slip_at], fixed[slip_at]
        lines.append(f"Wait, step {slip_at + 1} fails its check. {_again(slip_at + 1, f)} "
                     f"So {show(f.a, f.op, f.b, f.worked.value)}, not {s.worked.value}.")
        lines += [_again(k, x) for k, x in enumerate(fixed[slip_at + 1:], slip_at + 2)]
        lines.append(f"Now the result is {fixed[-1].worked.value}, and checking again: "
                     + "; ".join(_check_line(x) for x in fixed) + ".")
        final_steps = fixed
    elif check_at is not None:
        s = steps[check_at]
        lines.append(f"Wait, step {check_at + 1} fails its check. {_again(check_at + 1, s)} "
                     f"So {show(s.a, s.op, s.b, s.worked.value)}, the same as before: the check "
                     f"slipped. Checking step {check_at + 1} again: {_check_line(s)}. The result "
                     f"stays {steps[-1].worked.value}.")
    value = final_steps[-1].worked.value
    if str(value) != gold.strip():
        raise AssertionError(f"trace for {expression!r} reached {value}, gold is {gold!r}")
    answer = ", ".join(show(x.a, x.op, x.b, x.worked.value) for x in final_steps)
    thinking, untrained = strip_untrained("\n".join(lines))
    return Trace(family, question, thinking, f"{answer}.\nThe answer is {value}.",
                 gold, slip_at is not None, tuple(untrained), check_at is not None)


# --- leg_counting ------------------------------------------------------------------------------

def _plural(name: str, n: int) -> str:
    return name if n == 1 else name + "s"  # reasoning-gym's own plural ("butterflys")


def _leg_trace(question: str, animals: dict[str, int], gold: str, rng: random.Random) -> Trace:
    from reasoning_gym.arithmetic.leg_counting import ANIMALS

    lines = ["Plan: legs of each animal times how many, add the totals, then check by adding in "
             "reverse."]
    totals = []
    for name, count in animals.items():
        legs = ANIMALS[name]
        w = work(count, "*", legs)
        lines.append(f"A {name} has {legs} legs. {count} {_plural(name, count)}: {w.text}.")
        totals.append(w.value)
    n_adds = len(totals) - 1
    slip, check_slip = _slips(rng)
    slip_at = rng.randrange(max(1, (n_adds + 1) // 2)) if slip else None

    def running(slip_at):
        value, out = totals[0], []
        for k, t in enumerate(totals[1:]):
            w = work(value, "+", t, Slip(rng) if k == slip_at else None)
            out.append((value, t, w))
            value = w.value
        return out

    # the add chain names each total by its animal, from a list written just above it: v5
    # dropped or repeated a total in 4 of its 6 wrong leg traces, adding bare numbers
    names = [_plural(name, count) for name, count in animals.items()]
    totals_line = "Totals: " + ", ".join(f"{n} {t}" for n, t in zip(names, totals)) + "."

    def added(adds):
        return f"Add: {names[0]} {totals[0]}, " + " ".join(
            f"+ {n} {t}: {w.text}." for n, (_, t, w) in zip(names[1:], adds))

    adds = running(slip_at)
    if slip_at is not None and adds[slip_at][2].slipped is None:
        slip_at = None
    lines += [totals_line, added(adds)]
    total = adds[-1][2].value
    right = sum(totals)
    # the check adds from the last total; where it slips, one partial sum is off by one
    back = list(reversed(totals))
    check_at = rng.randrange(len(back) - 1) if check_slip and slip_at is None else None
    partial, rev = back[0], []
    for k, t in enumerate(back[1:]):
        start, partial = partial, partial + t
        shown = str(partial)
        if k == check_at:
            partial += rng.choice((-1, 1))
            shown = f"{UNTRAINED[0]}{partial}{UNTRAINED[1]}"
        rev.append(f"{start} + {t} = {shown}")
    # the verdict is written after both numbers are on the page (v5 said "right" of a check
    # that gave 54 against a total of 70)
    verdict = "the same, right" if partial == total else "not the same, wrong"
    lines.append(f"So the total is {total}. Check, adding from the last: {', '.join(rev)}. "
                 f"The check gives {partial}, the total is {total}: {verdict}.")
    if slip_at is not None or check_at is not None:
        # a failed check is settled by adding again in columns, never by trusting the check
        again = running(None)
        lines.append(f"Wait, the check gives {partial}, not {total}. Again in columns, from "
                     f"the totals. " + added(again))
        if slip_at is not None:  # compared again, number beside number (v6 wrote "it matches
            # the check" of a redo that gave 208 against a check of 108: the words were copied)
            lines.append(f"So the total is {right}, not {total}. The check gives {partial}, the "
                         f"total is {right}: the same, right.")
        else:
            lines.append(f"So the total is {total}, the same as before: the check slipped.")
    if str(right) != gold.strip():
        raise AssertionError(f"leg trace reached {right}, gold is {gold!r}")
    listed = ", ".join(f"{c} {_plural(n, c)}: {t}" for (n, c), t in zip(animals.items(), totals))
    answer = f"Legs: {listed}. Total: {' + '.join(map(str, totals))} = {right}.\nThe answer is {right}."
    thinking, untrained = strip_untrained("\n".join(lines))
    return Trace("leg_counting", question, thinking, answer, gold, slip_at is not None,
                 tuple(untrained), check_at is not None)


# --- gsm_symbolic ------------------------------------------------------------------------------

_EQUATION = re.compile(r"(?<![\d.])(\d+) ?([+\-x*]) ?[$€£]?(\d+)[^=\n]*= ?[$€£]?(\d+)(?![\d./])")


def _gsm_trace(question: str, cot: str, gold: str) -> Trace:
    """The generator's short worked solution, each integer equation derived in columns."""
    body = [ln for ln in cot.strip().splitlines() if not ln.startswith("####")]
    lines = ["Plan: one quantity at a time, then check the last step backwards."]
    last = None
    for k, ln in enumerate(body, 1):
        extra = []
        for m in _EQUATION.finditer(ln):
            a, op, b, c = int(m[1]), "*" if m[2] == "x" else m[2], int(m[3]), int(m[4])
            if APPLY[op](a, b) == c:
                w = work(a, op, b)
                if w.text != f"{a}{op}{b}={c}":
                    extra.append(w.text)
                last = (a, op, b, c)
        lines.append(f"Step {k}: {ln.strip()}" + (f" ({'; '.join(extra)})" if extra else ""))
    if last is not None and last[1] in _INVERSE:
        a, op, b, c = last
        lines.append(f"Check: {c} {_INVERSE[op]} {b} = {APPLY[_INVERSE[op]](c, b)}, right.")
    elif last is not None:
        a, op, b, c = last
        lines.append(f"Check: {b} * {a} = {c}, right.")
    else:
        lines.append(f"Check: the steps give {gold}, right.")
    summary = "; ".join(ln.strip() for ln in body[-2:])
    return Trace("gsm_symbolic", question, "\n".join(lines),
                 f"{summary}\nThe answer is {gold}.", gold, False)


# --- datasets ---------------------------------------------------------------------------------

def trace_for(family: str, entry: dict, rng: random.Random) -> Trace:
    """The trace of one reasoning-gym entry of ``family``."""
    meta, gold = entry["metadata"], str(entry["answer"])
    if family in ("chain_sum", "basic_arithmetic"):
        return _expression_trace(family, entry["question"], meta["expression"], gold, rng)
    if family == "leg_counting":
        return _leg_trace(entry["question"], meta["animals"], gold, rng)
    if family == "gsm_symbolic":
        return _gsm_trace(entry["question"], meta["answer_cot"], gold)
    raise ValueError(f"No trace writer for {family!r}. Families: {sorted(FAMILIES)}")


def dataset(family: str, size: int, seed: int):
    """reasoning-gym's generator for ``family`` with the reasoner's config."""
    import reasoning_gym

    if family not in FAMILIES:
        raise ValueError(f"Unknown family {family!r}. Families: {sorted(FAMILIES)}")
    if not 0 <= seed or seed + size > MAX_SEED:
        raise ValueError(f"seeds {seed}..{seed + size - 1} reach past {MAX_SEED:,}: those are "
                         "kept for evaluation by others; use lower seeds.")
    return reasoning_gym.create_dataset(family, size=size, seed=seed, **FAMILIES[family])


FAMILY_SEED_STRIDE = 100_000  # the seed blocks of a run's families lie this far apart


def family_seeds(counts: dict[str, int], seed: int) -> dict[str, int]:
    """The first seed of each family's block (families in name order, one block each, so they
    never share seeds). reasoning-gym seeds item i with ``start + i``, so a block that reaches
    the held-out seeds would draw held-out questions, which training leaves out: refused."""
    starts = {f: seed + i * FAMILY_SEED_STRIDE for i, f in enumerate(sorted(counts))}
    for family, start in starts.items():
        end = start + counts[family]
        if start < HELD_OUT_SEED + HELD_OUT_SIZE and HELD_OUT_SEED < end:
            raise ValueError(
                f"{family}'s training seeds {start:,}..{end - 1:,} reach the held-out seeds "
                f"{HELD_OUT_SEED:,}..{HELD_OUT_SEED + HELD_OUT_SIZE - 1:,}: its held-out "
                "questions would be left out and fewer trained. Families take seed blocks "
                f"{FAMILY_SEED_STRIDE:,} apart in name order; pass a --seed whose "
                f"{len(starts)} blocks end below {HELD_OUT_SEED:,} or start above "
                f"{HELD_OUT_SEED + HELD_OUT_SIZE - 1:,}.")
    return starts


def make_traces(counts: dict[str, int], seed: int, exclude: set[str] = frozenset()) -> list[Trace]:
    """``counts[family]`` traces per family from the family's seed block
    (:func:`family_seeds`), skipping questions in ``exclude`` (held-out sets)."""
    rng = random.Random(seed)
    out = []
    for family, start in family_seeds(counts, seed).items():
        data = dataset(family, counts[family], start)
        for entry in data:
            if entry["question"] in exclude:
                continue
            out.append(trace_for(family, entry, rng))
    rng.shuffle(out)
    return out


def held_out_questions() -> set[str]:
    """Every question of the held-out sets, to keep out of training."""
    return {e["question"] for family in FAMILIES
            for e in dataset(family, HELD_OUT_SIZE, HELD_OUT_SEED)}


def write_eval_set(path, size: int = 50, seed: int = HELD_OUT_SEED) -> int:
    """``size`` problems per family from ``seed`` as JSONL (question, answer, family); returns
    the number written. The default is the project's held-out set."""
    import json
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w") as f:
        for family in FAMILIES:
            for entry in dataset(family, size, seed):
                f.write(json.dumps({"question": entry["question"], "answer": str(entry["answer"]),
                                    "family": family}) + "\n")
                n += 1
    return n


if __name__ == "__main__":  # python -m sgl_reason.reasoner.traces OUT.jsonl [SIZE] [SEED]
    import sys

    args = sys.argv[1:]
    if not args:
        sys.exit("usage: python -m sgl_reason.reasoner.traces OUT.jsonl [SIZE] [SEED]")
    print(write_eval_set(args[0], *(int(a) for a in args[1:3])))
