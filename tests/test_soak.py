"""The soak's short version: 80 mixed requests (40 per row, 16-bit and FP8 per-token KV) with
aborts, disconnects and hostile bodies on a small pool; nothing leaked, nothing unaccounted.
Light generations (CI's 40 minutes: the full soak's long ones made 80 requests take 420 s)."""

from __future__ import annotations

import pytest

from sgl_reason.bench.soak import EXPECTED, run

pytestmark = [pytest.mark.server, pytest.mark.extended]


def test_a_short_soak_accounts_for_every_request_and_slot():
    report = run(requests_n=80, concurrency=12, pool=2048, seed=1, light=True)
    assert report["requests"] == 80
    for name, row in report["rows"].items():
        assert row["leaked_slots"] == 0, (name, row)
        assert row["queued_after"] == 0, (name, row)
        assert row["server_errors"] == 0, (name, row["server_error_samples"])
        assert row["unaccounted"] == 0, (name, row["unaccounted_samples"])
        assert row["serves_after"] and row["stray_processes"] == 0, (name, row)
    kinds = {k.split(":")[0] for k in report["outcomes"]}
    assert kinds >= set(EXPECTED) - {"natural"} | {"hostile"}  # the mix reached every kind
    assert report["aborts"] > 0
