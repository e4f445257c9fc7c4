"""The arithmetic verifier: which claims it reads, how it judges them, how it scores."""

from __future__ import annotations

import pytest

from sgl_reason.programs import Sample, arithmetic_verifier, check_arithmetic
from sgl_reason.programs.best_of_n import pick_best

# A trace of the tiny reasoner (held-out basic_arithmetic, greedy, v4): the thousands column of
# 2820-84 was dropped, and the check repeats the false result instead of catching it.
WRONG_TRACE = (
    "Step 1: -47 * 60. the sign is negative; 47*0=0; 47*6: ones 7*6=42, 2 carry 4; tens "
    "4*6=24, 24+4=28, 8 carry 2; hundreds 2, so 282, times 10 is 2820; add 0+2820: 0+2820=2820;"
    " so 47*60=2820, so -2820.\nNow: -2820 - -84\nStep 2: ones 0 and 4: 0<4, borrow: 10-4=6; "
    "tens 2-1=1, 1 and 8: 1<8, borrow: 11-8=3; hundreds 8-1=7, 7 and 0: 7>0, 7-0=7. So "
    "2820-84=7366, so 84-2820=-7366.\nCheck: 60 * -47 = -2820, right; -7366 + -84 = -2820, "
    "right.\n</think>\n-47 * 60 = -2820, -2820 - -84 = -7366.\nThe answer is -7366."
)


def claims(text: str) -> list[tuple[str, bool]]:
    return [(c.text, c.holds) for c in check_arithmetic(text).claims]


def test_reads_each_claim_of_a_trace_and_finds_the_false_ones():
    check = check_arithmetic(WRONG_TRACE)
    false = [c.text for c in check.claims if not c.holds]
    assert false == ["2820-84=7366", "84-2820=-7366", "-7366 + -84=-2820", "-2820 - -84=-7366"]
    held = [c.text for c in check.claims if c.holds]
    assert held[:6] == ["47*0=0", "7*6=42", "4*6=24", "24+4=28", "0+2820=2820", "47*60=2820"]
    assert "60 * -47=-2820" in held and "10-4=6" in held and "7-0=7" in held
    assert check.wrong == 4 and check.score == pytest.approx(1 / 5)


def test_sides_stop_at_words_commas_and_other_claims():
    # the left side is the longest expression ending at "=": never a number's tail, never
    # across the comma that ends the previous claim
    assert claims("so x, -2820 - -84 = -2736, next") == [("-2820 - -84=-2736", True)]
    assert claims("tens 8*7=56, 6 carry 5") == [("8*7=56", True)]
    assert claims("borrow: 13-5=8.") == [("13-5=8", True)]
    # a chain is one claim per "=", each side read as written
    assert claims("3*4 + 2 = 12 + 2 = 14") == [("3*4 + 2=12 + 2", True), ("12 + 2=14", True)]
    assert claims("12*4 = 48 + 3 = 51") == [("12*4=48 + 3", False), ("48 + 3=51", True)]


@pytest.mark.parametrize("text, expected", [
    ("(18 + -21) + 98 = 95", True),                  # parentheses and unary minus
    ("2 + 3 * 4 = 14", True),                        # precedence
    ("2 + 3 * 4 = 20", False),
    ("1,234 + 1 = 1,235", True),                     # thousands
    ("0.1 * 3 = 0.3", True),                         # exact, no float error
    ("10 / 3 = 3.33", True),                         # rounded to the places written
    ("10 / 3 = 3.3", True),
    ("10 / 3 = 3.34", False),
    ("7 / 2 = 3", False),                            # an integer is never a rounding
    ("6 \\times 7 = 42", True), ("6 × 7 = 42", True), ("84 ÷ 2 = 42", True),
    ("5 − 7 = -2", True),                            # the Unicode minus
])
def test_judgement(text, expected):
    assert claims(text) == [(claims(text)[0][0], expected)]


@pytest.mark.parametrize("text", [
    "Step 3 = 3",            # two bare numbers: a label, not a claim
    "x = 5 + 2",             # a side that is not an expression
    "if a <= 3+4 then",      # comparisons are not claims
    "a == 2+2",
    "4 / 0 = 1",             # division by zero is skipped, not judged
    "The answer is 42.",
])
def test_what_is_not_a_claim(text):
    assert claims(text) == []


def test_score_ranks_clean_work_first_and_unchecked_work_as_one_slip():
    assert arithmetic_verifier("q", "7*6=42 and 6*7=42") == 1.0
    assert arithmetic_verifier("q", "7*6=41") == 0.5
    assert arithmetic_verifier("q", "7*6=41, 6*7=43") == pytest.approx(1 / 3)
    assert arithmetic_verifier("q", "The answer is 42.") == 0.5


def test_a_long_run_of_numbers_is_read_in_bounded_time():
    text = "1, " * 20_000 + "2+2=4"
    assert claims(text) == [("2+2=4", True)]


def test_best_of_n_picks_the_clean_candidate_then_the_majority_among_clean_ones():
    texts = ["2820-84=7366. The answer is 7366.", "2820-84=2736. The answer is 2736.",
             "2820-84=2736. The answer is 2736.", "2800-84=2716. The answer is 2716."]
    samples = [Sample(text=t, answer_text=t, answer=t.split()[-1].rstrip("."),
                      score=arithmetic_verifier("q", t)) for t in texts]
    assert [s.score for s in samples] == [0.5, 1.0, 1.0, 1.0]
    assert pick_best(samples) == 1
