"""Freed columns: which columns of a live ``req_to_token`` row went back to the allocator.

A release frees a set of a row's columns (not necessarily contiguous: scored retention keeps
the best-scored tokens between them). The row keeps its length, so RoPE positions and every
SGLang length stay on the logical token count; each freed column is pointed at slot 0, SGLang's
padding slot, which is never allocated or freed.

Contract of :class:`FreedColumns`:

- a column is recorded only after its slot was freed, and is never freed again: every row free
  goes through :meth:`FreedColumns.subtract` (``ThinkingKVCache.free_kv_row``);
- records live exactly as long as the row: :meth:`FreedColumns.forget` at the row's release
  (finish, abort, retraction); a record is keyed by the row's lane (``req_pool_idx``) and holds
  its ``ReqKvInfo``, and every lookup checks that record still holds that lane;
- readers (decode attention, the KV window, pool accounting) see a sorted int64 tensor.
"""

from __future__ import annotations

import torch


def runs(columns: torch.Tensor) -> list[tuple[int, int]]:
    """Sorted distinct columns as ascending half-open runs: [3, 4, 5, 9] -> [(3, 6), (9, 10)]."""
    if columns.numel() == 0:
        return []
    cols = columns.tolist()
    out, start, prev = [], cols[0], cols[0]
    for c in cols[1:]:
        if c != prev + 1:
            out.append((start, prev + 1))
            start = c
        prev = c
    out.append((start, prev + 1))
    return out


class FreedColumns:
    """Per live row (keyed by its ``req_pool_idx``, the lane), the sorted columns already freed
    (module docstring)."""

    def __init__(self):
        self._rows: dict[int, tuple[object, torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self._rows)

    def of(self, kv) -> torch.Tensor | None:
        """The freed columns of the row ``kv`` (a ReqKvInfo) holds, if any."""
        entry = self._rows.get(kv.req_pool_idx)
        return entry[1] if entry is not None and entry[0] is kv else None

    def of_lane(self, lane: int) -> torch.Tensor | None:
        """The freed columns of request-pool row ``lane`` (what the attention backend sees)."""
        entry = self._rows.get(lane)
        return entry[1] if entry is not None and entry[0].req_pool_idx == lane else None

    def count(self, kv) -> int:
        cols = self.of(kv)
        return 0 if cols is None else int(cols.numel())

    def add(self, kv, columns: torch.Tensor) -> None:
        """Record newly freed columns (disjoint from those already recorded: ValueError)."""
        old = self.of(kv)
        if old is not None:
            if bool(torch.isin(columns, old).any()):
                raise ValueError("sgl-reason: a thinking-KV column would be freed twice")
            columns = torch.cat([old, columns])
        self._rows[kv.req_pool_idx] = (kv, torch.sort(columns).values)

    def forget(self, kv, lane: int | None) -> None:
        """The row ``kv`` held at ``lane`` is gone (taken before SGLang clears the lane)."""
        entry = self._rows.get(lane)
        if entry is not None and entry[0] is kv:
            del self._rows[lane]

    def subtract(self, kv, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``ranges`` (ascending, disjoint, half-open) less this row's freed columns."""
        cols = self.of(kv)
        if cols is None:
            return ranges
        out = []
        for start, end in ranges:
            inside = cols[(cols >= start) & (cols < end)]
            if inside.numel() == 0:
                out.append((start, end))
                continue
            keep = torch.ones(end - start, dtype=torch.bool)
            keep[inside - start] = False
            out += [(start + a, start + b) for a, b in runs(torch.nonzero(keep).flatten())]
        return out


def close_rows(rows: torch.Tensor, seq_lens: list[int], freed: list[torch.Tensor | None]
               ) -> tuple[torch.Tensor, list[int]]:
    """Rows without their freed columns, the rest shifted left; the new lengths.

    Attention is a sum over keys whose positions RoPE fixed when they were written, so reading
    a row without its freed columns is exact; the query keeps its logical position."""
    rows, seq_lens = rows.clone(), list(seq_lens)
    for i, cols in enumerate(freed):
        if cols is None or cols.numel() == 0:
            continue
        n = seq_lens[i]
        keep = torch.ones(n, dtype=torch.bool)
        keep[cols[cols < n]] = False
        kept = rows[i, :n][keep]
        rows[i, :kept.numel()] = kept
        seq_lens[i] = int(kept.numel())
    return rows, seq_lens


def freed_mask(freed: list[torch.Tensor | None], width: int) -> torch.Tensor:
    """[B, width] bool: True at each request's freed columns."""
    mask = torch.zeros(len(freed), width, dtype=torch.bool)
    for i, cols in enumerate(freed):
        if cols is not None and cols.numel():
            mask[i, cols[cols < width]] = True
    return mask
