"""A 16-bit window over the low-bit KV pool: each request's first S and last W tokens.

KIVI's residual window and IntactKV's sink tokens: a query reads the tokens nearest it (and the
first few) at 16 bits and older ones from their 8-bit codes. On the tiny reasoner a 64-token
window cuts int8's logit KL by 40% at no gain in accuracy, and decode slows from 0.93-0.94x to
0.81-0.86x of 16-bit KV (``docs/benchmarks.md``), so it is off unless asked for.

Flag: ``--kv-full-precision-tokens S,W`` with a per-token pool (``fp8_kv``); ``0,0`` is off.

Every token is still written to the pool as codes. The window is a 16-bit *copy* of some of
them, kept in one lane per request-pool row (``req_pool_idx``):

| per layer            | shape                       | what                                   |
|----------------------|-----------------------------|----------------------------------------|
| ``k``, ``v``         | ``[lanes, S + W, H, D]``    | the model dtype                        |
| ``tag`` (all layers) | ``[lanes, S + W]``          | the KV slot an entry copies, -1: empty |
| ``pos`` (all layers) | ``[lanes, S + W]``          | the entry's position in its row        |

Position p lives in entry p (p < S) or S + p % W (a ring). A read uses an entry only if the
request's row holds the entry's slot at the entry's position, and that position is a sink or
within W of the query. So a lane reused by the next request, a prefix matched in the radix
cache, a moved or released slot all fall back to codes, never to another token's values.
Tokens matched in the radix cache are read as codes until the request's own writes cover them.

One batch, in the scheduler process:

1. ``TorchNativeAttnBackend.init_forward_metadata`` (patched in ``cpu_attention``) calls
   :meth:`KVWindow.plan`: which new tokens enter which entries, and which old entries an
   extend still reads (``carry``: a multi-token extend overwrites ring entries that its own
   first queries need).
2. Every layer: ``set_kv_buffer`` calls :meth:`KVWindow.write` with the 16-bit K/V in hand: it
   saves the carried entries, writes the new ones, and keeps the in-hand rows for the extend.
3. The attention overlays 16-bit rows on the dequantized ones: decode through
   :meth:`KVWindow.decode_reads`, extend through :func:`band_attention`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

ENV = "SGL_REASON_KV_FULL_PRECISION"
DEFAULT_LANES = 64  # --max-running-requests when the window is on and none is given


def parse(text: str) -> tuple[int, int]:
    """``"S,W"`` -> (sink, window), both >= 0."""
    try:
        sink, window = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--kv-full-precision-tokens {text!r}: give two integers S,W (first S "
                         "tokens and last W tokens of each request at 16 bits), e.g. 0,64") from None
    if sink < 0 or window < 0:
        raise ValueError(f"--kv-full-precision-tokens {text!r}: S and W must be >= 0")
    return sink, window


@dataclass(frozen=True)
class Reads:
    """16-bit rows to put over gathered rows: ``rows[dest] = window.k[layer][lane, idx]``, as
    flat indices (``src = lane * entries + idx``): index_select and index_copy_ are several
    times faster on CPU than advanced indexing, and this runs twice per layer per step."""

    dest: torch.Tensor
    src: torch.Tensor

    def apply(self, rows: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
        if self.dest.numel():
            flat = store.view(-1, *store.shape[2:])
            rows.index_copy_(0, self.dest, flat.index_select(0, self.src).to(rows.dtype))
        return rows


@dataclass(frozen=True)
class _Write:
    locs: torch.Tensor  # the batch's out_cache_loc, to check each layer's write against
    sel: torch.Tensor  # which of the new tokens enter an entry
    flat: torch.Tensor  # and where: lane * entries + entry
    carry_lane: torch.Tensor  # old entries an extend reads, saved before the write
    carry_idx: torch.Tensor


@dataclass(frozen=True)
class ExtendRows:
    """For one request of an extend: 16-bit rows at these row positions (``pos``), taken from
    the carried entries ``carry[first:first + len(pos)]``; its new tokens come from the
    in-hand rows ``fresh[start:start + n]``."""

    pos: torch.Tensor
    first: int


class KVWindow:
    def __init__(self, sink: int, window: int, layers: int, heads: int, head_dim: int,
                 v_head_dim: int, device):
        self.sink, self.window = sink, window
        self.entries = sink + window
        self.layers, self.heads, self.head_dim, self.v_head_dim = layers, heads, head_dim, v_head_dim
        self.dtype, self.device = None, device  # the model's, taken from the first write
        self.lanes = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.tag = self.pos = None
        self._write: _Write | None = None
        self.carry_k: torch.Tensor | None = None
        self.carry_v: torch.Tensor | None = None
        self.fresh_k: torch.Tensor | None = None
        self.fresh_v: torch.Tensor | None = None
        self.extend_rows: list[ExtendRows] = []

    def bytes_per_lane(self, dtype: torch.dtype = torch.bfloat16) -> int:
        item = torch.tensor([], dtype=self.dtype or dtype).element_size()
        return self.layers * self.entries * self.heads * (self.head_dim + self.v_head_dim) * item

    def nbytes(self) -> int:
        return self.lanes * self.bytes_per_lane()

    def _ensure(self, lanes: int) -> None:
        """One lane per request-pool row, allocated at the first forward (the request pool's
        size, ``--max-running-requests`` + 1, is not known to the KV pool before)."""
        if lanes <= self.lanes:
            return
        self.tag = torch.full((lanes, self.entries), -1, dtype=torch.int64, device=self.device)
        self.pos = torch.full((lanes, self.entries), -1, dtype=torch.int64, device=self.device)
        self.lanes, self.k, self.v = lanes, [], []

    def _allocate(self, dtype: torch.dtype) -> None:
        shape = (self.lanes, self.entries, self.heads)
        self.dtype = dtype
        self.k = [torch.zeros(*shape, self.head_dim, dtype=dtype, device=self.device)
                  for _ in range(self.layers)]
        self.v = [torch.zeros(*shape, self.v_head_dim, dtype=dtype, device=self.device)
                  for _ in range(self.layers)]
        logger.info("sgl-reason KV window: first %d and last %d tokens of each request in %s, "
                    "%d lanes, %.1f MiB", self.sink, self.window, dtype, self.lanes,
                    self.nbytes() / 2**20)

    def _entry(self, pos: torch.Tensor) -> torch.Tensor:
        if self.window == 0:
            return pos  # only sinks are kept: callers pass positions < S
        return torch.where(pos < self.sink, pos, self.sink + (pos - self.sink).remainder(self.window))

    def _kept(self, pos: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """Positions that are a sink or within the last W of a row ``length`` long."""
        return (pos < self.sink) | (pos >= length - self.window)

    # -- 1. once per batch ----------------------------------------------------------------------

    def plan(self, req_to_token: torch.Tensor, lanes: list[int], prefix_lens: list[int],
             seq_lens: list[int], locs: torch.Tensor, extend: bool) -> None:
        """New tokens of request i sit at row positions ``[prefix_i, seq_i)``, in ``locs``
        order (a decode: prefix = seq - 1). ``extend``: the batch is read by
        :func:`band_attention`, which needs the old entries this batch overwrites."""
        self._ensure(req_to_token.shape[0])
        new = [s - p for p, s in zip(prefix_lens, seq_lens)]
        counts = torch.tensor(new)
        lane_of = torch.repeat_interleave(torch.tensor(lanes), counts)
        pos = torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq_lens)])
        sel = self._kept(pos, torch.repeat_interleave(torch.tensor(seq_lens), counts))
        sel = sel.nonzero().flatten()

        carry_lane, carry_idx, self.extend_rows = [], [], []
        first = 0
        for lane, prefix in zip(lanes, prefix_lens) if extend else ():
            want = torch.arange(prefix)  # what the request's first new token reads at 16 bits
            want = want[self._kept(want, torch.tensor(prefix + 1))]
            idx = self._entry(want)
            ok = (self.tag[lane, idx] == req_to_token[lane, want]) & (self.pos[lane, idx] == want)
            want, idx = want[ok], idx[ok]
            carry_lane.append(torch.full_like(idx, lane))
            carry_idx.append(idx)
            self.extend_rows.append(ExtendRows(want, first))
            first += want.numel()
        empty = torch.zeros(0, dtype=torch.int64)
        lane, idx = lane_of[sel], self._entry(pos[sel])
        self._write = _Write(locs.clone(), sel, lane * self.entries + idx,
                             torch.cat(carry_lane) if carry_lane else empty,
                             torch.cat(carry_idx) if carry_idx else empty)
        self.tag[lane, idx] = locs[sel].long()
        self.pos[lane, idx] = pos[sel]

    # -- 2. every layer -------------------------------------------------------------------------

    def write(self, layer: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k [N, H, D], v [N, H, Dv]: this layer's new rows at ``locs``, in 16 bits."""
        w = self._write
        if w is None or locs.shape != w.locs.shape or not torch.equal(locs, w.locs):
            raise RuntimeError(
                "sgl-reason KV window: a KV write that no attention plan announced (a path "
                "other than the torch_native backend with sgl-reason's CPU attention wrote the "
                "pool); run without --kv-full-precision-tokens for it")
        if not self.k:
            self._allocate(k.dtype)
        self.carry_k = self.k[layer][w.carry_lane, w.carry_idx]
        self.carry_v = self.v[layer][w.carry_lane, w.carry_idx]
        for store, new in ((self.k[layer], k), (self.v[layer], v)):
            store.view(-1, *store.shape[2:]).index_copy_(0, w.flat,
                                                         new.index_select(0, w.sel).to(self.dtype))
        self.fresh_k, self.fresh_v = k, v

    # -- 3. reads -------------------------------------------------------------------------------

    def decode_reads(self, rows: torch.Tensor, seq_lens: list[int], lanes: list[int],
                     freed: list[torch.Tensor | None] | None, shared: list[int], width: int
                     ) -> tuple[Reads, list[Reads | None]]:
        """Where each decode request's window entries land in the gathered rows.

        ``rows``/``seq_lens``: the requests' rows before their freed thinking-KV columns are
        closed (``freed``: per request, sorted freed columns or None);
        ``shared``: each request's shared-prefix length in the plan and ``width`` its suffix
        width (rows are gathered as [B, width] suffixes plus one prefix per group). Returns
        the suffix reads (dest = b * width + column) and, per request, reads into its group's
        prefix (sinks; dest = column; None without sinks)."""
        lane = torch.tensor(lanes)
        n = torch.tensor(seq_lens).unsqueeze(1)
        tag, pos = self.tag[lane], self.pos[lane]  # [B, E]
        ok = (tag >= 0) & (pos < n) & self._kept(pos, n)
        ok &= torch.gather(rows, 1, pos.clamp(0, rows.shape[1] - 1)).long() == tag
        col = pos.clone()
        if freed:
            from sgl_reason.runtime.thinking_kv.columns import freed_mask

            mask = freed_mask(freed, rows.shape[1])
            at = pos.clamp(0, rows.shape[1] - 1)
            gone = torch.gather(mask, 1, at)
            before = torch.gather(mask.cumsum(1), 1, at) - gone.long()  # freed columns < pos
            ok &= ~gone
            col = pos - before
        p = torch.tensor(shared).unsqueeze(1)
        entry = torch.arange(self.entries).expand_as(pos)
        batch = torch.arange(len(lanes)).unsqueeze(1).expand_as(pos)
        src = lane.unsqueeze(1) * self.entries + entry
        s = ok & (col >= p)
        suffix = Reads(batch[s] * width + (col - p)[s], src[s])
        prefix: list[Reads | None] = [None] * len(lanes)
        if not self.sink:  # the plan keeps each request's last W columns out of shared prefixes
            return suffix, prefix
        for b in range(len(lanes)):
            m = ok[b] & (col[b] < p[b])
            prefix[b] = Reads(col[b][m], src[b][m])
        return suffix, prefix


def band_attention(q: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor, kf: torch.Tensor,
                   vf: torch.Tensor, first_pos: int, sink: int, window: int, scale: float,
                   chunk: int = 256) -> torch.Tensor:
    """Causal attention of queries at positions ``first_pos + i`` where key j is read at 16 bits
    (``kf``, ``vf``) if ``j < sink`` or ``query - j < window``, else from its codes (``kq``,
    ``vq``): what each of these tokens would have seen had it been decoded one at a time.

    q [Hq, n, D]; k*, v* [Hkv, L, D] (fp32; L = first_pos + n). Returns [Hq, n, Dv]."""
    hq, n, d = q.shape
    hkv, length, dv = vq.shape
    rep = hq // hkv
    q4 = q.reshape(hkv, rep, n, d)
    out = torch.empty(hkv, rep, n, dv, dtype=torch.float32)
    dv_ = vf - vq
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        qpos = torch.arange(first_pos + a, first_pos + b).unsqueeze(1)  # [C, 1]
        end = first_pos + b
        qc = q4[:, :, a:b]
        s = torch.matmul(qc, kq[:, :end].transpose(-1, -2).unsqueeze(1)) * scale  # [Hkv, rep, C, end]
        lo = max(0, first_pos + a - window + 1) if window else end
        keys = torch.arange(lo, end).unsqueeze(0)
        band = (qpos - keys < window) & (keys <= qpos) & (keys >= sink)  # [C, end - lo]
        if end > lo:
            sf = torch.matmul(qc, kf[:, lo:end].transpose(-1, -2).unsqueeze(1)) * scale
            s[..., lo:end] = torch.where(band, sf, s[..., lo:end])
        top = min(sink, end)
        if top:
            s[..., :top] = torch.matmul(qc, kf[:, :top].transpose(-1, -2).unsqueeze(1)) * scale
        causal = torch.arange(end).unsqueeze(0) > qpos
        s.masked_fill_(causal, float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = torch.matmul(p, vq[:, :end].unsqueeze(1))
        if end > lo:
            o += torch.matmul(p[..., lo:end] * band, dv_[:, lo:end].unsqueeze(1))
        if top:
            o += torch.matmul(p[..., :top], dv_[:, :top].unsqueeze(1))
        out[:, :, a:b] = o
    return out.reshape(hq, n, dv)
