"""Test session setup: offline, and one embedded SGLang server per model, each started once and
shared by the tests that need it (SmolLM2 for mechanics, the tiny reasoner where a test needs a
model that reasons)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _as_installed_warnings():
    """pytest resets warning filters per test: put back the one sgl_reason installs on import,
    so a test sees the warnings a user would."""
    from sgl_reason.backend import quiet_cancelled_programs

    quiet_cancelled_programs()


@pytest.fixture(scope="session")
def runtime():
    """The real SGLang server on the prepared default model, started once per test session."""
    from sgl_reason import EmbeddedRuntime

    with EmbeddedRuntime() as rt:
        yield rt
    assert rt.server.group_pids() == [], "the session server left processes behind"


# strict memory checks: a leaked or double-freed KV slot fails the server
STRICT_MEMORY = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
                 "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}


@pytest.fixture(scope="session")
def reasoner():
    """The real SGLang server on sgl-reason's tiny reasoner (thinking-KV metrics on), started
    once per test session."""
    from sgl_reason import EmbeddedRuntime

    with EmbeddedRuntime(model="reasoner", env=STRICT_MEMORY,
                         extra_args=["--thinking-kv-policy", "keep", "--enable-metrics"]) as rt:
        yield rt
    assert rt.server.group_pids() == [], "the reasoner server left processes behind"


@pytest.fixture
def fresh_cache(runtime):
    """Flush the server's radix cache so a test's cached_tokens count only its own reuse."""
    runtime.flush_cache()
    return runtime
