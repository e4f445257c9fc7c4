"""A verifier that needs no model: the candidate's own arithmetic, recomputed.

A reasoning trace is full of small written claims (``7*6=42``, ``2820-84=2736``, ``-3 + 15 =
12``) and a wrong answer usually goes through a false one. :func:`check_arithmetic` finds every
claim of the form ``expression = expression`` in a text and recomputes it exactly;
:func:`arithmetic_verifier` scores a best-of-N candidate by how many of its claims are false.
It runs no client code: the only thing it evaluates is its own parse of numbers, ``+ - * /``
(and ``× ÷ · \\times \\cdot \\div``), unary minus and parentheses.

What counts as a claim, around each ``=`` in the text:

    ======================  ===================================================================
    side                    read as
    ======================  ===================================================================
    left of ``=``           the longest expression that ends at the ``=`` (``ones 7*6=42``
                            reads ``7*6``; ``..., -2820 - -84 = ...`` reads ``-2820 - -84``)
    right of ``=``          the longest expression that starts after it (``=42, 2 carry 4``
                            reads ``42``; a chain ``3*4 + 2 = 12 + 2 = 14`` is two claims)
    skipped                 a side that is not an expression; two bare numbers (``step 3 = 3``);
                            a division by zero
    ======================  ===================================================================

Numbers are integers, decimals or thousands with commas (``1,234``); both sides are evaluated
with :class:`fractions.Fraction`, so there is no float error. A right side with ``d`` decimals
may round the left one to ``d`` places (``10/3 = 3.33`` holds; ``7/2 = 3`` does not).

The score (higher is better, as :func:`~sgl_reason.programs.best_of_n.best_of_n` expects):
``1 / (1 + wrong)`` when at least one claim was checked, ``0.5`` when none was (unverified,
ranked as one false claim). Best-of-N breaks equal scores by answer support, so among the
candidates with no false claim the majority answer wins.

What it cannot see: a step that is computed right but is the wrong step (an operand dropped
when the expression is rewritten), and a number copied wrong into a later step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["ArithmeticCheck", "Claim", "arithmetic_verifier", "check_arithmetic"]

_SYMBOLS = (("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"), ("×", "*"), ("·", "*"),
            ("÷", "/"), ("−", "-"))
# A number as written: thousands with commas, or digits with an optional decimal part.
_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?![\d,])|\d+(?:\.\d+)?")
# What an expression around "=" may be made of; anything else ends the side.
_SIDE_CHARS = set("0123456789.,+-*/() \t")
_MAX_SIDE = 120  # characters read on each side of "=": a claim is short, a list of numbers is not


@dataclass(frozen=True)
class Claim:
    text: str  # the claim as read, normalised: "7*6=42"
    holds: bool


@dataclass(frozen=True)
class ArithmeticCheck:
    claims: tuple[Claim, ...]  # every claim checked, in text order

    @property
    def wrong(self) -> int:
        return sum(not c.holds for c in self.claims)

    @property
    def score(self) -> float:
        """``1 / (1 + wrong)``; 0.5 when nothing was checked."""
        return 1.0 / (1 + self.wrong) if self.claims else 0.5


def _tokens(text: str) -> list[str] | None:
    """Numbers, operators and parentheses; ``None`` if ``text`` holds anything else."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c in " \t":
            i += 1
        elif c in "+-*/()":
            out.append(c)
            i += 1
        elif m := _NUMBER.match(text, i):
            out.append(m[0])
            i = m.end()
        else:
            return None
    return out


class _Parser:
    """Recursive descent over :func:`_tokens`: ``expr := term (('+'|'-') term)*``,
    ``term := unary (('*'|'/') unary)*``, ``unary := '-' unary | NUMBER | '(' expr ')'``."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.i, self.ops = tokens, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        self.i += 1
        return self.tokens[self.i - 1]

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op, self.ops = self.take(), self.ops + 1
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op, self.ops = self.take(), self.ops + 1
            rhs = self.unary()
            value = value * rhs if op == "*" else value / rhs  # ZeroDivisionError: skipped
        return value

    def unary(self) -> Fraction:
        tok = self.peek()
        if tok == "-":
            self.take()
            return -self.unary()
        if tok == "(":
            self.take()
            value = self.expr()
            if self.peek() != ")":
                raise ValueError("unclosed parenthesis")
            self.take()
            return value
        if tok is None or not tok[0].isdigit():
            raise ValueError(f"expected a number, got {tok!r}")
        return Fraction(self.take().replace(",", ""))


def _evaluate(tokens: list[str]) -> tuple[Fraction, int] | None:
    """The value of ``tokens`` and its number of binary operators, or ``None`` if they are not
    one whole expression."""
    if not tokens:
        return None
    parser = _Parser(tokens)
    try:
        value = parser.expr()
    except (ValueError, ZeroDivisionError):
        return None
    return (value, parser.ops) if parser.i == len(tokens) else None


def _left_side(text: str, end: int) -> tuple[str, Fraction, int] | None:
    """The longest expression ending at ``end``."""
    start = end
    while start > max(0, end - _MAX_SIDE) and text[start - 1] in _SIDE_CHARS:
        start -= 1
    run = text[start:end]
    for i in range(len(run)):  # the longest suffix first
        if i and run[i - 1] not in " \t,(":
            continue  # a side starts at a token boundary, never inside a number
        tokens = _tokens(run[i:])
        if tokens and (got := _evaluate(tokens)) is not None:
            return run[i:].strip(), *got
    return None


def _right_side(text: str, start: int) -> tuple[str, Fraction, int] | None:
    """The longest expression starting at ``start``."""
    end = start
    while end < min(len(text), start + _MAX_SIDE) and text[end] in _SIDE_CHARS:
        end += 1
    run = text[start:end]
    for j in range(len(run), 0, -1):  # the longest prefix first
        if j < len(run) and run[j].isdigit() and run[j - 1].isdigit():
            continue  # never end inside a number
        tokens = _tokens(run[:j])
        if tokens and (got := _evaluate(tokens)) is not None:
            return run[:j].strip(), *got
    return None


def _decimals(side: str) -> int | None:
    """Decimal places of a bare number (``"3.33"`` -> 2), ``None`` for an expression."""
    tokens = _tokens(side)
    if tokens is None or len([t for t in tokens if t != "-"]) != 1:
        return None
    number = tokens[-1]
    return len(number.split(".")[1]) if "." in number else 0


def _equal(left: Fraction, right: Fraction, right_text: str) -> bool:
    if left == right:
        return True
    places = _decimals(right_text)
    return bool(places) and abs(left - right) <= Fraction(1, 2 * 10 ** places)


def check_arithmetic(text: str) -> ArithmeticCheck:
    """Every ``expression = expression`` claim in ``text``, recomputed (see the module table)."""
    for old, new in _SYMBOLS:
        text = text.replace(old, new)
    claims = []
    for m in re.finditer("=", text):
        before, after = text[m.start() - 1:m.start()], text[m.end():m.end() + 1]
        if before in ("<", ">", "!", "=") or after == "=":
            continue  # <=, >=, !=, ==
        left, right = _left_side(text, m.start()), _right_side(text, m.end())
        if left is None or right is None or left[2] + right[2] == 0:
            continue
        holds = _equal(left[1], right[1], right[0])
        claims.append(Claim(f"{left[0]}={right[0]}", holds))
    return ArithmeticCheck(tuple(claims))


def arithmetic_verifier(question: str, candidate: str) -> float:
    """A best-of-N verifier: ``1 / (1 + false claims)`` in the candidate's text, 0.5 when it
    makes none (see :func:`check_arithmetic`). ``question`` is not read."""
    return check_arithmetic(candidate).score
