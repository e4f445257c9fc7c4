"""Scores for scored retention: how much the end of a request's thinking attends to each token.

While a scored request (``Policy.scored``) thinks, every decode step records, for each column of
its row, the attention probability its query paid to that column, aggregated over heads and
layers (``Policy.score``: ``mean`` or ``max``). The last ``Policy.observe`` steps are kept
(including the step that reads the end marker, one step after it is generated); at release,
their sum is the column's score (SnapKV's observation window; Think Clearly's end-of-thinking
attention when ``observe`` is 1). A request whose thinking and marker come in its prompt (the
declared route) is observed inside its prefill instead: the same query rows, several per
forward (:func:`observe_extend`).

Contract of :class:`ScoreBook`: the scheduler calls :meth:`ScoreBook.begin_step` once per
forward that observes the request, before it (``ForwardBatch.init_new`` hook); the attention
calls :meth:`ScoreBook.add` once per layer during it, and release reads
:meth:`ScoreBook.scores` after it. All in the scheduler process; nothing here is shared
between requests.
"""

from __future__ import annotations

from collections import deque

import torch


class ScoreBook:
    """One request's attention, per column, over its last ``observe`` decode steps."""

    def __init__(self, observe: int, reduce: str):
        self.reduce = reduce
        self.steps: deque[torch.Tensor] = deque(maxlen=observe)
        self.current: torch.Tensor | None = None  # [rows, columns] of the open forward
        self.rows: tuple[int, int] | None = None  # an extend's observed query positions
        self.layers = 0

    def begin_step(self, length: int, rows: tuple[int, int] | None = None) -> None:
        """A new forward: one decode query reading ``length`` columns, or (``rows``) the
        extend query positions ``[lo, hi)``, each reading up to ``length`` columns."""
        self._close()
        n = 1 if rows is None else rows[1] - rows[0]
        self.current = torch.zeros(n, length, dtype=torch.float32)
        self.rows = rows

    def add(self, probs: torch.Tensor, offset: int) -> None:
        """One layer's head-aggregated probabilities, ``[n]`` (decode) or ``[rows, n]``
        (extend), for columns ``[offset, offset + n)``."""
        cur = self.current
        if cur is None:
            return
        probs = probs.reshape(cur.shape[0], -1)
        n = min(probs.shape[1], cur.shape[1] - offset)
        if n <= 0:
            return
        part = cur[:, offset:offset + n]
        if self.reduce == "max":
            torch.maximum(part, probs[:, :n], out=part)
        else:
            part += probs[:, :n]
        self.layers += 1

    def _close(self) -> None:
        if self.current is not None and self.layers:
            self.steps.extend(self.current.unbind(0))  # one step per query row
        self.current, self.rows, self.layers = None, None, 0

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


def observe_extend(plan_scoring, query: torch.Tensor, keys, q_starts: list[int],
                   prefixes: list[int], scale: float) -> None:
    """Give each observed request of an extend its query rows' probabilities over its row.

    ``plan_scoring``: (batch positions, books), each book's ``rows`` the absolute positions to
    observe (inside this extend); ``query`` [new tokens, Hq, D]; ``keys(b)`` -> the request's
    row keys [kv, Hkv, D] (fp32, new tokens written); ``q_starts[b]``: the request's first row
    in ``query``; ``prefixes[b]``: its extend's first position. Causal: a row at position p
    reads columns ``<= p``; the softmax is over the request's whole row, as the extend's own."""
    positions, books = plan_scoring
    for b, book in zip(positions.tolist(), books):
        if book.rows is None:
            continue
        lo, hi = book.rows
        first = q_starts[b] + lo - prefixes[b]
        q = query[first:first + hi - lo].float()  # [r, Hq, D]
        k = keys(b)  # [kv, Hkv, D]
        r, hq, d = q.shape
        hkv = k.shape[1]
        logits = torch.einsum("rkgd,ckd->rkgc", q.view(r, hkv, hq // hkv, d), k) * scale
        future = torch.arange(k.shape[0]).unsqueeze(0) > torch.arange(lo, hi).unsqueeze(1)
        logits.masked_fill_(future[:, None, None, :], float("-inf"))
        book.add(head_reduce(torch.softmax(logits, dim=-1), book.reduce), 0)


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
