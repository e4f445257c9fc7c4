"""The notebooks execute top to bottom against the session's embedded servers: the reasoner's
for those about reasoning, SmolLM2's for the KV-memory one (fixed-shape requests)."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
ON_SMOLLM2 = {"03_kv_memory_over_time"}
# starts two servers of its own (thinking-KV, FP8): ~110 s, so `make test-all` runs it, CI not;
# what it plots is tested on its own in tests/runtime and tests/programs
EXTENDED = {"03_kv_memory_over_time"}

pytestmark = pytest.mark.server


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.extended) if p.stem in EXTENDED else p for p in NOTEBOOKS],
    ids=lambda p: p.stem)
def test_notebook_runs(path, request, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    server = request.getfixturevalue("runtime" if path.stem in ON_SMOLLM2 else "reasoner")
    monkeypatch.setenv("SGL_REASON_URL", server.url)  # the kernel inherits it
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in notebook.cells if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []
