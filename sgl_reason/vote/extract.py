"""Final-answer extraction and normalisation for voting.

``extract_answer`` tries these rules in order and returns the first hit, stripped:

    ====  ==========================================  ===========================================
    step  rule                                        returns
    ====  ==========================================  ===========================================
    1     last complete ``\\boxed{...}``/``\\fbox{...}``  the braced content (nested braces kept;
                                                      an unclosed/empty box is skipped in favour
                                                      of the previous complete one)
    2     last ``#### X`` (GSM8K)                      the rest of that line
    3     last "the answer is X" / "final answer: X"  X up to the end of its sentence or line,
          / "answer: X" (case-insensitive)            without markdown ``**``, ``$``, ``\\(...\\)``
                                                      or a trailing period (a period after a
                                                      digit that runs into a word ends it:
                                                      "-89.assistant"); "answer:" at a line's
                                                      end reads the next line, "answer is"
                                                      does not; an empty phrase is skipped
    4     last number in the text                     that number as written ("1,234", "-3.5",
                                                      "3/4")
    -     nothing matched                             ``None``
    ====  ==========================================  ===========================================

A completion cut at its token limit (``cut=True``) that ends inside a number has an unfinished
last line: "1044.\n\nThe answer is: 104" was cut from "... 1044". Its answer is read from the
complete lines before it when they hold one, from the whole text otherwise.

``parse_number`` turns an answer into an exact ``fractions.Fraction`` (so "0.5" == "1/2" and
"18.00" == "18"); ``normalize_answer`` turns it into the key exact voting groups by.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["extract_answer", "parse_number", "normalize_answer", "extract_gsm8k_gold"]

# Rule 1: \boxed{ / \fbox{ openers; the content is then read by brace counting.
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Rule 2: GSM8K "#### 42" answer line.
_GSM8K = re.compile(r"####[ \t]*([^\n]*)")
# Rule 3: answer phrases. Markdown emphasis may sit between the words and the colon
# ("**Final Answer:** 42", "**Answer**: 42"); "is" must be a whole word ("isn't" is not).
_PHRASE = re.compile(
    r"(?:final\s+answer|answer)[\s*_]*(?:is\b|[:：=])",
    re.IGNORECASE,
)
# Rule 4: numbers as written in prose. A '-' counts as a sign only when it does not
# follow a word character or ')' (so "3-4" yields "4", not "-4").
_PROSE_NUMBER = re.compile(
    r"(?:(?<![\w)])-)?"
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
    r"(?:/\d+(?:\.\d+)?)?"
)

# parse_number: one number, optionally signed/currency-prefixed/percent-or-unit-suffixed.
_DECIMAL = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+"
_NUMBER = re.compile(
    rf"""^
    (?P<sign>[+-])?\s*
    [$€£¥]?\s*
    (?P<sign2>[+-])?\s*
    (?P<num>{_DECIMAL})
    (?:[eE](?P<exp>[+-]?\d+)|\s*(?:\\times|\\cdot|×|\*|x)\s*10\s*\^\s*\{{?(?P<exp10>[+-]?\d+)\}}?)?
    (?:\s*/\s*(?P<den>{_DECIMAL}))?
    (?P<rest>.*)
    $""",
    re.IGNORECASE | re.VERBOSE | re.DOTALL,
)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_FRAC_SHORT = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")
_LATEX_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_LATEX_NOISE = re.compile(r"\\[,;:! ]|\\left|\\right|\^\s*\{?\\circ\}?|\\circ|\\\$")
# A cut completion whose last characters are a number (maybe with a trailing '.', ',' or '/').
_ENDS_IN_NUMBER = re.compile(r"\d[.,/]?\Z")
_MAX_EXPONENT = 1000  # "1e999999999" would build a billion-digit integer


def _boxed_contents(text: str) -> list[str]:
    """Contents of every complete ``\\boxed{...}``/``\\fbox{...}``, in text order."""
    found = []
    for m in _BOX_OPEN.finditer(text):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    found.append(text[start:i])
                    break
    return found


def _clean_phrase_tail(tail: str, next_line: bool) -> str:
    """Cut an answer phrase's tail to the answer itself. ``next_line``: a phrase that ends its
    line may be answered on the next non-empty one ("Final answer:\n42"); "the answer is" at
    the end of a line states nothing (what follows is another part of the text)."""
    tail = tail.lstrip(" \t*_:：")
    if tail.startswith("\n"):
        if not next_line:
            return ""
        tail = tail.lstrip()
    tail = tail.split("\n", 1)[0]
    # end of sentence, not "3.5"; a number's period that runs into a word ends it too
    # ("-89.assistant": a model running on past its answer)
    tail = re.split(r"\.(?:\s|$)|(?<=\d)\.(?=[^\W\d_])", tail, maxsplit=1)[0]
    tail = tail.strip()
    previous = None
    while tail != previous:
        previous = tail
        tail = tail.strip(" \t*_").rstrip(".")
        for opener, closer in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if tail.startswith(opener):
                tail = tail[len(opener):]
            if tail.endswith(closer):
                tail = tail[: -len(closer)]
    return tail.strip()


def extract_answer(text: str, *, cut: bool = False) -> str | None:
    """The final answer in a model's output, or None when it states none.

    Rules are tried in the order of the module table; within a rule the *last* occurrence
    wins (models restate and correct themselves). The raw answer text is returned, stripped;
    use ``normalize_answer`` for a comparison key. ``cut``: the completion stopped at its token
    limit (finish reason "length"), so a number at its very end may be unfinished.
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_answer expects the completion text (str), got {type(text).__name__}")
    if cut and _ENDS_IN_NUMBER.search(text):
        complete = text[: text.rfind("\n")] if "\n" in text else ""
        answer = _extract(complete) if complete.strip() else None
        if answer is not None:
            return answer
    return _extract(text)


def _extract(text: str) -> str | None:
    for content in reversed(_boxed_contents(text)):
        if content.strip():
            return content.strip()
    for m in reversed(list(_GSM8K.finditer(text))):
        if m.group(1).strip():
            return m.group(1).strip()
    for m in reversed(list(_PHRASE.finditer(text))):
        answer = _clean_phrase_tail(text[m.end():], next_line=not m[0].lower().endswith("is"))
        if answer:
            return answer
    numbers = _PROSE_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _strip_latex(s: str) -> str:
    s = _LATEX_WRAPPERS.sub(r"\1", s)
    s = _LATEX_NOISE.sub("", s)
    s = _LATEX_FRAC.sub(r"(\1)/(\2)", s)
    s = _LATEX_FRAC_SHORT.sub(r"\1/\2", s)
    s = s.replace("{,}", ",").replace("\\%", "%").replace("$", "")
    s = s.replace("−", "-").replace("–", "-")
    return s


def _unparen(s: str) -> str:
    """Drop the parentheses _strip_latex puts around \\frac parts: "(3)/(4)" -> "3/4"."""
    return re.sub(r"\(\s*([+-]?[\d.,]+)\s*\)", r"\1", s)


def _is_unit_tail(rest: str) -> bool:
    """Whether what follows a number leaves it a number: nothing, '%', or unit words.

    Unit words ("dollars", "km", "km/h", "°C", "apples") are letters, spaces and ``./°'-``,
    starting with a letter or '°' and holding no digits or operators, so "3 + 4", "2x+1"
    and "1 or 2" stay non-numbers.
    """
    r = rest.strip()
    if r.startswith("%"):
        r = r[1:].strip()
    if not r:
        return True
    if not (r[0].isalpha() or r[0] == "°"):
        return False
    return all(c.isalpha() or c.isspace() or c in "./°'’-" for c in r)


def _decimal(s: str) -> Fraction:
    return Fraction(s.replace(",", ""))


def parse_number(s: str) -> Fraction | None:
    """The exact value of a numeric answer, or None when ``s`` is not a single number.

    Accepted: thousands separators ("1,234"), decimals ("18.00" == 18, ".5"), signs
    ("-3", "+3", unicode minus), fractions ("3/4", "-\\frac{3}{4}", "\\dfrac{3}{4}"),
    scientific notation ("1.5e3", "1.5 \\times 10^{3}"), a currency prefix ("$18", "€5"),
    a trailing period, and a unit tail of words ("18 dollars", "5 km", "42 apples").

    Percentages keep their number: "45%" -> 45, not 0.45, because math datasets (GSM8K,
    MATH) write "what percent ..." golds as the bare number of percent.

    Not numbers (None): expressions ("3 + 4", "2x+1", "\\sqrt{2}"), several numbers
    ("1 or 2", "1 1/2"), division by zero ("3/0"), words ("abc", "forty-two").
    """
    if not isinstance(s, str):
        return None
    t = _unparen(_strip_latex(s)).strip().rstrip(".").strip()
    m = _NUMBER.match(t)
    if m is None or not _is_unit_tail(m.group("rest")):
        return None
    if m.group("sign") and m.group("sign2"):
        return None  # "-$-5"
    try:
        value = _decimal(m.group("num"))
        exp = m.group("exp") or m.group("exp10")
        if exp is not None:
            if abs(int(exp)) > _MAX_EXPONENT:
                return None
            value *= Fraction(10) ** int(exp)
        if m.group("den") is not None:
            den = _decimal(m.group("den"))
            if den == 0:
                return None
            value /= den
    except (ValueError, ZeroDivisionError):
        return None
    if (m.group("sign") or m.group("sign2")) == "-":
        value = -value
    return value


_TEXT_EDGE = " \t\n.,;:!?*\"'`$_"


def normalize_answer(s: str) -> str:
    """The canonical key exact voting groups answers by.

    Numbers become ``str(parse_number(s))``: "18", "18.00", "$18" -> "18"; "0.5", "1/2",
    "\\frac{1}{2}" -> "1/2"; "-3" -> "-3". Anything else is unwrapped from ``\\text{}``-style
    LaTeX, lower-cased, whitespace-collapsed and stripped of surrounding punctuation, ``$``
    and markdown emphasis (brackets are kept: "(0, 1]" is an interval). May return "" for an
    answer that is only punctuation; voters count that as no answer.
    """
    value = parse_number(s)
    if value is not None:
        return str(value)
    t = _LATEX_WRAPPERS.sub(r"\1", s).replace("$", "")
    t = " ".join(t.lower().split())
    return t.strip(_TEXT_EDGE)


def extract_gsm8k_gold(answer_field: str) -> str:
    """The gold number of a GSM8K ``answer`` field: the text after its last ``####``, commas removed.

    Raises ValueError when there is no ``####`` line, which usually means the wrong column
    (e.g. ``question``) or a non-GSM8K dataset was passed.
    """
    matches = [m.group(1).strip() for m in _GSM8K.finditer(answer_field)]
    if not matches or not matches[-1]:
        raise ValueError(
            f"GSM8K answer field has no '#### <number>' line: {answer_field[-120:]!r}. "
            "Pass the dataset's 'answer' column (which ends in '#### N'), not 'question'."
        )
    return matches[-1].replace(",", "").strip()
