"""Tests for sgl_reason/vote/extract.py: answer extraction, numbers, keys, GSM8K golds."""

from fractions import Fraction

import pytest

from sgl_reason.vote import extract_answer, extract_gsm8k_gold, normalize_answer, parse_number


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"So the result is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"Hence \boxed{x^{2}+1}", r"x^{2}+1"),
        (r"First \boxed{3}, wait, actually \boxed{4}.", "4"),
        (r"\fbox{ 12 }", "12"),
        (r"\boxed{7} and then a truncated \boxed{8", "7"),
        ("Natalia sold 48+24 = 72 clips.\n#### 1,234", "1,234"),
        ("The answer is $18.", "18"),
        ("**Final Answer:** 42", "42"),
        ("**Answer**: Paris", "Paris"),
        ("final answer: 5 km.", "5 km"),
        ("The answer is 18. Because 9 + 9 = 18 as well.", "18"),
        ("The answer is -89.assistant\nStart: 85 - 81", "-89"),  # ran on past its answer
        ("The answer is 2.5.Done", "2.5"),
        (r"The answer is \(\frac{3}{4}\).", r"\frac{3}{4}"),
        ("Final answer:\n\n  7\n", "7"),
        ("I think the answer is 3. No wait, the answer is 5.", "5"),
        ("She has 3 apples and buys 12 more, 15 apples in total", "15"),
        ("The total is 1,234.5 meters", "1,234.5"),
        ("Going from 3-4 steps", "4"),
        ("The temperature was -5 degrees", "-5"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extraction_order_boxed_beats_later_phrase_and_numbers():
    """A boxed answer wins over a later "answer:" phrase and over later numbers."""
    text = r"\boxed{10} Answer: 11. Then 12."
    assert extract_answer(text) == "10"


def test_extraction_order_gsm8k_beats_phrase():
    assert extract_answer("The answer is 3\n#### 4") == "4"


@pytest.mark.parametrize("text", ["", "I don't know.", "No idea, sorry", r"\boxed{}"])
def test_extract_answer_none(text):
    assert extract_answer(text) is None


@pytest.mark.parametrize(
    "text, cut, expected",
    [  # the first four: answers SmolLM2 wrote when its 16 answer tokens ran out (budget 384)
        (" 1044.\n\nThe answer is: 104", True, "1044"),
        (" 1044.\n\nThe answer is: 104", False, "104"),  # a finished text means what it says
        (" 10\n\nThe explanation is:\n\nThe answer is 1", True, "10"),
        (" 10\n\nThe answer is: 10.", True, "10"),
        # a cut that does not end in a number leaves the last line's answer whole
        (" 7\n\nThe answer is: 12.\n\nThe", True, "12"),
        # nothing complete to fall back on: the whole text, as without the cut
        (" 1212 / 9298 = 0.0", True, "0.0"),
        ("Let me think.\nThe answer is 4", True, "4"),
    ],
)
def test_extract_answer_from_a_cut_completion(text, cut, expected):
    assert extract_answer(text, cut=cut) == expected


def test_extract_answer_rejects_non_text():
    with pytest.raises(TypeError, match="completion text"):
        extract_answer(None)


@pytest.mark.parametrize(
    "s, expected",
    [
        ("1,234.50", Fraction(246900, 200)),
        ("1,234", Fraction(1234)),
        ("-3", Fraction(-3)),
        ("+3", Fraction(3)),
        ("−7", Fraction(-7)),
        ("3/4", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"\dfrac{1}{2}", Fraction(1, 2)),
        (r"-\frac{3}{4}", Fraction(-3, 4)),
        ("$18.00", Fraction(18)),
        ("18.", Fraction(18)),
        ("45%", Fraction(45)),
        (r"45\%", Fraction(45)),
        ("18 dollars", Fraction(18)),
        ("5 km", Fraction(5)),
        (r"\text{5 km}", Fraction(5)),
        ("1.5e3", Fraction(1500)),
        ("2E-2", Fraction(1, 50)),
        (r"1.5 \times 10^{3}", Fraction(1500)),
        (".5", Fraction(1, 2)),
        ("0.1", Fraction(1, 10)),
        (r"90^\circ", Fraction(90)),
        ("1{,}000", Fraction(1000)),
    ],
)
def test_parse_number(s, expected):
    assert parse_number(s) == expected


@pytest.mark.parametrize(
    "s",
    ["abc", "", "   ", "3 + 4", "2x+1", "1 or 2", "3/0", "forty-two", r"\sqrt{2}", "1,2", "1e99999"],
)
def test_parse_number_rejects(s):
    assert parse_number(s) is None


def test_parse_number_is_exact():
    """Decimal and fraction spellings of one value are equal, with no float rounding."""
    assert parse_number("0.5") == parse_number("1/2") == parse_number(r"\frac{1}{2}")
    assert parse_number("18.00") == parse_number("18")
    assert parse_number("0.1") + parse_number("0.2") == parse_number("0.3")


@pytest.mark.parametrize(
    "s, key",
    [
        ("18", "18"),
        ("18.00", "18"),
        ("$18", "18"),
        ("0.5", "1/2"),
        (r"\frac{1}{2}", "1/2"),
        ("-3.0", "-3"),
        ("  Paris,  France. ", "paris, france"),
        (r"\text{Paris}", "paris"),
        ("**Yes**", "yes"),
        ("$x^2+1$", "x^2+1"),
        ("(0, 1]", "(0, 1]"),
        ("...", ""),
    ],
)
def test_normalize_answer(s, key):
    assert normalize_answer(s) == key


def test_extract_gsm8k_gold():
    field = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,234"
    assert extract_gsm8k_gold(field) == "1234"
    assert extract_gsm8k_gold("#### 72") == "72"


def test_extract_gsm8k_gold_missing_names_the_problem():
    with pytest.raises(ValueError, match=r"####.*'answer' column"):
        extract_gsm8k_gold("How many clips did Natalia sell?")


@pytest.mark.parametrize("text, answer", [
    # SmolLM2 wrote both: "the answer is" at a line's end states nothing, and an empty later
    # phrase does not override an earlier real answer
    (" 20\n\nA:The answer is 20.\n\nC:The answer is \n</reasoning>\n\nD:", "20"),
    ("The answer is 20.\nThe answer is \n\nD:", "20"),
    ("Final answer:\n42", "42"),  # a phrase ending in a colon is answered on the next line
])
def test_an_answer_phrase_does_not_read_across_a_line_break(text, answer):
    assert extract_answer(text) == answer
