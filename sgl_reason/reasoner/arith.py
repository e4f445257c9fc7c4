"""Integer arithmetic written out in steps small enough for a 135M model.

Every operation returns a :class:`Worked`: its result and the text that derives it, one digit
fact per column (``7+6=13``), so that no step asks the model for more than a table lookup and
a carry. A *slip* replaces one digit fact with a plausible wrong one (off by one) and carries the
error through, exactly as a careless human would; the trace builder then lets a later check
catch it.

| operation            | written as (``427 + 386``, ``47 * 83``, ...)                      |
|----------------------|-------------------------------------------------------------------|
| one-digit operands   | the fact itself: ``7+6=13``                                       |
| a + b (a, b >= 0)    | columns from the ones: ``7+6=13, 2+8+1=11, 4+3+1=8, so 813``      |
| a - b (a >= b >= 0)  | columns with borrows: ``7-6=1, 12-8=4, 3-3=0, so 41``             |
| a - b (a < b)        | ``b - a`` in columns, then the sign: ``..., so -41``              |
| signed a + b, a - b  | reduced to one of the above, the reduction said in words          |
| a * b                | ``a`` times each digit of ``b`` with carries, partials added      |
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Worked:
    value: int
    text: str  # the derivation, ending in the result
    slipped: str | None = None  # the wrong value of a slipped digit fact ("12")
    fixed: str | None = None  # the same fact, right ("7+6 is 13")


class Slip:
    """A one-shot wrong digit fact: the first column fact offered is off by ``delta``."""

    def __init__(self, rng: random.Random):
        self.delta = rng.choice((-1, 1))
        self.used = False
        self.wrong: str | None = None
        self.right: str | None = None

    def take(self, fact: str, value: int, hi: int | None = None) -> int:
        if self.used or value + self.delta < 0 or (hi is not None and value + self.delta > hi):
            return value
        self.used = True
        self.right = f"{fact} is {value}"
        self.wrong = str(value + self.delta)
        return value + self.delta


def _digits(n: int) -> list[int]:
    """Digits of ``n >= 0``, ones first."""
    return [int(c) for c in reversed(str(n))]


def _fact(fact: str, value: int, slip: Slip | None, hi: int | None = None) -> tuple[str, int]:
    if slip is not None:
        value = slip.take(fact, value, hi)
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
        parts.append(text)
        out.append(s % 10)
        carry = s // 10
    if carry:
        out.append(carry)
    value = int("".join(str(d) for d in reversed(out)))
    return Worked(value, ", ".join(parts) + f", so {a}+{b}={value}")


def sub_columns(a: int, b: int, slip: Slip | None = None) -> Worked:
    """``a - b`` for ``a >= b >= 0``."""
    if a < 10 or b == 0:
        text, value = _fact(f"{a}-{b}", a - b, slip)
        return Worked(value, text)
    da, db = _digits(a), _digits(b)
    borrow, parts, out = 0, [], []
    for i in range(len(da)):
        x, y = da[i] - borrow, db[i] if i < len(db) else 0
        borrow = 1 if x < y else 0
        top = x + 10 * borrow
        text, d = _fact(f"{top}-{y}", top - y, slip, hi=9)
        parts.append(text)
        out.append(d)
    value = int("".join(str(d) for d in reversed(out)))
    return Worked(value, ", ".join(parts) + f", so {a}-{b}={value}")


def mul_columns(a: int, b: int, slip: Slip | None = None) -> Worked:
    """``a * b`` for ``a, b >= 0``: ``a`` times each digit of ``b``, then the partials added."""
    if (a < 10 and b < 10) or min(a, b) <= 1:
        text, value = _fact(f"{a}*{b}", a * b, slip)
        return Worked(value, text)
    if a < 10 <= b:  # the longer number on top
        a, b = b, a
    lines, partials = [], []
    for place, d in enumerate(_digits(b)):
        carry, parts, out = 0, [], []
        for x in _digits(a):
            expr = f"{x}*{d}" + (f"+{carry}" if carry else "")
            text, p = _fact(expr, x * d + carry, slip)
            parts.append(text)
            out.append(p % 10)
            carry = p // 10
        if carry:
            out.extend(_digits(carry))
        row = int("".join(str(v) for v in reversed(out)))
        if b < 10:
            return Worked(row, ", ".join(parts) + f", so {a}*{b}={row}")
        shifted = row * 10 ** place
        suffix = f", times {10 ** place} is {shifted}" if place else ""
        lines.append(f"{a}*{d}: " + ", ".join(parts) + f", so {row}{suffix}")
        partials.append(shifted)
    value = partials[0]
    for p in partials[1:]:
        step = add_columns(value, p, slip)
        lines.append(step.text)
        value = step.value
    return Worked(value, "; ".join(lines) + f"; so {a}*{b}={value}")


def _wrap(w: Worked, slip: Slip | None) -> Worked:
    if slip is not None and slip.used and w.slipped is None:
        return Worked(w.value, w.text, slip.wrong, slip.right)
    return w


def add(a: int, b: int, slip: Slip | None = None) -> Worked:
    """Signed ``a + b``, reduced to columns of non-negative numbers."""
    if a >= 0 and b >= 0:
        return _wrap(add_columns(a, b, slip), slip)
    if a < 0 and b < 0:
        w = add_columns(-a, -b, slip)
        return _wrap(Worked(-w.value, f"both negative: {w.text}, so {-w.value}"), slip)
    pos, neg = (a, -b) if a >= 0 else (b, -a)
    return _wrap(_difference(pos, neg, slip), slip)


def sub(a: int, b: int, slip: Slip | None = None) -> Worked:
    """Signed ``a - b``."""
    if b < 0:
        w = add(a, -b, slip)
        return Worked(w.value, f"minus {b} is plus {-b}: {w.text}", w.slipped, w.fixed)
    if a < 0:
        w = add_columns(-a, b, slip)
        return _wrap(Worked(-w.value, f"{a}-{b} is -({-a}+{b}): {w.text}, so {-w.value}"), slip)
    return _wrap(_difference(a, b, slip), slip)


def _difference(pos: int, neg: int, slip: Slip | None) -> Worked:
    """``pos - neg`` for ``pos, neg >= 0``."""
    if pos >= neg:
        return sub_columns(pos, neg, slip)
    w = sub_columns(neg, pos, slip)
    return Worked(-w.value, f"{pos} is less than {neg}: {w.text}, so {-w.value}")


def mul(a: int, b: int, slip: Slip | None = None) -> Worked:
    """Signed ``a * b``: the sign first, then columns."""
    w = mul_columns(abs(a), abs(b), slip)
    if a < 0 or b < 0:
        negative = (a < 0) != (b < 0)
        value = -w.value if negative else w.value
        sign = "negative" if negative else "positive"
        return _wrap(Worked(value, f"the sign is {sign}; {w.text}, so {value}"), slip)
    return _wrap(w, slip)


OPS = {"+": add, "-": sub, "*": mul}
APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def work(a: int, op: str, b: int, slip: Slip | None = None) -> Worked:
    return OPS[op](a, b, slip)


def show(a: int, op: str, b: int, value: int) -> str:
    """One step as an equation, without its derivation: ``-43 + 93 = 50``."""
    return f"{a} {op} {b} = {value}"
