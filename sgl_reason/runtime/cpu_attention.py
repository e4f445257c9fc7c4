"""Faster attention for SGLang's torch_native backend (the CPU path): extend and shared-prefix decode.

Extend (prefill): stock torch_native computes, per request, attention for the *whole* sequence
(prefix included, with an uninitialized query for the prefix part) and keeps the last rows, so
a request whose 2,000-token prompt is cached still pays a full 2,000 x 2,000 attention per layer,
and every fork branch pays it again. Here each request's new tokens attend to its K/V with the
causal mask offset by its cached prefix: cost new x total, not total x total.

Decode: stock torch_native decodes one request at a time: per layer and per request it gathers the whole
K/V row and runs SDPA, so N forks of a 2,000-token prompt read that prompt's KV N times per
layer per step. Here a decode step is planned once per batch (:func:`plan_decode`): requests
whose ``req_to_token`` rows start with the same KV slots (forks of one committed prefix share
them through the radix cache) form a group, and per layer

| range of a request's row          | computed                                            |
|-----------------------------------|-----------------------------------------------------|
| ``[0, P)``, P = group's shared len| once per group: all its queries x the prefix K/V    |
| ``[P, seq_len)``, the own suffix  | batched, padded to the longest of its length bucket |

and the two partial softmaxes are merged exactly by their log-sum-exp (the cascade/flash
decomposition), in fp32. Groups with less than ``MIN_SHARED`` common tokens are not split.
Suffixes are batched in buckets of similar length (:func:`length_buckets`): one batch padded to
its longest suffix made every request pay the longest's cost, and 6 requests of 1,700 tokens
among 20 of 400 made a layer's decode attention ~10x slower than two batches
(``benchmarks/decode_buckets.py``).
The result equals stock attention up to floating-point rounding (``tests/runtime``).

Installed in the scheduler process by the plugin; ``SGL_REASON_CPU_ATTENTION=0`` turns it off,
``SGL_REASON_DECODE_BUCKETS=0`` only the length buckets (to measure them).
Anything it does not cover (sliding windows, cross attention, encoder lengths) goes to the stock
code path unchanged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

from sgl_reason.runtime import thinking_kv
from sgl_reason.runtime.thinking_kv.columns import close_rows

logger = logging.getLogger(__name__)

ENV = "SGL_REASON_CPU_ATTENTION"
BUCKETS_ENV = "SGL_REASON_DECODE_BUCKETS"  # "0": one suffix batch padded to the longest
MIN_SHARED = 32


@dataclass(frozen=True)
class Group:
    members: torch.Tensor  # batch positions of the requests in this group (int64)
    prefix_slots: torch.Tensor  # KV slots of the shared prefix, length P (may be empty)


@dataclass(frozen=True)
class DecodePlan:
    groups: list[Group]
    suffix_slots: torch.Tensor  # [B, S] KV slots of each request's own suffix, padded with 0
    suffix_mask: torch.Tensor  # [B, S] True where suffix_slots is real
    shared: list[int]  # each request's shared-prefix length (its group's P)
    window: tuple | None = None  # 16-bit reads (kv_window): suffix Reads, per-group prefix Reads
    scoring: tuple | None = None  # (batch positions, ScoreBooks): thinking_kv.scoring observes
    # suffix batches of similar length, (batch positions, width) each; None: one batch of all.
    # A window or scoring reads the one [B, S] batch, so a plan with either has none.
    buckets: list[tuple[torch.Tensor, int]] | None = None


# a suffix joins the current bucket while it is longer than half the bucket's width, or within
# BUCKET_SLACK tokens of it: padding at most doubles a request's suffix work, and short suffixes
# are not split into many small batches (each costs a few small ops per layer)
BUCKET_SLACK = 128


def length_buckets(lengths: list[int]) -> list[tuple[torch.Tensor, int]]:
    """Batch positions grouped by suffix length, longest first: ``(positions, width)`` each,
    ``width`` the bucket's longest suffix."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets, members, width = [], [], 0
    for i in order:
        n = lengths[i]
        if members and 2 * n <= width and width - n > BUCKET_SLACK:
            buckets.append((torch.tensor(members, dtype=torch.int64), width))
            members = []
        if not members:
            width = n
        members.append(i)
    if members:
        buckets.append((torch.tensor(members, dtype=torch.int64), width))
    return buckets


def plan_decode(rows: torch.Tensor, seq_lens: list[int], min_suffix: int = 1,
                bucketed: bool = True) -> DecodePlan:
    """Group a decode batch by shared KV prefix. ``rows`` is ``req_to_token[req_pool_indices]``.
    Each request keeps at least its last ``min_suffix`` tokens (>= 1: the newest) in its own
    suffix: a 16-bit window is per request, so it cannot sit in a shared prefix. ``bucketed``:
    plan suffix length buckets (unless ``SGL_REASON_DECODE_BUCKETS=0``)."""
    batch = len(seq_lens)
    by_first: dict[int, list[int]] = {}
    for i in range(batch):
        by_first.setdefault(int(rows[i, 0]), []).append(i)
    shared = [0] * batch
    groups = []
    for members in by_first.values():
        p = 0
        if len(members) > 1:
            limit = min(seq_lens[i] for i in members) - max(1, min_suffix)
            head = rows[members, :limit]
            same = (head == head[0]).all(dim=0).to(torch.int32)
            p = int(same.cumprod(0).sum())
            if p < MIN_SHARED:
                p = 0
        for i in members:
            shared[i] = p
        groups.append(Group(torch.tensor(members, dtype=torch.int64), rows[members[0], :p].long()))
    width = max(seq_lens[i] - shared[i] for i in range(batch))
    offsets = torch.arange(width)
    starts = torch.tensor(shared).unsqueeze(1)
    lengths = torch.tensor(seq_lens).unsqueeze(1) - starts
    mask = offsets.unsqueeze(0) < lengths
    cols = (starts + offsets.unsqueeze(0)).clamp(max=rows.shape[1] - 1)
    slots = torch.where(mask, torch.gather(rows, 1, cols), torch.zeros_like(cols)).long()
    buckets = []
    if bucketed and os.environ.get(BUCKETS_ENV, "1") != "0":
        buckets = length_buckets(lengths.squeeze(1).tolist())
    return DecodePlan(groups, slots, mask, shared, buckets=buckets if len(buckets) > 1 else None)


def plan_decode_batch(req_to_token: torch.Tensor, lanes: list[int], seq_lens: list[int],
                      freed=None, window=None, scoring=None) -> DecodePlan:
    """The plan of one decode batch: rows closed over freed thinking-KV columns, grouped by
    shared prefix, where a KV window (``kv_window.KVWindow``, already planned) puts its rows,
    and which requests' attention is observed (``scoring``; their rows have no freed column)."""
    rows = req_to_token[torch.tensor(lanes)]
    closed, lens = (close_rows(rows, seq_lens, freed) if freed else (rows, seq_lens))
    plan = plan_decode(closed, lens, window.window if window is not None else 1,
                       bucketed=window is None and scoring is None)
    reads = None
    if window is not None:
        reads = window.decode_reads(rows, seq_lens, lanes, freed, plan.shared,
                                    plan.suffix_slots.shape[1])
    return DecodePlan(plan.groups, plan.suffix_slots, plan.suffix_mask, plan.shared, reads,
                      scoring, plan.buckets)


def _partial(q, k, v, scale, mask=None, k_scale=None, v_scale=None):
    """Unnormalized attention of q [B, Hkv, R, D] over k, v [B, Hkv, L, D]: (out, max, sum, e).
    ``k_scale``, ``v_scale`` [B, Hkv, L]: per-row factors of low-bit K and V (``k``, ``v`` are
    then their codes, only cast), applied to the scores and to the probabilities: q.(s k) =
    s (q.k) and sum e (s v) = sum (e s) v, an [.., L] multiply each instead of one over every
    [.., L, D] element. ``e`` is returned without ``v_scale`` (scoring reads it)."""
    scores = torch.matmul(q, k.transpose(-1, -2))  # [B, Hkv, R, L]
    scores = scores * scale if k_scale is None else scores * (k_scale * scale).unsqueeze(2)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    e = torch.exp(scores - m)
    weights = e if v_scale is None else e * v_scale.unsqueeze(2)
    return torch.matmul(weights, v), m, e.sum(dim=-1, keepdim=True), e


def _rows(cache, slots: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Gather KV rows: a plain pool tensor, or a quantized view that dequantizes just these."""
    if hasattr(cache, "rows"):  # fp8_kv.PerTokenFP8View
        return cache.rows(slots).to(dtype)
    return torch.index_select(cache, 0, slots).to(dtype)


def _coded_rows(cache, slots: torch.Tensor, reads) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gathered rows [n, H, D] fp32 and their per-(token, head) scales [n, H] (None for a 16-bit
    pool): a low-bit view's rows come back as codes, for :func:`_partial` to scale. A KV
    window's 16-bit rows (``reads``: kv_window.Reads) are put over their codes with scale 1."""
    if not hasattr(cache, "coded_rows"):  # a plain pool tensor
        return torch.index_select(cache, 0, slots).float(), None
    rows, row_scale = cache.coded_rows(slots)
    if reads is not None and reads.dest.numel():
        reads.apply(rows, cache.window_store())
        row_scale.index_fill_(0, reads.dest, 1.0)
    return rows, row_scale


def shared_prefix_decode(query, k_cache, v_cache, plan: DecodePlan, scale: float) -> torch.Tensor:
    """query [B, Hq, D] -> attention output [B, Hq, D] (fp32), per the plan."""
    batch, hq, d = query.shape
    hkv = k_cache.shape[1]
    rep = hq // hkv
    q = query.float().view(batch, hkv, rep, d)  # q head h reads kv head h // rep
    suffix_reads, prefix_reads = plan.window or (None, None)

    def prefix(cache, slots, reads):  # [1, Hkv, P, D] and [1, Hkv, P] (or None)
        rows, row_scale = _coded_rows(cache, slots, reads)
        rows = rows.transpose(0, 1).unsqueeze(0)
        return rows, None if row_scale is None else row_scale.transpose(0, 1).unsqueeze(0)

    if plan.buckets is None:  # a plan with a window or scoring has none (plan_decode_batch)
        (ks, k_scale), (vs, v_scale) = (_suffix_rows(cache, plan.suffix_slots, suffix_reads)
                                        for cache in (k_cache, v_cache))
        out, m, l, e = _partial(q, ks, vs, scale, plan.suffix_mask, k_scale, v_scale)
    else:
        out, m, l = _bucketed_suffix(q, k_cache, v_cache, plan, scale)
    m_suffix = m.clone() if plan.scoring is not None else None

    for group in plan.groups:
        p = group.prefix_slots.numel()
        if p == 0:
            continue
        g = group.members
        reads = prefix_reads[int(g[0])] if prefix_reads else None  # sinks, shared by the group
        kp, kp_scale = prefix(k_cache, group.prefix_slots, reads)
        vp, vp_scale = prefix(v_cache, group.prefix_slots, reads)
        qg = q[g].permute(1, 0, 2, 3).reshape(1, hkv, len(g) * rep, d)  # all group queries
        o2, m2, l2, _ = _partial(qg, kp, vp, scale, None, kp_scale, vp_scale)
        o2 = o2.view(hkv, len(g), rep, d).permute(1, 0, 2, 3)
        m2 = m2.view(hkv, len(g), rep, 1).permute(1, 0, 2, 3)
        l2 = l2.view(hkv, len(g), rep, 1).permute(1, 0, 2, 3)
        m1, l1, o1 = m[g], l[g], out[g]
        mt = torch.maximum(m1, m2)
        a1, a2 = torch.exp(m1 - mt), torch.exp(m2 - mt)
        out[g], l[g], m[g] = o1 * a1 + o2 * a2, l1 * a1 + l2 * a2, mt
    if plan.scoring is not None:
        from sgl_reason.runtime.thinking_kv.scoring import record

        record(plan.scoring, e, m_suffix, m, l, plan.shared, plan.suffix_mask.sum(dim=1))
    return (out / l).reshape(batch, hq, d)


def _suffix_rows(cache, slots: torch.Tensor, reads=None):
    """The rows of suffix slots [b, W]: [b, Hkv, W, D] fp32, and their scales [b, Hkv, W]
    (None for a 16-bit pool). ``reads``: a KV window's 16-bit rows (``kv_window.Reads``)."""
    b, w = slots.shape
    # index_select, not k_cache[idx]: advanced indexing is ~50x slower on CPU here
    rows, row_scale = _coded_rows(cache, slots.reshape(-1), reads)
    rows = rows.view(b, w, *rows.shape[1:]).transpose(1, 2)
    if row_scale is not None:
        row_scale = row_scale.view(b, w, -1).transpose(1, 2)
    return rows, row_scale


def _bucketed_suffix(q, k_cache, v_cache, plan: DecodePlan, scale: float):
    """The suffix partials of :func:`shared_prefix_decode`, one batch per length bucket, each
    padded only to its own longest suffix: (out, max, sum) over the whole batch."""
    out, m, l = q.new_empty(q.shape), q.new_empty(*q.shape[:3], 1), q.new_empty(*q.shape[:3], 1)
    for members, width in plan.buckets:
        slots = plan.suffix_slots[members, :width]
        (ks, k_scale), (vs, v_scale) = (_suffix_rows(cache, slots) for cache in (k_cache, v_cache))
        out[members], m[members], l[members], _ = _partial(
            q[members], ks, vs, scale, plan.suffix_mask[members, :width], k_scale, v_scale)
    return out, m, l


def extend_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                     seq_lens, extend_prefix_lens, extend_seq_lens, scaling, enable_gqa,
                     causal, scoring=None) -> torch.Tensor:
    """query/output [num_new_tokens, Hq, D]; request i's new tokens sit at positions
    ``[prefix_i, seq_len_i)`` of its row and attend to row positions ``<= their own``.
    ``scoring``: (batch positions, ScoreBooks) of requests whose query rows scored retention
    observes (``thinking_kv.scoring``)."""
    q_lens, prefixes = extend_seq_lens.tolist(), extend_prefix_lens.tolist()
    kv_lens, pools = seq_lens.tolist(), req_pool_indices.tolist()
    if scoring is not None:
        from sgl_reason.runtime.thinking_kv.scoring import observe_extend

        starts = [sum(q_lens[:b]) for b in range(len(q_lens))]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        observe_extend(scoring, query, lambda b: _rows(k_cache, req_to_token[
            pools[b], :kv_lens[b]].long()), starts, prefixes, scale)
    window = getattr(k_cache, "window", None)
    if window is not None and window.entries:
        if not causal:
            raise RuntimeError("sgl-reason KV window: non-causal attention is not supported")
        return _window_extend(query, output, k_cache, v_cache, req_to_token, pools, q_lens,
                              prefixes, kv_lens, scaling)
    start = 0
    for n, prefix, kv, pool in zip(q_lens, prefixes, kv_lens, pools):
        slots = req_to_token[pool, :kv].long()
        # in fp32, as decode: same speed here as bf16, and a 16-bit pool, a low-bit one and its
        # 16-bit window then differ by what they store, not by the arithmetic that reads it
        q = query[start:start + n].transpose(0, 1).unsqueeze(0).float()  # [1, Hq, n, D]
        k = _rows(k_cache, slots).transpose(0, 1).unsqueeze(0)
        v = _rows(v_cache, slots).transpose(0, 1).unsqueeze(0)
        mask, is_causal = None, False
        if causal and prefix == 0:
            is_causal = True  # square: SDPA's own causal mask is the right one
        elif causal and n > 1:
            rows = torch.arange(n).unsqueeze(1) + prefix
            mask = torch.arange(kv).unsqueeze(0) <= rows  # offset causal mask [n, kv]
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           scale=scaling, enable_gqa=enable_gqa)
        output[start:start + n] = out[0].transpose(0, 1).to(output.dtype)
        start += n
    return output


def _window_extend(query, output, k_cache, v_cache, req_to_token, pools, q_lens, prefixes,
                   kv_lens, scaling) -> torch.Tensor:
    """Extend over a low-bit pool with a 16-bit window (``kv_window``): each new token reads
    the keys within the window behind it at 16 bits, as it would had it been decoded."""
    from sgl_reason.runtime.kv_window import band_attention

    window = k_cache.window
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    start = 0
    for i, (n, prefix, kv, pool) in enumerate(zip(q_lens, prefixes, kv_lens, pools)):
        slots = req_to_token[pool, :kv].long()
        rows = window.extend_rows[i]
        halves = []
        for cache, carry, fresh in ((k_cache, window.carry_k, window.fresh_k),
                                    (v_cache, window.carry_v, window.fresh_v)):
            coded = _rows(cache, slots)  # [kv, H, D] fp32
            exact = coded.clone()
            exact[rows.pos] = carry[rows.first:rows.first + rows.pos.numel()].float()
            exact[prefix:kv] = fresh[start:start + n].float()
            halves += [coded.transpose(0, 1), exact.transpose(0, 1)]
        kq, kf, vq, vf = halves
        q = query[start:start + n].transpose(0, 1).float()  # [Hq, n, D]
        out = band_attention(q, kq, vq, kf, vf, prefix, window.sink, window.window, scale)
        output[start:start + n] = out.transpose(0, 1).to(output.dtype)
        start += n
    return output


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _plan_window(window, req_to_token, forward_batch) -> None:
    """Announce this batch's KV writes to the 16-bit window (``kv_window``)."""
    mode = forward_batch.forward_mode
    lanes = forward_batch.req_pool_indices.tolist()
    seq_lens = forward_batch.seq_lens.tolist()
    if mode.is_decode():
        window.plan(req_to_token, lanes, [n - 1 for n in seq_lens], seq_lens,
                    forward_batch.out_cache_loc, extend=False)
    elif mode.is_extend() and (mode.is_mixed() or mode == type(mode).EXTEND):
        window.plan(req_to_token, lanes, forward_batch.extend_prefix_lens.tolist(), seq_lens,
                    forward_batch.out_cache_loc, extend=True)
    elif not mode.is_idle():
        raise RuntimeError(f"sgl-reason KV window: {mode} forwards are not supported; run "
                           "without --kv-full-precision-tokens")


def _refuse_window(k_cache, what: str) -> None:
    window = getattr(k_cache, "window", None)
    if window is not None and window.entries:
        raise RuntimeError(f"sgl-reason KV window: {what} go to stock attention, which would "
                           "read the codes without the window; run without "
                           "--kv-full-precision-tokens")


def install() -> bool:
    """Patch TorchNativeAttnBackend in this process. Returns whether it did."""
    if not enabled():
        return False
    from sglang.srt.layers.attention import torch_native_backend as tnb

    cls = tnb.TorchNativeAttnBackend
    if getattr(cls, "_sgl_reason_shared_decode", False):
        return True
    stock_init, stock_decode = cls.init_forward_metadata, cls._run_sdpa_forward_decode
    stock_extend = cls._run_sdpa_forward_extend

    def run_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                   seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None,
                   scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                   sliding_window_size=None):
        if (encoder_lens is not None or is_cross_attn
                or (sliding_window_size is not None and sliding_window_size > -1)):
            _refuse_window(k_cache, "cross attention, encoders or sliding windows")
            return stock_extend(self, query, output, k_cache, v_cache, req_to_token,
                                req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens,
                                encoder_lens, scaling, enable_gqa, causal, is_cross_attn,
                                sliding_window_size)
        return extend_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                seq_lens, extend_prefix_lens, extend_seq_lens, scaling,
                                enable_gqa, causal, getattr(self, "_sgl_reason_scoring", None))

    def init_forward_metadata(self, forward_batch):
        stock_init(self, forward_batch)
        self._sgl_reason_plan, self._sgl_reason_freed = None, False
        lanes = forward_batch.req_pool_indices.tolist()
        freed, scoring = thinking_kv.forward_inputs(lanes)
        self._sgl_reason_scoring = scoring if forward_batch.forward_mode.is_extend() else None
        window = getattr(self.token_to_kv_pool, "kv_window", None)
        mode = forward_batch.forward_mode
        if window is not None:
            _plan_window(window, self.req_to_token_pool.req_to_token, forward_batch)
        if mode.is_decode() and forward_batch.encoder_lens is None:
            self._sgl_reason_plan = plan_decode_batch(
                self.req_to_token_pool.req_to_token, lanes, forward_batch.seq_lens.tolist(),
                freed, window, scoring)
            self._sgl_reason_freed = bool(freed)
        elif freed:
            raise RuntimeError("sgl-reason: a request with released thinking KV reached a "
                               f"{forward_batch.forward_mode} forward, which cannot skip it")

    def run_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                   seq_lens, encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
                   is_cross_attn=False, sliding_window_size=None):
        plan = getattr(self, "_sgl_reason_plan", None)
        if (plan is None or encoder_lens is not None or is_cross_attn
                or (sliding_window_size is not None and sliding_window_size > -1)
                or plan.suffix_slots.shape[0] != query.shape[0]):
            if getattr(self, "_sgl_reason_freed", False):
                raise RuntimeError("sgl-reason: released thinking KV reached stock decode "
                                   "attention, which would read the freed slots")
            _refuse_window(k_cache, "cross attention, encoders or sliding windows")
            return stock_decode(self, query, output, k_cache, v_cache, req_to_token,
                                req_pool_indices, seq_lens, encoder_lens, scaling, enable_gqa,
                                causal, is_cross_attn, sliding_window_size)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        output.copy_(shared_prefix_decode(query, k_cache, v_cache, plan, scale))
        return output

    cls.init_forward_metadata = init_forward_metadata
    cls._run_sdpa_forward_decode = run_decode
    cls._run_sdpa_forward_extend = run_extend
    cls._sgl_reason_shared_decode = True
    logger.info("sgl-reason: CPU extend and shared-prefix decode attention installed")
    return True
