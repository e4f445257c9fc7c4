"""`sgl-reason bench early-stop` on the real server, at a size a test can afford."""

from __future__ import annotations

import pytest

from sgl_reason.bench import early_stop as bench


@pytest.mark.server
def test_bench_rows_and_the_half_budget_baseline(runtime):
    report = bench.run(runtime.endpoint, limit=2, budget=32, chunk=16, rows=("probe", "half_budget"))
    full, half = report["full"], report["baselines"]["half_budget"]
    # EOS is masked in thinking: every problem thinks its whole budget, in chunks of 16
    assert full["thinking_tokens"] == 32 and half["thinking_tokens"] == 16
    assert half["thinking_budget"] == 16 and half["tokens"] < full["tokens"]
    assert half["tokens_saved"] == round(1 - half["tokens"] / full["tokens"], 4)
    assert set(report["signals"]) == {"probe"}  # only the rows asked for, full always
    assert "self_consistency_full" not in report
    probe = report["signals"]["probe"]
    # with a 32-token budget only the chunk at 16 is probed: two equal probes never happen, so
    # the probe row spends the full row's tokens plus its probe's
    assert probe["stopped_early"] == 0 and probe["tokens"] > full["tokens"]
    assert probe["agreement_with_full"] == 1.0
    assert "half_budget" in bench.table(report)


def test_unknown_rows_name_the_choices():
    with pytest.raises(ValueError, match="unknown bench row.*vibes.*choose from half_budget"):
        bench.check_rows(["probe", "vibes"])
    with pytest.raises(ValueError, match="no bench rows given"):
        bench.check_rows([])
    assert bench.check_rows(["consensus", "probe"]) == ("probe", "consensus")  # bench order
