"""Benchmarks behind ``sgl-reason bench``: each runs its baseline in the same process and run."""

from __future__ import annotations

import json
from pathlib import Path


def publish(report: dict, text: str, path: str | None) -> None:
    """Print a bench's table and, with ``--json PATH``, write its report there."""
    print(text)
    if path:
        Path(path).write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")
