"""`sgl-reason bench early-stop` on the real server, at a size a test can afford."""

from __future__ import annotations

import pytest

from sgl_reason.bench import early_stop as bench


@pytest.mark.server
def test_bench_rows_and_the_half_budget_baseline(runtime):
    problems = bench.problem_set(datasets=("basic_arithmetic",), limit=2)
    report = bench.run(runtime.endpoint, problems, budget=32, chunk=16, answer_tokens=16,
                       concurrency=1, rows=("probe", "half_budget"))
    full, half = report["full"], report["signals"]["half_budget"]
    # EOS is masked in thinking: every problem thinks its whole budget, in chunks of 16, and
    # the blind cut thinks half the median of that
    assert full["thinking_tokens"] == 32 and full["median_thinking_tokens"] == 32
    assert half["thinking_tokens"] == 16 and half["thinking_budget"] == 16
    assert half["tokens"] < full["tokens"]
    assert half["tokens_saved"] == round(1 - half["tokens"] / full["tokens"], 4)
    assert set(report["signals"]) == {"half_budget", "probe"}  # only the rows asked for
    assert "self_consistency_full" not in report
    probe = report["signals"]["probe"]
    # with a 32-token budget only the chunk at 16 is probed: two equal probes never happen, so
    # the probe row spends the full row's tokens plus its probe's
    assert probe["stopped_early"] == 0 and probe["tokens"] > full["tokens"]
    assert probe["agreement_with_full"] == 1.0
    assert "half_budget" in bench.table(report)


def test_problem_sets_per_family(tmp_path):
    """--limit is per family; the reasoner's families get its generator config."""
    problems = bench.problem_set(datasets=("chain_sum", "leg_counting"), limit=3, seed=6_000_000)
    assert [p.family for p in problems] == ["chain_sum"] * 3 + ["leg_counting"] * 3
    assert all(3 <= p.question.count(" + ") + p.question.count(" - ") + 1 <= 5
               for p in problems[:3])  # the reasoner's chain_sum: 3 to 5 terms
    data = tmp_path / "p.jsonl"
    data.write_text("".join(f'{{"question": "q{i}", "answer": "{i}", "family": "{f}"}}\n'
                            for i, f in enumerate("aabbb")))
    assert [p.gold for p in bench.problem_set(str(data), limit=2)] == ["0", "1", "2", "3"]
    assert [p.gold for p in bench.problem_set(str(data), limit=5, families=("b",))] == ["2", "3", "4"]
    with pytest.raises(ValueError, match="no problem of the families c"):
        bench.problem_set(str(data), families=("c",))


def test_unknown_rows_name_the_choices():
    with pytest.raises(ValueError, match="unknown bench row.*vibes.*choose from half_budget"):
        bench.check_rows(["probe", "vibes"])
    with pytest.raises(ValueError, match="no bench rows given"):
        bench.check_rows([])
    assert bench.check_rows(["consensus", "probe"]) == ("probe", "consensus")  # bench order
