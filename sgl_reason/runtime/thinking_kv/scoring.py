"""Scores for scored retention: how much the end of a request's thinking attends to each token.

While a scored request (``Policy.scored``) thinks, every decode step records, for each column of
its row, the attention probability its query paid to that column, aggregated over heads and
layers (``Policy.score``: ``mean`` or ``max``). The last ``Policy.observe`` steps are kept
(including the step that reads the end marker, one step after it is generated); at release,
their sum is the column's score (SnapKV's observation window; Think Clearly's end-of-thinking
attention when ``observe`` is 1).

Contract of :class:`ScoreBook`: the scheduler calls :meth:`ScoreBook.begin_step` once per
decode step before the forward (``ForwardBatch.init_new`` hook), the attention calls
:meth:`ScoreBook.add` once per layer during it, and release reads :meth:`ScoreBook.scores`
after it. All in the scheduler process; nothing here is shared between requests.
"""

from __future__ import annotations

from collections import deque

import torch


class ScoreBook:
    """One request's attention, per column, over its last ``observe`` decode steps."""

    def __init__(self, observe: int, reduce: str):
        self.reduce = reduce
        self.steps: deque[torch.Tensor] = deque(maxlen=observe)
        self.current: torch.Tensor | None = None
        self.layers = 0

    def begin_step(self, length: int) -> None:
        """A new decode step whose query reads ``length`` columns."""
        self._close()
        self.current = torch.zeros(length, dtype=torch.float32)

    def add(self, probs: torch.Tensor, offset: int) -> None:
        """One layer's head-aggregated probabilities for columns ``[offset, offset + n)``."""
        cur = self.current
        if cur is None:
            return
        n = min(probs.numel(), cur.numel() - offset)
        if n <= 0:
            return
        part = cur[offset:offset + n]
        if self.reduce == "max":
            torch.maximum(part, probs[:n], out=part)
        else:
            part += probs[:n]
        self.layers += 1

    def _close(self) -> None:
        if self.current is not None and self.layers:
            self.steps.append(self.current)
        self.current, self.layers = None, 0

    def scores(self, length: int) -> torch.Tensor | None:
        """Summed scores of the observed steps over ``length`` columns (None: nothing seen)."""
        self._close()
        if not self.steps:
            return None
        out = torch.zeros(length, dtype=torch.float32)
        for step in self.steps:
            n = min(length, step.numel())
            out[:n] += step[:n]
        return out


def head_reduce(probs: torch.Tensor, reduce: str) -> torch.Tensor:
    """[B, Hkv, rep, L] attention probabilities -> [B, L], over every query head."""
    flat = probs.flatten(1, 2)
    return flat.amax(dim=1) if reduce == "max" else flat.mean(dim=1)


def record(plan_scoring, e: torch.Tensor, m_suffix: torch.Tensor, m: torch.Tensor,
           l: torch.Tensor, shared: list[int], lengths: torch.Tensor) -> None:
    """Give each scored request of a decode batch its probabilities over its own suffix.

    ``plan_scoring``: (batch positions, books); ``e``: the suffix's unnormalized
    ``exp(score - m_suffix)`` [B, Hkv, rep, W]; ``m``/``l``: the merged softmax max and sum
    (suffix and shared prefix), so ``e * exp(m_suffix - m) / l`` are the true probabilities.
    Columns of a shared prefix are tree-owned and never released, so they are not scored."""
    positions, books = plan_scoring
    p = e[positions] * torch.exp(m_suffix[positions] - m[positions]) / l[positions]
    for reduce in {b.reduce for b in books}:
        agg = head_reduce(p, reduce)
        for j, book in enumerate(books):
            if book.reduce == reduce:
                b = int(positions[j])
                book.add(agg[j, :int(lengths[b])], shared[b])
