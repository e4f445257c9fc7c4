"""Test session setup: offline, and ONE embedded SGLang server shared by all server tests."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def runtime():
    """The real SGLang server on the prepared default model, started once per test session."""
    from sgl_reason import EmbeddedRuntime

    with EmbeddedRuntime() as rt:
        yield rt
    assert rt.server.group_pids() == [], "the session server left processes behind"


@pytest.fixture
def fresh_cache(runtime):
    """Flush the server's radix cache so a test's cached_tokens count only its own reuse."""
    runtime.flush_cache()
    return runtime
