"""Integer arithmetic written out in steps small enough for a 135M model.

Every operation returns a :class:`Worked`: its result and the text that derives it. Each
decision the model would otherwise make silently is written down where it is made, because the
v1 reasoner's errors were exactly those silent decisions (measured on held-out problems: the
wrong digit of a long number, a dropped borrow, "124 is less than 47"):

- every column is named by its place (``tens 2+8+1=11, 1 carry 1``), so the digit to fetch and
  the digit to write are found by the label, not by counting positions;
- a borrow is its own fact, decided after both digits are written (``tens 6-1=5, 5 and 8: 5<8,
  borrow: 15-8=7``);
- before a difference the two numbers are compared, length first, then digit by digit from the
  left, each pair written before its sign (``both have 2 digits, 9 and 9: 9=9, 4 and 5: 4<5:
  95 is larger``);
- a product's carry is added as its own fact (``tens 3*7=21, 21+2=23, 3 carry 2``);
- a result is read back from its columns by place before it is written (v5: ``Read hundreds 8,
  tens 1, ones 3. So 427+386=813``), a difference's leading zeros named as dropped (v7:
  ``Read tens 7, ones 6; hundreds 0 dropped. So 863-787=76``).

A *slip* replaces one column's result with a plausible wrong one (off by one) and carries the
error through, as a careless human would; the trace builder lets a later check catch it. The
wrong value is wrapped in :data:`UNTRAINED` markers so that training can leave it out of the
loss: the model learns to catch and fix a slip, never to make one.

| operation            | written as                                                          |
|----------------------|---------------------------------------------------------------------|
| one-digit operands   | the fact itself: ``7+6=13``                                         |
| a + b (a, b >= 0)    | ``ones 7+6=13, 3 carry 1; tens 2+8+1=11, 1 carry 1; hundreds 4+3+1=8.  |
|                      | Read hundreds 8, tens 1, ones 3. So 427+386=813``                   |
| a - b (a >= b >= 0)  | ``ones 3 and 7: 3<7, borrow: 13-7=6; tens 6-1=5, 5 and 8: 5<8, ...`` |
| pos - neg            | the comparison, then the larger minus the smaller, then the sign    |
| signed a + b, a - b  | reduced to one of the above, the reduction said in words            |
| a * b                | ``a`` times each digit of ``b`` in named columns, partials added    |
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

# Around a slipped (deliberately wrong) value in a trace: training masks what is inside.
UNTRAINED = ("\x02", "\x03")

PLACES = ("ones", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands",
          "millions", "ten-millions", "hundred-millions", "billions", "ten-billions")


@dataclass(frozen=True)
class Worked:
    value: int
    text: str  # the derivation, ending in the result
    slipped: str | None = None  # the wrong value of a slipped fact ("12")


class Slip:
    """A one-shot wrong column result: the first fact offered is off by ``delta``."""

    def __init__(self, rng: random.Random):
        self.delta = rng.choice((-1, 1))
        self.used = False
        self.wrong: str | None = None

    def take(self, value: int, hi: int | None = None) -> int:
        if self.used or value + self.delta < 0 or (hi is not None and value + self.delta > hi):
            return value
        self.used = True
        self.wrong = str(value + self.delta)
        return value + self.delta


def strip_untrained(text: str) -> tuple[str, list[tuple[int, int]]]:
    """``text`` without the :data:`UNTRAINED` markers, and the spans they enclosed."""
    left, right = UNTRAINED
    spans, out, pos = [], [], 0
    for m in re.finditer(re.escape(left) + "(.*?)" + re.escape(right), text, re.S):
        out.append(text[pos:m.start()])
        start = sum(map(len, out))
        out.append(m[1])
        spans.append((start, start + len(m[1])))
        pos = m.end()
    out.append(text[pos:])
    return "".join(out), spans


def _place(i: int) -> str:
    return PLACES[i] if i < len(PLACES) else f"place {i + 1}"


def _read_out(out: list[int]) -> str:
    """The written column digits (``out``, ones first) read back from the highest place, each
    named by its place, so the result line copies digits by their label instead of reversing
    a row of columns in one go (v4 wrote ``So 752+1880=1633``).

    A difference's leading zeros are named as dropped, not read (v7): all 5 of v6's wrong
    greedy chain_sum traces had read a leading 0 (``Read hundreds 0, tens 9, ones 2``), against
    16 of its 45 right ones, and then either misread it (``Read hundreds 0, tens 2, ones 3. So
    233``) or added from a hundreds digit the number no longer has (``92+81``: ``hundreds
    1+0+1=2``)."""
    top = len(out) - 1
    while top > 0 and out[top] == 0:
        top -= 1
    read = ", ".join(f"{_place(i)} {out[i]}" for i in reversed(range(top + 1)))
    dropped = ", ".join(f"{_place(i)} 0" for i in reversed(range(top + 1, len(out))))
    return read + (f"; {dropped} dropped" if dropped else "")


def _spelled(n: int) -> str:
    """``n >= 0`` by place from the highest: ``tens 7, ones 1``."""
    return ", ".join(f"{_place(i)} {d}" for i, d in reversed(list(enumerate(_digits(n)))))


def _digits(n: int) -> list[int]:
    """Digits of ``n >= 0``, ones first."""
    return [int(c) for c in reversed(str(n))]


def _fact(fact: str, value: int, slip: Slip | None, hi: int | None = None) -> tuple[str, int]:
    """``fact=value``; a slip changes the value and marks it untrained."""
    if slip is not None and not slip.used:
        wrong = slip.take(value, hi)
        if slip.used:
            return f"{fact}={UNTRAINED[0]}{wrong}{UNTRAINED[1]}", wrong
    return f"{fact}={value}", value


def add_columns(a: int, b: int, slip: Slip | None = None) -> Worked:
    """``a + b`` for ``a, b >= 0``."""
    if (a < 10 and b < 10) or min(a, b) == 0:
        text, value = _fact(f"{a}+{b}", a + b, slip)
        return Worked(value, text)
    da, db = _digits(a), _digits(b)
    carry, parts, out = 0, [], []
    for i in range(max(len(da), len(db))):
        x, y = da[i] if i < len(da) else 0, db[i] if i < len(db) else 0
        expr = f"{x}+{y}" + (f"+{carry}" if carry else "")
        text, s = _fact(expr, x + y + carry, slip)
        carry = s // 10
        parts.append(f"{_place(i)} {text}" + (f", {s % 10} carry {carry}" if carry else ""))
        out.append(s % 10)
    if carry:
        parts.append(f"{_place(len(out))} {carry}")
        out.append(carry)
    value = int("".join(str(d) for d in reversed(out)))
    return Worked(value, "; ".join(parts) + f". Read {_read_out(out)}. So {a}+{b}={value}")


def sub_columns(a: int, b: int, slip: Slip | None = None) -> Worked:
    """``a - b`` for ``a >= b >= 0``."""
    if a < 10 or b == 0:
        text, value = _fact(f"{a}-{b}", a - b, slip)
        return Worked(value, text)
    da, db = _digits(a), _digits(b)
    borrow, parts, out = 0, [], []
    for i in range(len(da)):
        x, y = da[i], db[i] if i < len(db) else 0
        part = []
        if borrow:
            part.append(f"{x}-1={x - 1}")
            x -= 1
        borrow = 1 if x < y else 0
        part.append(_pair(x, y) + (", borrow:" if borrow else ""))
        top = x + 10 * borrow
        text, d = _fact(f"{top}-{y}", top - y, slip, hi=9)
        part.append(text)
        parts.append(f"{_place(i)} " + ", ".join(part).replace(":,", ":"))
        out.append(d)
    value = int("".join(str(d) for d in reversed(out)))
    return Worked(value, "; ".join(parts) + f". Read {_read_out(out)}. So {a}-{b}={value}")


def _pair(x: int, y: int) -> str:
    """Two digits, then their order: ``3 and 7: 3<7``. The sign is written after both digits,
    so it is read off the page; v3 wrote ``3<7`` and its errors were that sign, chosen before
    the second digit was on the page (``5<1``, ``8>8``)."""
    return f"{x} and {y}: {x}{'=' if x == y else ('<' if x < y else '>')}{y}"


def compare(a: int, b: int) -> str:
    """Which of ``a, b >= 0`` is larger, decided where a person decides it: the length first,
    then the digits from the left. ``a == b`` says so."""
    sa, sb = str(a), str(b)
    if len(sa) != len(sb):
        def n(s):
            return f"{len(s)} digit" + ("s" if len(s) > 1 else "")
        return f"{a} has {n(sa)}, {b} has {n(sb)}: {max(a, b)} is larger"
    if len(sa) == 1:
        return f"{_pair(a, b)}: " + ("the same" if a == b else f"{max(a, b)} is larger")
    seen = []
    for x, y in zip(sa, sb):
        seen.append(_pair(int(x), int(y)))
        if x != y:
            break
    tail = "the same" if a == b else f"{max(a, b)} is larger"
    return f"both have {len(sa)} digits, {', '.join(seen)}: {tail}"


def _wrap(w: Worked, slip: Slip | None) -> Worked:
    if slip is not None and slip.used and w.slipped is None:
        return Worked(w.value, w.text, slip.wrong)
    return w


def _difference(pos: int, neg: int, slip: Slip | None) -> Worked:
    """``pos - neg`` for ``pos, neg >= 0``: compared first, then the larger minus the smaller."""
    if pos < 10 and neg < 10:
        if pos >= neg:
            text, value = _fact(f"{pos}-{neg}", pos - neg, slip)
            return Worked(value, f"{_pair(pos, neg)}, {text}")
        text, value = _fact(f"{neg}-{pos}", neg - pos, slip)
        return Worked(-value, f"{_pair(pos, neg)}, so -({neg}-{pos}): {text}, so {-value}")
    if neg == 0:
        return Worked(pos, f"{pos}-0={pos}")
    which = compare(pos, neg)
    if pos >= neg:
        w = sub_columns(pos, neg, slip)
        return Worked(w.value, f"{which}. {w.text}")
    w = sub_columns(neg, pos, slip)
    return Worked(-w.value, f"{which}, so {pos}-{neg} is -({neg}-{pos}). {w.text}, "
                            f"so {pos}-{neg}={-w.value}")


def add(a: int, b: int, slip: Slip | None = None) -> Worked:
    """Signed ``a + b``, reduced to columns of non-negative numbers."""
    if a >= 0 and b >= 0:
        return _wrap(add_columns(a, b, slip), slip)
    if a < 0 and b < 0:
        w = add_columns(-a, -b, slip)
        return _wrap(Worked(-w.value, f"both negative, so -({-a}+{-b}): {w.text}, so "
                                      f"{-w.value}"), slip)
    pos, neg = (a, -b) if a >= 0 else (b, -a)
    w = _difference(pos, neg, slip)
    return _wrap(Worked(w.value, f"{a}+{b} is {pos}-{neg}: {w.text}"), slip)


def sub(a: int, b: int, slip: Slip | None = None) -> Worked:
    """Signed ``a - b``."""
    if b < 0:
        w = add(a, -b, slip)
        return Worked(w.value, f"minus {b} is plus {-b}: {w.text}", w.slipped)
    if a < 0:
        w = add_columns(-a, b, slip)
        return _wrap(Worked(-w.value, f"{a}-{b} is -({-a}+{b}): {w.text}, so {-w.value}"), slip)
    return _wrap(_difference(a, b, slip), slip)


def mul_columns(a: int, b: int, slip: Slip | None = None, second_on_top: bool = False) -> Worked:
    """``a * b`` for ``a, b >= 0``: ``a`` times each digit of ``b``, then the partials added.
    ``second_on_top``: ``b`` times each digit of ``a`` where both have two digits or more (v8:
    the other half of a trace's two ways to work a product, named in its plan).

    Both numbers are first spelled by place and the rows counted (``44 is tens 4, ones 4; 71 is
    tens 7, ones 1: 2 rows.``), and each row names its number among them, its place and its
    digit (``row 2 of 2, tens 7:``). v11's wrong greedy products wrote rows from the template,
    not from the number: one row for a two-digit number (``18*1=18`` for 18 * 71), the same row
    twice (``80*9`` and ``80*9`` times 10 for 80 * 9), a top number's digits skipped. v12 (the
    count in the header only, rows labelled ``tens row 7:``) wrote the header right and still
    repeated the last row: the label now says which row is the last."""
    if (a < 10 and b < 10) or min(a, b) <= 1:
        text, value = _fact(f"{a}*{b}", a * b, slip)
        return Worked(value, text)
    if a < 10 <= b or (second_on_top and b >= 10):  # a one-digit number never goes on top
        a, b = b, a
    rows = len(_digits(b))
    header = f"{a} is {_spelled(a)}; {b} is {_spelled(b)}: {rows} row{'s' if rows > 1 else ''}. "
    lines, partials = [], []
    for place, d in enumerate(_digits(b)):
        if d <= 1:
            row, text = a * d, f"{a}*{d}={a * d}"
        else:
            carry, parts, out = 0, [], []
            for i, x in enumerate(_digits(a)):
                fact, p = _fact(f"{x}*{d}", x * d, slip)
                if carry:  # the product, then the carry added: one operation a fact
                    more, p = _fact(f"{p}+{carry}", p + carry, slip)
                    fact = f"{fact}, {more}"
                carry = p // 10
                parts.append(f"{_place(i)} {fact}" + (f", {p % 10} carry {carry}" if carry else ""))
                out.append(p % 10)
            if carry:
                parts.append(f"{_place(len(out))} {carry}")
                out.extend(_digits(carry))
            row = int("".join(str(v) for v in reversed(out)))
            text = f"{a}*{d}: " + "; ".join(parts) + f"; read {_read_out(out)}, so {row}"
        text = f"row {place + 1} of {rows}, {_place(place)} {d}: {text}"
        if b < 10:
            return Worked(row, header + text.replace(f", so {row}", f". So {a}*{b}={row}"))
        shifted = row * 10 ** place
        lines.append(text + (f", times {10 ** place} is {shifted}" if place else ""))
        partials.append(shifted)
    value = partials[0]
    for p in partials[1:]:
        step = add_columns(value, p, slip)
        lines.append(f"add {value}+{p}: {step.text}")
        value = step.value
    return Worked(value, header + "; ".join(lines) + f"; so {a}*{b}={value}")


def mul(a: int, b: int, slip: Slip | None = None, second_on_top: bool = False) -> Worked:
    """Signed ``a * b``: the sign first, then columns."""
    w = mul_columns(abs(a), abs(b), slip, second_on_top)
    if a < 0 or b < 0:
        negative = (a < 0) != (b < 0)
        value = -w.value if negative else w.value
        sign = "negative" if negative else "positive"
        return _wrap(Worked(value, f"the sign is {sign}; {w.text}, so {value}"), slip)
    return _wrap(w, slip)


OPS = {"+": add, "-": sub, "*": mul}
APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def work(a: int, op: str, b: int, slip: Slip | None = None, second_on_top: bool = False) -> Worked:
    if op == "*":
        return mul(a, b, slip, second_on_top)
    return OPS[op](a, b, slip)


def show(a: int, op: str, b: int, value: int) -> str:
    """One step as an equation, without its derivation: ``-43 + 93 = 50``."""
    return f"{a} {op} {b} = {value}"
