"""Code-written reasoning traces: right answers, the trace shape, slips, seeds (no server)."""

from __future__ import annotations

import random
import re

import pytest

from sgl_reason.reasoner import arith
from sgl_reason.reasoner.traces import (
    FAMILIES, HELD_OUT_SEED, MAX_SEED, ORDER_WEIGHTS, ORDERS, THINK_END, THINK_START, chain_plan,
    dataset, family_seeds, make_traces, trace_for,
)
from sgl_reason.vote import extract_answer


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_trace_reaches_the_gold_answer_and_answers_from_its_thinking(family):
    rng = random.Random(0)
    for entry in dataset(family, 60, seed=7_000_000):
        t = trace_for(family, entry, rng)
        assert t.answer.splitlines()[-1] == f"The answer is {t.gold}."
        assert extract_answer(t.answer) == t.gold
        assert t.completion.startswith(f"{THINK_START}\n") and f"\n{THINK_END}\n" in t.completion
        assert t.thinking.startswith("Plan:") and "Check" in t.thinking
        # the answer copies numbers the thinking wrote
        numbers = [w.strip(".,:") for w in t.answer.split() if w.strip(".,:").lstrip("-").isdigit()]
        assert all(n in t.thinking for n in numbers), (t.thinking, t.answer)


def test_about_one_arithmetic_trace_in_five_slips_and_is_corrected_by_its_check():
    traces = make_traces({"chain_sum": 150, "basic_arithmetic": 150, "leg_counting": 100},
                         seed=7_100_000)
    slipped = [t for t in traces if t.slipped]
    assert 0.1 < len(slipped) / len(traces) < 0.3
    for t in slipped:
        assert "wrong" in t.thinking and "\nWait, " in t.thinking
        assert t.thinking.rfind("Wait") < t.thinking.rfind(t.gold)  # the fix reaches the gold
        assert "again" in t.thinking.split("\nWait, ")[1].lower()  # settled by redoing, in columns
    assert not any("Wait" in t.thinking for t in traces if not (t.slipped or t.check_slipped))


def test_a_check_that_slips_is_caught_by_redoing_the_step_and_the_result_stands():
    """At inference a check's own error is the common case: the v2 reasoner "corrected" right
    totals into wrong ones. Here a failed check is settled by redoing the work in columns."""
    traces = make_traces({"chain_sum": 150, "basic_arithmetic": 150, "leg_counting": 100},
                         seed=7_300_000)
    checked = [t for t in traces if t.check_slipped]
    assert 0.04 < len(checked) / len(traces) < 0.16
    assert not any(t.slipped and t.check_slipped for t in traces)
    for t in checked:
        before, after = t.thinking.split("\nWait, ")
        assert "wrong" in before and "the check slipped" in after
        # the result before the check is the gold, and it is kept
        assert f"result is {t.gold}." in before or f"total is {t.gold}." in before
        # the check's wrong value is the one untrained span
        (a, b), = t.untrained
        assert t.thinking.rfind("Check", 0, a) >= 0 and b < len(before)


def test_column_arithmetic_is_exact_and_a_slip_is_one_wrong_digit_fact():
    rng = random.Random(1)
    for _ in range(3000):
        a, b, op = rng.randint(-999, 999), rng.randint(-999, 999), rng.choice("+-*")
        assert arith.work(a, op, b).value == arith.APPLY[op](a, b)
    w = arith.work(427, "+", 386, arith.Slip(random.Random(1)))
    assert w.value != 813 and w.slipped in ("12", "14")
    # the wrong value is marked so that training leaves it out of the loss
    text, spans = arith.strip_untrained(w.text)
    assert f"7+6={w.slipped}," in text and [text[a:b] for a, b in spans] == [w.slipped]
    assert text.startswith("ones 7+6=") and text.endswith(f"So 427+386={w.value}")


def test_every_decision_is_written_where_it_is_made():
    """The v1 reasoner failed on silent decisions: the comparison before a difference, the
    borrow, the column a digit comes from. The traces now spell each one out."""
    assert arith.compare(94, 95) == "both have 2 digits, 9 and 9: 9=9, 4 and 5: 4<5: 95 is larger"
    assert arith.compare(124, 47) == "124 has 3 digits, 47 has 2 digits: 124 is larger"
    assert arith.work(863, "-", 787).text == (
        "both have 3 digits, 8 and 7: 8>7: 863 is larger. ones 3 and 7: 3<7, borrow: 13-7=6; "
        "tens 6-1=5, 5 and 8: 5<8, borrow: 15-8=7; hundreds 8-1=7, 7 and 7: 7=7, 7-7=0. "
        "Read tens 7, ones 6; hundreds 0 dropped. So 863-787=76")
    assert arith.work(-3, "+", 98).value == 95 and "98 is larger" in arith.work(-3, "+", 98).text
    assert arith.work(37, "-", 36).text.startswith(
        "both have 2 digits, 3 and 3: 3=3, 7 and 6: 7>6: 37 is larger")
    # v3's errors were signs chosen before the second digit was written, and a product's carry
    # added inside the product: v4 writes both digits first and adds the carry as its own fact
    assert arith.work(6, "-", 9).text.startswith("6 and 9: 6<9, so -(9-6)")
    assert "tens 9*8=72, 72+3=75, 5 carry 7" in arith.work(94, "*", 28).text


def test_results_and_rewrites_are_copied_by_name_not_assembled_silently():
    """v4's remaining basic_arithmetic errors: a result line that did not read its own columns
    (``So 752+1880=1633``) and an expression rewritten with an operand dropped. v5 reads the
    digits back by place and names the part of the expression a step replaces."""
    assert arith.work(752, "+", 1880).text.endswith(
        "thousands 0+1+1=2. Read thousands 2, hundreds 6, tens 3, ones 2. So 752+1880=2632")
    # v7: a difference's leading zeros are named as dropped, not read as digits
    assert arith.work(105, "-", 98).text.endswith("Read ones 7; hundreds 0, tens 0 dropped. So 105-98=7")
    assert arith.work(112, "-", 20).text.endswith("Read tens 9, ones 2; hundreds 0 dropped. So 112-20=92")
    assert arith.work(100, "-", 100).text.endswith("Read ones 0; hundreds 0, tens 0 dropped. So 100-100=0")
    product = arith.work(94, "*", 28).text
    assert ("hundreds 7; read hundreds 7, tens 5, ones 2, so 752; row 2 of 2, tens 2: 94*2:"
            in product)
    def unslipped(expression, answer):
        entry = {"question": "q", "answer": answer, "metadata": {"expression": expression}}
        return next(t for s in range(50)
                    if not (t := trace_for("basic_arithmetic", entry, random.Random(s))).slipped)

    t = unslipped("( ( 18 + -21 ) + 98 )", "95")
    assert "\nNow: in ( ( 18 + -21 ) + 98 ), ( 18 + -21 ) is -3: ( -3 + 98 )\n" in t.thinking
    t = unslipped("4 - 9 * 2", "-14")
    assert "\nNow: in 4 - 9 * 2, 9 * 2 is 18: 4 - 18\n" in t.thinking


def test_leg_totals_are_added_by_name_and_the_check_compares_before_its_verdict():
    """v5's wrong leg traces dropped or repeated a total in the add chain (4 of 6) and called a
    check "right" that gave 54 against a total of 70. v6 lists the totals by animal, adds them
    by name, and writes both numbers before the verdict."""
    entry = {"question": "q", "answer": "70",
             "metadata": {"animals": {"cockroach": 5, "flatworm": 8, "cricket": 4, "cat": 4}}}
    for seed in range(40):
        t = trace_for("leg_counting", entry, random.Random(seed))
        assert "\nTotals: cockroachs 30, flatworms 0, crickets 24, cats 16.\nAdd: cockroachs 30, "\
            "+ flatworms 0: 30+0=" in t.thinking
        adds = t.thinking.split("\nAdd: ")[1].split("\n")[0]
        assert re.findall(r"\+ (\w+) \d+:", adds) == ["flatworms", "crickets", "cats"]
        assert "So 54+16=70." in t.thinking or t.slipped  # a slipped sum is redone below
        check = t.thinking.split("Check, adding from the last: ", 1)[1].split("\n", 1)[0]
        gives = int(check.split("The check gives ", 1)[1].split(",", 1)[0])
        assert check.endswith("the same, right.") == (gives == int(check.split("total is ")[1]
                                                                   .split(":")[0]))
        assert ("not the same, wrong" in check) == (t.slipped or t.check_slipped)
        if t.slipped:  # the redo is compared with the check as the first total was (v7)
            assert t.thinking.endswith(f"The check gives {gives}, the total is 70: the same, "
                                       "right.")
        assert "The answer is 70." in t.answer


def test_a_pair_sign_weighs_as_a_decision_whichever_it_is():
    """v4 weighted ``<`` and ``>`` as decisions but not ``=``; its chain_sum errors were then
    mostly equal digits written ``9>9``."""
    from sgl_reason.reasoner.train import _decision_chars

    text = "7 and 7: 7=7, 7-7=0; tens -1 and 9: -1<9, borrow"
    marked = _decision_chars(text)
    signs = [i for i, c in enumerate(text) if c in "=<" and marked[i]]
    assert [text[i] for i in signs] == ["=", "<"]  # the two pair signs, not the fact's "="
    assert not marked[text.index("7-7=") + 3]


def test_no_way_of_a_plan_weighs_more_than_another():
    """v10 weighted the ``right`` of "right to left" as a check's verdict, three times over
    ``left``, and its greedy took the way drawn for 38% of the chains on every chain."""
    from sgl_reason.reasoner.train import _decision_chars

    for way in ORDERS:
        plan = chain_plan(way)
        text = f"{plan}\nStart: 7 + 5 - 3\nCheck: 12 - 5 = 7, right."
        marked = _decision_chars(text)
        assert not any(marked[:len(plan)])
        verdict = text.rindex("right")
        assert all(marked[verdict:verdict + len("right")])  # a check's verdict still weighs


def test_held_out_questions_are_never_trained_on():
    held = {e["question"] for e in dataset("chain_sum", 20, seed=7_200_000)}
    traces = make_traces({"chain_sum": 20}, seed=7_200_000, exclude=held)
    assert traces == []


def test_seeds_reserved_for_evaluation_by_others_are_refused():
    with pytest.raises(ValueError, match="10,000,000"):
        dataset("chain_sum", 10, seed=MAX_SEED - 5)


def test_a_run_whose_seed_blocks_reach_the_held_out_seeds_is_refused():
    """v8's seed 4,800,000 put gsm_symbolic's block (third by name) at 5,000,000: all 60 of its
    questions were held-out ones, so none was trained, and nothing said so."""
    from sgl_reason.reasoner.train import TrainConfig

    counts = {"chain_sum": 1200, "basic_arithmetic": 2200, "leg_counting": 900, "gsm_symbolic": 60}
    with pytest.raises(ValueError, match=r"gsm_symbolic's training seeds 5,000,000\.\.5,000,059 "
                                         r"reach the held-out seeds.*pass a --seed"):
        family_seeds(counts, 4_800_000)
    with pytest.raises(ValueError, match="leg_counting's training seeds"):
        TrainConfig(counts=counts, seed=HELD_OUT_SEED - 300_000)  # the last block reaches it
    assert family_seeds(counts, 4_500_000)["leg_counting"] == 4_800_000  # ends below: fine
    assert family_seeds(counts, 5_000_200)["basic_arithmetic"] == 5_000_200  # starts above


@pytest.mark.slow
def test_training_resumes_from_its_checkpoint_and_ships_a_small_adapter(tmp_path):
    """Two steps, interrupted after the first: the rerun continues at step 2 (no step twice)."""
    import json

    from sgl_reason import model
    from sgl_reason.reasoner.train import ADAPTER_FILE, TrainConfig, train

    base = model.default_model_path()
    if not model.is_prepared(base):
        pytest.skip("run `sgl-reason model prepare` first")
    config = TrainConfig(counts={"chain_sum": 4, "leg_counting": 4}, batch_size=4, rank=4,
                         alpha=8, checkpoint_every=1, max_len=1024)
    assert train(base, tmp_path, config, progress=False, max_steps=1) is None
    assert not (tmp_path / "adapter").exists()
    stats = train(base, tmp_path, config, progress=False)
    log = [json.loads(line) for line in (tmp_path / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, stats["steps"] + 1)) and stats["steps"] == 2
    weights = tmp_path / "adapter" / ADAPTER_FILE
    # LoRA rank 4 in bf16 (2.4 MB) and two marker rows, never the 57 MB embedding
    assert weights.stat().st_size < 4 << 20
    assert (tmp_path / "loss.png").stat().st_size > 0


@pytest.mark.slow
def test_the_chunked_loss_matches_the_loss_over_full_logits():
    """A step computes the head only on trained positions, in chunks recomputed in backward
    (it never holds the batch's full logits): same loss, same gradients, the marker rows
    included, as the model's own logits give. The model runs in float64 (the cross-entropy
    in fp32, as in training): in bf16, a matmul over a different number of rows rounds
    differently, and the LoRA gradients at their zero start cancel enough to show it."""
    import contextlib

    import torch
    import torch.nn.functional as F

    from sgl_reason import model
    from sgl_reason.reasoner.train import TrainConfig, _collate, _step_losses, build_model, encode

    base = model.default_model_path()
    if not model.is_prepared(base):
        pytest.skip("run `sgl-reason model prepare` first")
    config = TrainConfig(counts={"chain_sum": 2, "leg_counting": 1}, rank=4, alpha=8)
    tokenizer, peft_model, _ = build_model(base, config)
    peft_model.double()
    examples = [encode(tokenizer, t, 3.0) for t in make_traces(config.counts, 7_700_000)]
    ids, labels, weights, mask = (t[:, :192] for t in  # float64 logits: keep them small
                                  _collate(examples, [0, 1, 2], tokenizer.pad_token_id))
    params = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}

    def grads(weighted):
        weighted.backward()
        out = {n: p.grad.clone() for n, p in params.items()}
        peft_model.zero_grad(set_to_none=True)
        return out

    logits = peft_model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                         reduction="none").view_as(logits[..., 0])
    trained = labels[:, 1:] != -100
    w = weights[:, 1:] * trained
    full_weighted, full_plain = (ce * w).sum() / w.sum(), ce[trained].mean()
    full = grads(full_weighted)
    weighted, plain = _step_losses(peft_model, ids, mask, labels, weights,
                                   contextlib.nullcontext(), chunk=100)
    assert int(trained.sum()) % 100 and int(trained.sum()) > 200  # chunks, the last partial
    assert weighted.item() == pytest.approx(full_weighted.item(), rel=1e-6)
    assert plain.item() == pytest.approx(full_plain.item(), rel=1e-6)
    chunked = grads(weighted)
    assert any("trainable_tokens" in n for n in chunked)
    for n, g in chunked.items():
        assert (g - full[n]).norm() <= 1e-5 * full[n].norm() + 1e-15, n


def test_a_batch_of_long_traces_holds_fewer_of_them():
    """8 traces of 1,280 tokens ran the 24 GiB machine out of memory (every layer's
    activations are kept for backward): a batch is capped in tokens, padding included, and
    batches of short traces are the ones the v2-v4 runs trained on."""
    from sgl_reason.reasoner.train import _batches

    examples = [([0] * n,) for n in [120] * 50 + [700] * 20 + [1280] * 13]
    batches = _batches(examples, 8, random.Random(1), max_tokens=8 * 768)
    assert sorted(i for b in batches for i in b) == list(range(len(examples)))
    assert all(len(b) <= 8 and len(b) * max(len(examples[i][0]) for i in b) <= 8 * 768
               for b in batches)
    assert max(len(b) for b in batches if any(len(examples[i][0]) == 1280 for i in b)) == 4
    short = [([0] * n,) for n in range(100, 700, 3)]
    assert _batches(short, 8, random.Random(2)) == _batches(short, 8, random.Random(2), 8 * 768)


def test_a_problem_is_worked_in_several_ways_named_in_the_plan():
    """v8: samples of one problem should take different paths, so that one path's systematic
    error is outvoted. A flat chain is summed from its left or (v10) its right end, never
    copied in a new order; other expressions put a product's first or second number on top.
    Every way reaches the gold answer."""
    entry = {"question": "q", "answer": "160", "metadata": {"expression": "74 + 50 - 47 + 83"}}
    seen = {}
    for seed in range(40):
        t = trace_for("chain_sum", entry, random.Random(seed))
        seen[t.thinking.splitlines()[0]] = t.thinking
    assert sorted(seen) == sorted(f"Plan: {o}, one operation a step, then check each step "
                                  "backwards." for o in ORDERS.values())
    right = seen["Plan: right to left, the last two terms first, one operation a step, then "
                 "check each step backwards."]
    assert "Terms:" not in right
    assert ("\nStep 1: -47 + 83. -47+83 is 83-47: ") in right
    assert "\nNow: in 74 + 50 - 47 + 83, - 47 + 83 is + 36: 74 + 50 + 36\nStep 2: 50 + 36." in right
    assert "\nNow: in 74 + 50 + 36, + 50 + 36 is + 86: 74 + 86\nStep 3: 74 + 86." in right
    # a subtracted negative term keeps its sign: - -1 + -7 is 1 + -7, so - 6
    entry = {"question": "q", "answer": "-4", "metadata": {"expression": "2 + 0 - -1 + -7"}}
    ways = {trace_for("basic_arithmetic", entry, random.Random(s)).thinking
            for s in range(40)}
    assert any("Step 1: 1 + -7." in w and "- -1 + -7 is - 6: 2 + 0 - 6\n" in w for w in ways)
    assert any(w.startswith("Plan: left to right") for w in ways)
    # a product: the first number times the second's digits, or the other way round
    assert arith.work(94, "*", 28).text.startswith(
        "94 is tens 9, ones 4; 28 is tens 2, ones 8: 2 rows. row 1 of 2, ones 8: 94*8:")
    second = arith.work(94, "*", 28, second_on_top=True)
    assert second.value == 2632 and "row 1 of 2, ones 4: 28*4:" in second.text
    assert second.text.endswith("so 28*94=2632")
    # never 1 digit on top
    one_digit = arith.work(7, "*", 28, second_on_top=True).text
    assert "7 is ones 7: 1 row. row 1 of 1, ones 7: 28*7" in one_digit
    entry = {"question": "q", "answer": "2668", "metadata": {"expression": "94 * 28 + 89 + -53"}}
    plans = {trace_for("basic_arithmetic", entry, random.Random(s)).thinking.splitlines()[0]
             for s in range(20)}
    assert {p.split("product's ")[1].split(" number")[0] for p in plans} == {"first", "second"}


def test_a_products_rows_follow_its_numbers_digits():
    """v11's wrong greedy products wrote rows from the template (one row for 18 * 71, the
    same row twice for 80 * 9). The numbers are spelled by place, the rows counted, and each
    row names its number among them (v12, which named only the place, repeated the last row),
    its place and digit, so the trace writes as many rows as the number has digits."""
    one = arith.work(80, "*", -9).text
    assert one == ("the sign is negative; 80 is tens 8, ones 0; 9 is ones 9: 1 row. "
                   "row 1 of 1, ones 9: 80*9: ones 0*9=0; tens 8*9=72, 2 carry 7; hundreds 7; "
                   "read hundreds 7, tens 2, ones 0. So 80*9=720, so -720")
    two = arith.work(18, "*", 71)
    assert two.value == 1278 and two.text.startswith(
        "18 is tens 1, ones 8; 71 is tens 7, ones 1: 2 rows. "
        "row 1 of 2, ones 1: 18*1=18; row 2 of 2, tens 7: 18*7:")
    rng = random.Random(3)
    for _ in range(300):
        a, b = rng.randint(0, 9999), rng.randint(0, 99)
        w = arith.work(a, "*", b, second_on_top=rng.random() < 0.5)
        assert w.value == a * b
        if max(a, b) >= 10 and min(a, b) > 1:  # worked in columns, not one fact
            rows = re.findall(r"(?:\. |; )row (\d) of (\d), ([a-z-]+) (\d): ", w.text)
            top, by = re.match(r"(\d+) is .*?; (\d+) is ", w.text).groups()
            assert {int(top), int(by)} == {a, b}
            assert [(int(k), int(n)) for k, n, _, _ in rows] == [
                (k, len(by)) for k in range(1, len(by) + 1)]
            assert [d for _, _, _, d in rows] == list(reversed(by))
            assert [p for _, _, p, _ in rows] == [arith.PLACES[i] for i in range(len(by))]


def test_the_most_reliable_chain_way_is_the_most_frequent():
    """v9: greedy takes the way whose plan token is likeliest, so the way it should take (left
    to right) is trained most often; the other still comes up, for samples to explore."""
    from collections import Counter

    entry = {"question": "q", "answer": "160", "metadata": {"expression": "74 + 50 - 47 + 83"}}

    def way(seed: int) -> str:
        plan = trace_for("chain_sum", entry, random.Random(seed)).thinking.splitlines()[0]
        return next(o for o, text in ORDERS.items() if plan.startswith(f"Plan: {text},"))

    ways = Counter(way(s) for s in range(600))
    assert ways.most_common(1)[0][0] == "left"
    for order, weight in ORDER_WEIGHTS.items():
        assert abs(ways[order] / 600 - weight) < 0.06
