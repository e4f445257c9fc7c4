"""Prompt normalization: drift collapses to one text; code and indentation survive."""

from __future__ import annotations

import pytest

from sgl_reason import normalize

CLEAN = "Solve the problems.\n\nQ: What is 2 + 3?\nA: 5\n\nQ: Café prices rose by 4.\n  - a list item"


@pytest.mark.parametrize("drifted", [
    CLEAN.replace("\n", "\r\n"),
    CLEAN.replace("\n", "\r"),
    "  \n" + CLEAN + "  \n\n\n",
    CLEAN.replace("Café", "Cafe\u0301"),  # decomposed accent
    CLEAN.replace(" + ", "\u00a0+  "),  # no-break space, double space
    CLEAN.replace("\n\n", "\n\n\n\n"),
    CLEAN.replace("Q:", "Q:\t").replace("\t", " ", 0),
    CLEAN.replace("2 + 3", "2 +\u200b 3"),
    CLEAN.replace("A: 5", "A: 5   "),
])
def test_drift_collapses_to_the_clean_text(drifted):
    assert normalize(drifted) == CLEAN
    assert normalize(normalize(drifted)) == normalize(drifted)


def test_code_blocks_and_indentation_are_kept():
    code = "```python\ndef f(x):\n    return  x  \n\n\n\n```"
    text = f"Fix this:\r\n{code}\n\n\n  indented  line"
    assert normalize(text) == f"Fix this:\n{code}\n\n  indented line"


def test_an_unclosed_fence_keeps_the_rest_verbatim():
    assert normalize("See:\n```\n  a  \n\n") == "See:\n```\n  a  \n\n"


def test_only_text():
    with pytest.raises(TypeError, match="str"):
        normalize(None)


@pytest.mark.server
def test_programs_share_the_prefix_of_drifted_prompts_unless_told_not_to(reasoner):
    import sgl_reason

    b = reasoner.endpoint
    budget = sgl_reason.ThinkingBudget(max_thinking_tokens=8, max_answer_tokens=4)
    system = CLEAN * 4  # long enough that the prefix dominates the prompt
    drifted = system.replace("\n", "\r\n").replace("Café", "Cafe\u0301")

    def cost(system_text, **kw):
        return sgl_reason.think_then_answer("What is 4 + 4?", system=system_text, budget=budget,
                                            backend=b, **kw).cost

    reasoner.flush_cache()
    first = cost(system)
    assert cost(drifted).computed_prefill_tokens < first.computed_prefill_tokens / 4
    reasoner.flush_cache()
    cost(system)
    assert cost(drifted, normalize_prompt=False).computed_prefill_tokens > first.prompt_tokens / 2


def test_the_drift_benchs_copies_all_normalize_to_its_clean_prefix():
    import random

    from sgl_reason.bench.prompt_drift import SYSTEM, drifted

    rng = random.Random(0)
    copies = [drifted(SYSTEM, rng) for _ in range(200)]
    assert len(set(copies)) > 50 and normalize(SYSTEM) == SYSTEM
    assert {normalize(c) for c in copies} == {SYSTEM}


def test_chat_turns_are_checked_and_each_normalized():
    from sgl_reason.programs.common import prompt_texts

    turns = [{"role": "system", "content": "Be  brief.\r\n"}, {"role": "user", "content": "Hi\u00a0there"}]
    assert prompt_texts(turns, None, True)[0] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert prompt_texts(turns, None, False)[0] is turns
    for bad, words in (([], "non-empty"), ([{"role": "user"}], "messages\\[0\\]"),
                       ([{"role": "bot", "content": "x"}], "messages\\[0\\]"),
                       ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                        "last message")):
        with pytest.raises(ValueError, match=words):
            prompt_texts(bad, None, True)
