"""The Triton GPU path of per-token FP8 KV, run on CPU by the Triton interpreter.

The kernel is checked, for e4m3 and int8 codes, against the torch reference (the CPU path's
dequantize, softmax in fp32) for decode and for extend (causal: each new token sees its prefix
and itself), with GQA, slots scattered over the pool, sequences that do and do not fill a
block, and outlier-heavy K/V; and the backend wiring (``_attend``) on the real per-token pool,
extend then decode.

Triton reads ``TRITON_INTERPRET`` when it is first imported, which in a test session is long
before any test runs (SGLang imports it), so the kernel checks run in a child process that sets
it first: ``python tests/runtime/test_triton_fp8.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sgl_reason.runtime import fp8_kv, triton_fp8

HQ, HKV, DIM = 9, 3, 64  # SmolLM2-135M's attention shape
POOL = 256


def _pool(seed: int, code: str = "e4m3"):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(POOL, HKV, DIM, generator=g)
    v = torch.randn(POOL, HKV, DIM, generator=g)
    k[:, :, 3] *= 40.0  # an outlier channel, as real keys have
    v[::7] *= 1e-3  # rows far below fp8's normal range: only a per-row scale keeps them
    (kq, ks), (vq, vs) = fp8_kv.quantize(k, code=code), fp8_kv.quantize(v, code=code)
    return kq, ks, vq, vs


def _req_to_token(seq_lens: list[int], seed: int) -> torch.Tensor:
    """Each request's row holds distinct slots scattered over the pool."""
    perm = torch.randperm(POOL, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    rows = torch.zeros(len(seq_lens), max(seq_lens) + 5, dtype=torch.int32)
    at = 0
    for i, n in enumerate(seq_lens):
        rows[i, :n] = perm[at:at + n]
        at += n
    return rows


def check_kernel_matches_the_torch_reference(extend_lens, code="e4m3"):
    seq_lens = [5, 32, 70]  # under one block, exactly one block, several blocks
    kq, ks, vq, vs = _pool(0, code)
    rows = _req_to_token(seq_lens, 1)
    kv_indices, kv_start, kv_len = triton_fp8.query_ranges(
        rows, torch.arange(3), torch.tensor(seq_lens),
        None if extend_lens is None else torch.tensor(extend_lens))
    q = torch.randn(int(kv_len.numel()), HQ, DIM, generator=torch.Generator().manual_seed(2))
    scale = DIM ** -0.5
    got = triton_fp8.fp8_paged_attention(q, kq, ks, vq, vs, kv_indices, kv_start, kv_len, scale)
    want = triton_fp8.reference_attention(q, kq, ks, vq, vs, kv_indices, kv_start, kv_len, scale)
    assert got.shape == want.shape == (q.shape[0], HQ, DIM)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def check_backend_wiring_on_the_real_pool(code="e4m3"):
    """``_attend`` as TritonAttnBackend runs it: an extend of two requests writes K/V through
    the per-token pool (which quantizes), then a decode step; both against the reference over
    what the pool holds. SimpleNamespace stands in for the backend, layer and batch objects."""
    from types import SimpleNamespace

    os.environ[fp8_kv.ENV] = "per-token"
    os.environ[fp8_kv.CODES_ENV] = code
    codes = fp8_kv.CODE_DTYPES[code]
    pool = fp8_kv.pool_class()(size=64, page_size=1, dtype=torch.float8_e4m3fn, head_num=HKV,
                               head_dim=DIM, layer_num=2, device="cpu", enable_memory_saver=False)
    backend = SimpleNamespace(token_to_kv_pool=pool)
    layer = SimpleNamespace(layer_id=1, tp_q_head_num=HQ, qk_head_dim=DIM, v_head_dim=DIM,
                            scaling=DIM ** -0.5, logit_cap=0.0, sliding_window_size=-1)
    req_to_token = torch.zeros(2, 16, dtype=torch.int32)
    req_to_token[0, :5] = torch.tensor([9, 3, 30, 4, 11])
    req_to_token[1, :7] = torch.tensor([1, 2, 40, 41, 42, 43, 44])
    g = torch.Generator().manual_seed(5)
    for decode, seq, new in ((False, [4, 6], [4, 6]), (True, [5, 7], [1, 1])):
        loc = torch.cat([req_to_token[b, seq[b] - new[b]:seq[b]] for b in range(2)]).long()
        n = int(loc.numel())
        batch = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                                req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor(seq),
                                extend_seq_lens=torch.tensor(new), out_cache_loc=loc, spec_info=None)
        q = torch.randn(n, HQ * DIM, generator=g).bfloat16()
        k, v = (torch.randn(n, HKV, DIM, generator=g).bfloat16() for _ in range(2))
        got = triton_fp8._attend(backend, q, k, v, layer, batch, True, None, decode)
        assert got.shape == (n, HQ * DIM) and got.dtype == torch.bfloat16
        stored = pool.get_key_buffer(1)[loc]  # the new K went to its slots, quantized
        assert ((stored - k.float()).abs() <= 2 ** -3 * k.float().abs().amax(-1, keepdim=True)).all()
        ranges = triton_fp8.query_ranges(req_to_token, batch.req_pool_indices, batch.seq_lens,
                                         None if decode else batch.extend_seq_lens)
        want = triton_fp8.reference_attention(
            q.view(n, HQ, DIM), pool.k_buffer[1].view(codes), pool.token_k_scale[1],
            pool.v_buffer[1].view(codes), pool.token_v_scale[1], *ranges, layer.scaling)
        torch.testing.assert_close(got.float(), want.reshape(n, -1).bfloat16().float(),
                                   atol=1e-2, rtol=1e-2)


def test_query_ranges_are_causal_per_new_token():
    rows = _req_to_token([4, 6], 3)
    kv_indices, start, length = triton_fp8.query_ranges(
        rows, torch.tensor([1, 0]), torch.tensor([6, 4]), torch.tensor([2, 4]))
    assert kv_indices.tolist() == rows[1, :6].tolist() + rows[0, :4].tolist()
    # request 1 (6 slots, 2 new): its new tokens see 5 and 6; request 0 (4 slots, all new): 1..4
    assert start.tolist() == [0, 0, 6, 6, 6, 6]
    assert length.tolist() == [5, 6, 1, 2, 3, 4]
    _, start, length = triton_fp8.query_ranges(rows, torch.tensor([1, 0]), torch.tensor([6, 4]))
    assert start.tolist() == [0, 6] and length.tolist() == [6, 4]


def test_kernel_refuses_mismatched_heads():
    kq, ks, vq, vs = _pool(0)
    q = torch.randn(1, 8, DIM)  # 8 query heads over 3 KV heads
    one = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="8 query heads are not a multiple of 3 KV heads"):
        triton_fp8.fp8_paged_attention(q, kq, ks, vq, vs, one, one, one + 1, 1.0)


def test_kernel_matches_the_torch_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         check=False, timeout=600)
    assert run.returncode == 0 and all(f"{check} {code} ok" in run.stdout
                                       for check in ("decode", "extend", "wiring")
                                       for code in fp8_kv.CODE_DTYPES), run.stdout + run.stderr


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 (no GPU here)"
    for code in fp8_kv.CODE_DTYPES:
        for name, lens in (("decode", None), ("extend", [3, 1, 33])):
            check_kernel_matches_the_torch_reference(lens, code)
            print(name, code, "ok")
        check_backend_wiring_on_the_real_pool(code)
        print("wiring", code, "ok")
