"""The radix cache backend ``sgl-reason``: SGLang's UnifiedRadixCache plus the policies.

| policy              | while the request runs                  | at finish                      |
|---------------------|-----------------------------------------|--------------------------------|
| ``keep``            | stock SGLang                            | stock: the whole sequence is inserted into the tree |
| ``strip``           | stock                                   | only the prompt stays in the tree; thinking and answer KV are freed |
| ``demote``          | stock                                   | inserted, but everything after the prompt is evicted before any other node |
| ``release-on-answer``| once the end marker is generated, its thinking KV goes back to the allocator, but the sink, the window and (scored retention) the best-scored tokens | the rest is freed; nothing after the prompt enters the tree |

Release (``after_decode``, hooked after ``Scheduler.process_batch_result``, once per row):

| event                                    | window-only rule        | scored retention (``keep``)              |
|------------------------------------------|-------------------------|------------------------------------------|
| marker generated (output index m)        | release now             | one more step: the marker's query is observed |
| release                                  | free ``release_span``   | free ``release_span`` less its K best-scored columns |

Declared route (the answer request of the two-request and chunked routes, whose prompt holds
the thinking and the marker, ``custom_params.thinking_start``): its prefix match stops at the
thinking (:meth:`cap_prefix`), so the thinking is prefilled into the request's own columns and
observed inside that prefill; its prefill enters the tree only up to the thinking
(:meth:`checkpoint_into_tree`); it is released after its first decode step, like a generated
marker. The cost is one prefill of the thinking.

Every path that frees a row range subtracts the row's freed columns (:meth:`free_kv_row`), so
no slot is freed twice; a released row is barred from the tree (``skip_radix_cache_insert``:
it is no longer a valid key), its prompt having entered at prefill. A retracted request comes
back on a whole row, its re-prefill observed where it covers the marker, and is released again.
"""

from __future__ import annotations

import logging
import os

import torch

from sgl_reason.runtime.thinking_kv.columns import FreedColumns, runs
from sgl_reason.runtime.thinking_kv.launch import check_window, release_supported, think_end_for
from sgl_reason.runtime.thinking_kv.metrics import Metrics
from sgl_reason.runtime.thinking_kv.policy import Policy, ReqState, columns_to_free, state
from sgl_reason.runtime.thinking_kv.scoring import ScoreBook
from sgl_reason.tokens import find_new_tokens

logger = logging.getLogger(__name__)

# A node priority below any a request can carry (SGLang's default is 0, prompts get +1).
DEMOTED_PRIORITY = -(1 << 62)

_CACHE = None  # the scheduler process's ThinkingKVCache, once built
# Diagnostic (tests): slot 0, where freed columns point, gets NaN keys and huge values, so
# any read of a freed column turns the output into NaN. Padding reads are masked before V.
POISON_ENV = "SGL_REASON_POISON_PADDING_SLOT"


def current():
    """This process's thinking-KV cache, or None (another backend, or not a scheduler)."""
    return _CACHE


def cache_class():
    """The radix cache subclass (built on first use: it derives from SGLang's UnifiedRadixCache)."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    class ThinkingKVCache(UnifiedRadixCache):
        """UnifiedRadixCache that applies the thinking-KV policies (module docstring)."""

        def setup(self, policy: Policy, marker_ids: list[int], metrics: Metrics,
                  release_problems: list[str], demote_ok: bool):
            self.policy, self.marker_ids, self.metrics = policy, marker_ids, metrics
            # why this server cannot release (launch.release_supported; empty: it can)
            self.release_problems, self.release_ok = release_problems, not release_problems
            self.demote_ok = demote_ok
            self.held: dict[str, tuple[int, int]] = {}  # rid -> (thinking, answer) KV held
            self.freed = FreedColumns()
            self.step_books: dict[int, object] = {}  # lane -> ScoreBook observed this forward
            self._told_scored: set[bool] = set()  # routes (declared or not) whose first scored
            # release was logged, with what its scores came from

        # -- requests come and go --------------------------------------------------------------
        def claim_kv_row(self, req) -> bool:
            st = state(req)
            if st is not None and req.finished() and st.policy.name == "strip":
                req.skip_radix_cache_insert = True  # the prompt is in the tree since prefill
            return super().claim_kv_row(req)

        def cap_prefix(self, req, limit: int) -> int:
            """How much of a request's prompt its prefix match may cover: a releasing request
            matches no further than its thinking, which must sit in its own columns to be
            released (SGLang's ``Req._compute_max_prefix_len``)."""
            st = state(req)
            if st is not None and st.policy.releases and self.release_ok:
                return min(limit, st.think_from)
            return limit

        def checkpoint_into_tree(self, req, *, up_to: int, **kwargs) -> None:
            st = state(req)
            if st is not None and st.policy.releases and self.release_ok and not req.finished():
                # a running releasing request's thinking stays its own (a finished one that
                # released nothing is inserted whole; one that did is barred from the tree)
                up_to = max(min(up_to, st.think_from), req.kv.cache_protected_len)
            if not (st is not None and st.policy.name == "demote" and req.finished()):
                return super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
            # New nodes take the insert's priority, existing ones keep the max of theirs: the
            # prompt (inserted at prefill) keeps its own, what follows it is demoted.
            stock = req.priority
            req.priority = DEMOTED_PRIORITY
            try:
                super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
            finally:
                req.priority = stock

        def free_kv_row(self, kv, ranges: list[tuple[int, int]]) -> None:
            """Free row ranges, minus the row's freed columns (already freed)."""
            ranges = self.freed.subtract(kv, ranges)
            if ranges:
                super().free_kv_row(kv, ranges)

        def on_release(self, req, *, checkpointed: bool) -> None:
            lane = req.kv.req_pool_idx  # before SGLang clears it; the finish frees around it
            super().on_release(req, checkpointed=checkpointed)
            self.freed.forget(req.kv, lane)
            st = state(req)
            if st is not None:  # a retracted request comes back on a new, whole row
                st.release_done = False
                st.pending = st.pending_scores = None
                # observed again, by its re-prefill or its next steps
                if st.policy.scored and not req.finished():
                    st.book = ScoreBook(st.policy.observe, st.policy.score)
            if self.held.pop(req.rid, None) is not None:
                self._publish()

        # -- what the next forward reads (ForwardBatch.init_new hook -> attention backend) ------
        def prepare_forward(self, reqs, seq_lens: list[int], prefix_lens: list[int] | None
                            ) -> None:
            """Before a forward (``prefix_lens``: an extend's first positions; None: decode):
            open this forward's score books. The attention backend gets them, and the freed
            columns, by lane (:meth:`forward_inputs`): SGLang hands it a copy of the
            ForwardBatch, so nothing set on the batch object reaches it."""
            self.step_books = {}
            for b, req in enumerate(reqs):
                st = state(req)
                if st is None or st.book is None or st.release_done or self.freed.count(req.kv):
                    continue  # an observed row has no freed column
                rows = st.observed_rows(len(self.marker_ids))
                if prefix_lens is None:
                    if rows is not None and seq_lens[b] - 1 >= rows[1]:
                        continue  # past the window: a declared thinking's prefill observed it
                    st.book.begin_step(seq_lens[b])
                else:  # an extend observes the rows it computes of the observation window
                    if rows is None:
                        continue
                    lo, hi = max(rows[0], prefix_lens[b]), min(rows[1], seq_lens[b])
                    if lo >= hi:
                        continue
                    st.book.begin_step(seq_lens[b], (lo, hi))
                self.step_books[req.kv.req_pool_idx] = st.book

        def forward_inputs(self, lanes: list[int]):
            """(freed columns per request or None, (batch positions, books) or None)."""
            freed = [self.freed.of_lane(lane) for lane in lanes] if self.freed else None
            if freed is not None and all(f is None for f in freed):
                freed = None
            books = self.step_books
            hits = [(b, books[lane]) for b, lane in enumerate(lanes) if lane in books]
            scoring = None
            if hits:
                scoring = (torch.tensor([b for b, _ in hits], dtype=torch.int64),
                           [book for _, book in hits])
            return freed, scoring

        # -- after every decode step -------------------------------------------------------------
        def after_decode(self, reqs) -> int:
            """Find end markers, release thinking KV, update metrics. Returns slots freed."""
            released = releases = 0
            for req in reqs:
                st = state(req)
                if st is None or req.finished() or not req.kv.holds_kv:
                    continue
                out, prompt = req.output_ids, len(req.origin_input_ids)
                if st.marker_col is None:
                    at = self._find_marker(out, st)
                    st.marker_col = None if at is None else prompt + at
                if st.marker_col is not None and st.policy.releases and not st.release_done:
                    # scored: a generated marker's own query is observed in the step after it;
                    # a marker in the prompt was observed by the prefill
                    marker_end = st.marker_col + len(self.marker_ids)
                    if prompt + len(out) >= marker_end + (1 if st.policy.scored else 0):
                        if st.policy.name == "release-on-pressure":
                            self._decide(req, st)  # freed only when memory runs short
                        else:
                            freed = self._release(req, st)
                            released += freed
                            releases += freed > 0
                        st.release_done = True  # once per row (a retracted one comes back whole)
                        st.book = None
                end = prompt + len(out)
                m = end if st.marker_col is None else st.marker_col
                self.held[req.rid] = (m - st.think_from - self.freed.count(req.kv), end - m)
            self._publish(released, releases)
            return released

        def _find_marker(self, out, st: ReqState) -> int | None:
            at, st.scanned = find_new_tokens(out, self.marker_ids, st.scanned)
            return None if at < 0 else at

        def _scores(self, req, st: ReqState):
            if not st.policy.scored or st.book is None:
                return None
            scores = st.book.scores(st.marker_col)
            st.observed = len(st.book.steps)
            return scores

        def _columns(self, req, st: ReqState, scores) -> torch.Tensor:
            return columns_to_free(st.think_from, req.kv.cache_protected_len,
                                   st.marker_col - st.think_from, st.policy, scores)

        def _release(self, req, st: ReqState) -> int:
            kv = req.kv
            cols = self._columns(req, st, self._scores(req, st))
            if cols.numel() == 0:
                return 0
            if self.freed.count(kv):
                logger.error("sgl-reason: %s already has freed columns; not releasing", req.rid)
                return 0
            return self._free(req, cols)

        def _decide(self, req, st: ReqState) -> None:
            """release-on-pressure: the columns release-on-answer would free, lowest score first
            (oldest first without scores), kept until memory runs short (:meth:`relieve`)."""
            scores = self._scores(req, st)
            cols = self._columns(req, st, scores)
            if scores is None:
                keys = cols.double()
            else:
                keys = torch.zeros(cols.numel(), dtype=torch.float64)
                inside = cols < scores.numel()
                keys[inside] = scores[cols[inside]].double()
            order = torch.argsort(keys, stable=True)
            st.pending, st.pending_scores = cols[order], keys[order]

        def relieve(self, reqs, tokens: int) -> int:
            """Free up to ``tokens`` pending thinking columns of ``reqs`` (release-on-pressure),
            lowest score first across them. Returns slots freed."""
            pool = [(req, st) for req in reqs
                    if (st := state(req)) is not None and st.pending is not None
                    and st.pending.numel() and req.kv.holds_kv and not req.finished()]
            if not pool:
                return 0
            scores = torch.cat([st.pending_scores for _, st in pool])
            owner = torch.cat([torch.full((st.pending.numel(),), i, dtype=torch.int64)
                               for i, (_, st) in enumerate(pool)])
            # each request's pending columns are in ascending score order, so the lowest
            # `tokens` overall are a prefix of each request's own list
            taken = torch.bincount(owner[torch.argsort(scores, stable=True)[:tokens]],
                                   minlength=len(pool))
            freed = 0
            for (req, st), n in zip(pool, taken.tolist()):
                if n == 0:
                    continue
                cols, st.pending = st.pending[:n], st.pending[n:]
                st.pending_scores = st.pending_scores[n:]
                freed += self._free(req, torch.sort(cols).values)
            self._publish(freed, 0, pressure=1)
            return freed

        def _free(self, req, cols: torch.Tensor) -> int:
            """Free these row columns of a running request (sorted, not freed before)."""
            kv, st = req.kv, state(req)
            row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
            if int(cols[-1]) >= kv.kv_committed_len or not bool((row[cols] > 0).all()):
                # cannot happen by the range table; if it does, keeping the KV is always safe
                logger.error("sgl-reason: not releasing %d columns of %s: committed %d",
                             cols.numel(), req.rid, kv.kv_committed_len)
                return 0
            if st.policy.scored and st.declared not in self._told_scored:
                self._told_scored.add(st.declared)  # once per server and route
                logger.info("sgl-reason thinking KV: first scored release (%s, %s): %d thinking "
                            "tokens, %d freed, scores from %d observed %s", req.rid,
                            st.policy.name, st.marker_col - st.think_from, cols.numel(),
                            st.observed, "prefill rows" if st.declared else "steps")
            super().free_kv_row(kv, runs(cols))
            row[cols] = 0  # SGLang's padding slot: never allocated, never freed
            self.freed.add(kv, cols)
            req.skip_radix_cache_insert = True  # the row is no longer a valid tree key
            return int(cols.numel())

        def released_slots(self, kv) -> int:
            """Slots released from the row that ``kv`` holds (0 if none)."""
            return self.freed.count(kv)

        def _publish(self, released: int = 0, releases: int = 0, pressure: int = 0,
                     retracted: int = 0) -> None:
            thinking = sum(t for t, _ in self.held.values())
            answer = sum(a for _, a in self.held.values())
            self.metrics.update(thinking, answer, released, releases, pressure, retracted)

    return ThinkingKVCache


def build_cache(ctx):
    """Radix cache factory for ``--radix-cache-backend sgl-reason`` (scheduler process)."""
    global _CACHE
    from sglang.srt.mem_cache.registry import create_unified_radix_cache
    from transformers import AutoTokenizer

    args = ctx.server_args
    policy = Policy.from_env()
    marker, source = think_end_for(args.model_path)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
    marker_ids = tokenizer.encode(marker, add_special_tokens=False)
    if not marker.strip() or not marker_ids:
        raise ValueError(f"No end-of-thinking marker: {source} gives {marker!r}. Pass "
                         "--think-end TEXT.")
    check_window(policy, ctx.model_config.context_len)
    cache = create_unified_radix_cache(ctx, cache_class=cache_class())
    cache.setup(policy, marker_ids, Metrics(bool(args.enable_metrics) and ctx.tp_rank == 0),
                release_problems=release_supported(args),
                demote_ok=args.radix_eviction_policy == "priority")
    if os.environ.get(POISON_ENV) == "1":
        _poison_padding_slot(cache)
    logger.info("sgl-reason thinking KV: policy %s, window %d, sink %d, keep %s (%s over %d "
                "steps), marker %r = %s (%s)", policy.name, policy.window, policy.sink,
                policy.keep, policy.score, policy.observe, marker, marker_ids, source)
    _CACHE = cache
    return cache


def _poison_padding_slot(cache) -> None:
    pool = cache.token_to_kv_pool_allocator.get_kvcache()
    if not hasattr(pool, "k_buffer") or hasattr(pool, "token_k_scale"):
        raise RuntimeError(f"{POISON_ENV} needs a 16-bit KV pool")
    for k, v in zip(pool.k_buffer, pool.v_buffer):
        k[0] = float("nan")
        v[0] = 1e4
    logger.warning("sgl-reason: KV slot 0 poisoned (%s=1): a freed column read is NaN",
                   POISON_ENV)
