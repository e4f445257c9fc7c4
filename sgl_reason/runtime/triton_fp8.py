"""The GPU path of per-token FP8 KV: attention for SGLang's Triton backend, dequantizing in-kernel.

One Triton kernel serves decode and extend. Every query row ``t`` (a decode request, or one new
token of an extend) reads the KV slots ``kv_indices[kv_start[t] : kv_start[t] + kv_len[t]]`` of
its request (an extend token sees its prefix and the new tokens up to itself: the causal mask
is the length). Per block of ``BLOCK_N`` slots it loads the fp8 K and V bytes and their
per-(token, head) bf16 scales, turns the bytes into fp16 with integer ops (the bit move of
:func:`sgl_reason.runtime.fp8_kv.dequantize`, exact, no fp8 instruction needed; int8 codes are
a bitcast and a convert), scales, and folds the block into an online softmax in fp32. Only the
slots a query reads are touched; the pool is never dequantized. GQA: query head ``h`` reads KV
head ``h // group``.

Wiring (:func:`install`, run by the plugin): ``TritonAttnBackend.forward_extend`` and
``forward_decode`` take this path when the pool is the per-token FP8 pool, after writing the
new K/V through the pool (which quantizes them). Features this kernel does not implement
(logit soft-capping, sliding windows, attention sinks, cross attention, speculative decoding)
raise :class:`NotImplementedError` naming the feature instead of computing something else.
CUDA graphs are refused at launch (the per-query index lists change size every step).

Status: tested on CPU under ``TRITON_INTERPRET=1`` against the torch reference
(``tests/runtime/test_triton_fp8.py``); it has not run on a GPU yet.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

BLOCK_N = 32


def _fp8_paged_attention(  # the kernel body, decorated by _kernel()
    Q, K, V, KS, VS, Out, KvIndices, KvStart, KvLen, sm_scale,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_sn, stride_sh, stride_ot, stride_oh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    INT8: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    start = tl.load(KvStart + t)
    n = tl.load(KvLen + t)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(Q + t * stride_qt + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
    m_i = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        nmask = offs < n
        slot = tl.load(KvIndices + start + offs, mask=nmask, other=0).to(tl.int64)
        kvmask = nmask[:, None] & dmask[None, :]
        row = slot[:, None] * stride_kn + kvh * stride_kh + d[None, :]
        k_scale = tl.load(KS + slot * stride_sn + kvh * stride_sh, mask=nmask, other=0.0)
        kb = tl.load(K + row, mask=kvmask, other=0)
        if INT8:
            k = kb.to(tl.int8, bitcast=True).to(tl.float32) * k_scale.to(tl.float32)[:, None]
        else:
            # e4m3 s.eeee.mmm (bias 7) -> fp16 s.eeeee.mmmmmmmmmm (bias 15) = value * 2^-8;
            # the 2^-8 of the bit move goes into the scale
            kb = kb.to(tl.int16)
            kb = (kb + (kb & 0x80)) << 7
            k = kb.to(tl.float16, bitcast=True).to(tl.float32) * (k_scale.to(tl.float32) * 256.0)[:, None]
        scores = tl.sum(q[None, :] * k, 1) * sm_scale
        scores = tl.where(nmask, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v_scale = tl.load(VS + slot * stride_sn + kvh * stride_sh, mask=nmask, other=0.0)
        vb = tl.load(V + row, mask=kvmask, other=0)
        if INT8:
            v = vb.to(tl.int8, bitcast=True).to(tl.float32) * v_scale.to(tl.float32)[:, None]
        else:
            vb = vb.to(tl.int16)
            vb = (vb + (vb & 0x80)) << 7
            v = vb.to(tl.float16, bitcast=True).to(tl.float32) * (v_scale.to(tl.float32) * 256.0)[:, None]
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    tl.store(Out + t * stride_ot + h * stride_oh + d, acc / l_i, mask=dmask)


@functools.cache
def _kernel():
    """Decorated on first use, so that ``TRITON_INTERPRET`` is read when the kernel is needed
    (the interpreter patches ``tl`` in this module's globals, hence a module-level function)."""
    import triton

    return triton.jit(_fp8_paged_attention)


def fp8_paged_attention(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v: torch.Tensor,
                        v_scale: torch.Tensor, kv_indices: torch.Tensor, kv_start: torch.Tensor,
                        kv_len: torch.Tensor, sm_scale: float, code: str | None = None
                        ) -> torch.Tensor:
    """q [T, Hq, D]; k, v fp8 or int8 codes (or their uint8 bytes, with ``code`` "e4m3" or
    "int8" naming them) [N, Hkv, D]; scales [N, Hkv]; kv_indices flat slots; kv_start,
    kv_len [T] -> fp32 [T, Hq, D]. Every kv_len must be >= 1."""
    import triton

    T, hq, dim = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if k.shape != v.shape or k_scale.shape != v_scale.shape or k_scale.shape != k.shape[:2]:
        raise ValueError(f"K {tuple(k.shape)}, V {tuple(v.shape)}, scales {tuple(k_scale.shape)}, "
                         f"{tuple(v_scale.shape)}: expected [N, Hkv, D] and [N, Hkv]")
    code = code or ("int8" if k.dtype == torch.int8 else "e4m3")
    if code not in ("e4m3", "int8"):
        raise ValueError(f"unknown KV code {code!r}: use e4m3 or int8")
    k8, v8 = k.view(torch.uint8), v.view(torch.uint8)
    out = torch.empty((T, hq, dim), dtype=torch.float32, device=q.device)
    if T == 0:
        return out
    _kernel()[(T, hq)](
        q, k8, v8, k_scale, v_scale, out, kv_indices, kv_start, kv_len, sm_scale,
        q.stride(0), q.stride(1), k8.stride(0), k8.stride(1), k_scale.stride(0), k_scale.stride(1),
        out.stride(0), out.stride(1),
        GROUP=hq // hkv, D=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK=BLOCK_N,
        INT8=code == "int8",
    )
    return out


def reference_attention(q, k, k_scale, v, v_scale, kv_indices, kv_start, kv_len, sm_scale):
    """The same attention in torch (dequantize the gathered rows, softmax in fp32)."""
    from sgl_reason.runtime.fp8_kv import dequantize

    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for t in range(q.shape[0]):
        slots = kv_indices[int(kv_start[t]):int(kv_start[t]) + int(kv_len[t])].long()
        kt = dequantize(k[slots], k_scale[slots]).repeat_interleave(group, dim=1)  # [L, Hq, D]
        vt = dequantize(v[slots], v_scale[slots]).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t].float(), kt) * sm_scale
        out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), vt)
    return out


# -- SGLang's Triton backend ------------------------------------------------------------------

def query_ranges(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 extend_lens: torch.Tensor | None = None):
    """(kv_indices, kv_start, kv_len) for a batch: one query per request (decode, ``extend_lens``
    None) or one per new token (extend: the i-th of ``e`` new tokens of a ``seq_len`` request
    sees ``seq_len - e + i + 1`` slots)."""
    device = req_to_token.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    rows = req_to_token[req_pool_indices.long()]
    width = torch.arange(rows.shape[1], device=device)
    kv_indices = rows[width[None, :] < seq_lens[:, None]].to(torch.int32)  # row-major: per request
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    if extend_lens is None:
        return kv_indices, starts.to(torch.int32), seq_lens.to(torch.int32)
    extend_lens = extend_lens.to(device=device, dtype=torch.int64)
    per_token_start = torch.repeat_interleave(starts, extend_lens)
    first = torch.repeat_interleave(seq_lens - extend_lens, extend_lens)
    offset = torch.arange(int(extend_lens.sum()), device=device) \
        - torch.repeat_interleave(torch.cumsum(extend_lens, 0) - extend_lens, extend_lens)
    return kv_indices, per_token_start.to(torch.int32), (first + offset + 1).to(torch.int32)


def _refuse_unsupported(layer, forward_batch, sinks) -> None:
    problems = []
    if getattr(layer, "logit_cap", 0) and layer.logit_cap > 0:
        problems.append("logit soft-capping")
    if getattr(layer, "sliding_window_size", -1) not in (None, -1):
        problems.append("sliding-window attention")
    if sinks is not None:
        problems.append("attention sinks")
    if getattr(layer, "is_cross_attention", False):
        problems.append("cross attention")
    if getattr(forward_batch, "spec_info", None) is not None:
        problems.append("speculative decoding")
    if problems:
        raise NotImplementedError(
            f"per-token FP8 KV on the Triton backend does not implement {', '.join(problems)}; "
            "serve this model with --kv-scale per-tensor")


def _attend(backend, q, k, v, layer, forward_batch, save_kv_cache, sinks, decode: bool):
    _refuse_unsupported(layer, forward_batch, sinks)
    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None:
        pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
    i = layer.layer_id - pool.start_layer
    ranges = getattr(forward_batch, "_sgl_reason_fp8_ranges", None)
    if ranges is None:  # once per forward, not once per layer
        ranges = query_ranges(
            forward_batch.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
            forward_batch.seq_lens, None if decode else forward_batch.extend_seq_lens)
        forward_batch._sgl_reason_fp8_ranges = ranges
    kv_indices, kv_start, kv_len = ranges
    hq, dim = layer.tp_q_head_num, layer.qk_head_dim
    out = fp8_paged_attention(
        q.reshape(-1, hq, dim), pool.k_buffer[i], pool.token_k_scale[i], pool.v_buffer[i],
        pool.token_v_scale[i], kv_indices, kv_start, kv_len, layer.scaling, pool.codes)
    return out.to(q.dtype).reshape(-1, hq * layer.v_head_dim)


def install() -> None:
    """Route the Triton backend's attention through the kernel when the pool is per-token FP8."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    if getattr(TritonAttnBackend, "_sgl_reason_fp8", False):
        return
    stock_extend, stock_decode = TritonAttnBackend.forward_extend, TritonAttnBackend.forward_decode

    def per_token(backend) -> bool:
        return hasattr(backend.token_to_kv_pool, "token_k_scale")

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kw):
        if not per_token(self):
            return stock_extend(self, q, k, v, layer, forward_batch, save_kv_cache, sinks, **kw)
        return _attend(self, q, k, v, layer, forward_batch, save_kv_cache, sinks, decode=False)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, **kw):
        if not per_token(self):
            return stock_decode(self, q, k, v, layer, forward_batch, save_kv_cache, sinks, **kw)
        return _attend(self, q, k, v, layer, forward_batch, save_kv_cache, sinks, decode=True)

    TritonAttnBackend.forward_extend = forward_extend
    TritonAttnBackend.forward_decode = forward_decode
    TritonAttnBackend._sgl_reason_fp8 = True
