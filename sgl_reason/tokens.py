"""Finding a run of token ids in generated output.

Markers (end of thinking, a forced close) are matched on the ids the model really emitted,
never on decoded text: a tokenizer merges the text around a marker into other tokens, so the
same text can be different ids, and a special marker token is one id whatever surrounds it.
The budget processor, the thinking-KV cache and the think-then-answer program share this one
search so that they agree on where a marker is.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_tokens(ids: Sequence[int], run: Sequence[int], start: int = 0) -> int:
    """The index of the first ``run`` in ``ids`` at or after ``start``, or -1."""
    run, start = list(run), max(0, start)
    tail, n = list(ids[start:]), len(run)
    for i in range(len(tail) - n + 1):
        if tail[i:i + n] == run:
            return start + i
    return -1


def find_new_tokens(ids: Sequence[int], run: Sequence[int], scanned: int) -> tuple[int, int]:
    """``find_tokens`` over what grew since a search that saw ``scanned`` ids: a run that ends
    in the new ids may start up to ``len(run) - 1`` ids before them. Returns the index (or -1)
    and the count of ids now scanned, for the next call. Output can grow by several ids between
    two calls (an overlap scheduler step, a retraction's replay), so the run is not always last."""
    return find_tokens(ids, run, scanned - len(run) + 1), len(ids)
