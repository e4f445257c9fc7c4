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
| ``[P, seq_len)``, the own suffix  | batched over all requests, padded to the longest    |

and the two partial softmaxes are merged exactly by their log-sum-exp (the cascade/flash
decomposition), in fp32. Groups with less than ``MIN_SHARED`` common tokens are not split.
The result equals stock attention up to floating-point rounding (``tests/runtime``).

Installed in the scheduler process by the plugin; ``SGL_REASON_CPU_ATTENTION=0`` turns it off.
Anything it does not cover (sliding windows, cross attention, encoder lengths) goes to the stock
code path unchanged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

logger = logging.getLogger(__name__)

ENV = "SGL_REASON_CPU_ATTENTION"
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


def plan_decode(rows: torch.Tensor, seq_lens: list[int]) -> DecodePlan:
    """Group a decode batch by shared KV prefix. ``rows`` is ``req_to_token[req_pool_indices]``."""
    batch = len(seq_lens)
    by_first: dict[int, list[int]] = {}
    for i in range(batch):
        by_first.setdefault(int(rows[i, 0]), []).append(i)
    shared = [0] * batch
    groups = []
    for members in by_first.values():
        p = 0
        if len(members) > 1:
            # each member keeps at least its newest token as suffix
            limit = min(seq_lens[i] for i in members) - 1
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
    return DecodePlan(groups, slots, mask)


def close_holes(rows: torch.Tensor, seq_lens: list[int],
                holes: list[tuple[int, int] | None]) -> tuple[torch.Tensor, list[int]]:
    """Rows without their released columns ``[lo, hi)`` (thinking-KV release), shifted left.

    Attention is a sum over keys whose positions RoPE fixed when they were written, so reading
    a row without its hole is exact; the query keeps its logical position."""
    rows, seq_lens = rows.clone(), list(seq_lens)
    for i, hole in enumerate(holes):
        if hole is None:
            continue
        lo, hi = hole
        n = seq_lens[i]
        rows[i, lo:n - (hi - lo)] = rows[i, hi:n].clone()
        seq_lens[i] = n - (hi - lo)
    return rows, seq_lens


def _partial(q, k, v, scale, mask=None):
    """Unnormalized attention of q [B, Hkv, R, D] over k, v [B, Hkv, L, D]: (out, max, sum)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hkv, R, L]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    e = torch.exp(scores - m)
    return torch.matmul(e, v), m, e.sum(dim=-1, keepdim=True)


def _rows(cache, slots: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Gather KV rows: a plain pool tensor, or a quantized view that dequantizes just these."""
    if hasattr(cache, "rows"):  # fp8_kv.PerTokenFP8View
        return cache.rows(slots).to(dtype)
    return torch.index_select(cache, 0, slots).to(dtype)


def shared_prefix_decode(query, k_cache, v_cache, plan: DecodePlan, scale: float) -> torch.Tensor:
    """query [B, Hq, D] -> attention output [B, Hq, D] (fp32), per the plan."""
    batch, hq, d = query.shape
    hkv = k_cache.shape[1]
    rep = hq // hkv
    q = query.float().view(batch, hkv, rep, d)  # q head h reads kv head h // rep

    flat = plan.suffix_slots.reshape(-1)
    width = plan.suffix_slots.shape[1]
    # index_select, not k_cache[idx]: advanced indexing is ~50x slower on CPU here
    ks = _rows(k_cache, flat).view(batch, width, hkv, d).transpose(1, 2)  # [B, Hkv, S, D]
    vs = _rows(v_cache, flat).view(batch, width, hkv, d).transpose(1, 2)
    out, m, l = _partial(q, ks, vs, scale, plan.suffix_mask)

    for group in plan.groups:
        p = group.prefix_slots.numel()
        if p == 0:
            continue
        g = group.members
        kp = _rows(k_cache, group.prefix_slots).transpose(0, 1)  # [Hkv, P, D]
        vp = _rows(v_cache, group.prefix_slots).transpose(0, 1)
        qg = q[g].permute(1, 0, 2, 3).reshape(1, hkv, len(g) * rep, d)  # all group queries
        o2, m2, l2 = _partial(qg, kp.unsqueeze(0), vp.unsqueeze(0), scale)
        o2 = o2.view(hkv, len(g), rep, d).permute(1, 0, 2, 3)
        m2 = m2.view(hkv, len(g), rep, 1).permute(1, 0, 2, 3)
        l2 = l2.view(hkv, len(g), rep, 1).permute(1, 0, 2, 3)
        m1, l1, o1 = m[g], l[g], out[g]
        mt = torch.maximum(m1, m2)
        a1, a2 = torch.exp(m1 - mt), torch.exp(m2 - mt)
        out[g], l[g], m[g] = o1 * a1 + o2 * a2, l1 * a1 + l2 * a2, mt
    return (out / l).reshape(batch, hq, d)


def extend_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                     seq_lens, extend_prefix_lens, extend_seq_lens, scaling, enable_gqa,
                     causal) -> torch.Tensor:
    """query/output [num_new_tokens, Hq, D]; request i's new tokens sit at positions
    ``[prefix_i, seq_len_i)`` of its row and attend to row positions ``<= their own``."""
    q_lens, prefixes = extend_seq_lens.tolist(), extend_prefix_lens.tolist()
    kv_lens, pools = seq_lens.tolist(), req_pool_indices.tolist()
    start = 0
    for n, prefix, kv, pool in zip(q_lens, prefixes, kv_lens, pools):
        slots = req_to_token[pool, :kv].long()
        q = query[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        k = _rows(k_cache, slots, q.dtype).transpose(0, 1).unsqueeze(0)
        v = _rows(v_cache, slots, q.dtype).transpose(0, 1).unsqueeze(0)
        mask, is_causal = None, False
        if causal and prefix == 0:
            is_causal = True  # square: SDPA's own causal mask is the right one
        elif causal and n > 1:
            rows = torch.arange(n).unsqueeze(1) + prefix
            mask = torch.arange(kv).unsqueeze(0) <= rows  # offset causal mask [n, kv]
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                           scale=scaling, enable_gqa=enable_gqa)
        output[start:start + n] = out[0].transpose(0, 1)
        start += n
    return output


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


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
            return stock_extend(self, query, output, k_cache, v_cache, req_to_token,
                                req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens,
                                encoder_lens, scaling, enable_gqa, causal, is_cross_attn,
                                sliding_window_size)
        return extend_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                seq_lens, extend_prefix_lens, extend_seq_lens, scaling,
                                enable_gqa, causal)

    def init_forward_metadata(self, forward_batch):
        stock_init(self, forward_batch)
        self._sgl_reason_plan, self._sgl_reason_holes = None, False
        holes = getattr(forward_batch, "sgl_reason_holes", None)
        if forward_batch.forward_mode.is_decode() and forward_batch.encoder_lens is None:
            rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices]
            seq_lens = forward_batch.seq_lens.tolist()
            if holes:
                rows, seq_lens = close_holes(rows, seq_lens, holes)
            self._sgl_reason_plan = plan_decode(rows, seq_lens)
            self._sgl_reason_holes = bool(holes)
        elif holes:
            raise RuntimeError("sgl-reason: a request with released thinking KV reached a "
                               f"{forward_batch.forward_mode} forward, which cannot skip it")

    def run_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                   seq_lens, encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
                   is_cross_attn=False, sliding_window_size=None):
        plan = getattr(self, "_sgl_reason_plan", None)
        if (plan is None or encoder_lens is not None or is_cross_attn
                or (sliding_window_size is not None and sliding_window_size > -1)
                or plan.suffix_slots.shape[0] != query.shape[0]):
            if getattr(self, "_sgl_reason_holes", False):
                raise RuntimeError("sgl-reason: released thinking KV reached stock decode "
                                   "attention, which would read the freed slots")
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
