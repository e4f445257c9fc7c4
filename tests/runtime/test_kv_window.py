"""The 16-bit KV window over the low-bit pool (``--kv-full-precision-tokens S,W``).

What must hold: a token reads its first-S and last-W neighbours exactly as 16-bit KV would and
older ones from their codes; prefill reads each new token's keys as that token would have
decoded them, so teacher-forced quality measures what decoding sees; nothing reads an entry
that is not its own (lanes reused, slots released, prefixes from the cache)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from sgl_reason.runtime import cpu_attention, fp8_kv, kv_window

H, HQ, D, LAYERS = 3, 9, 16, 2
SCALE = D ** -0.5


def _pool(monkeypatch, window: str, code: str = "int8"):
    monkeypatch.setenv(fp8_kv.ENV, "per-token")
    monkeypatch.setenv(fp8_kv.CODES_ENV, code)
    monkeypatch.setenv(kv_window.ENV, window)
    return fp8_kv.pool_class()(size=512, page_size=1, dtype=torch.float8_e4m3fn, head_num=H,
                               head_dim=D, layer_num=LAYERS, device="cpu",
                               enable_memory_saver=False)


class Sequence:
    """One request (lane 1) written token by token or in extends; its K/V/queries fixed."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(n, H, D, generator=g, dtype=torch.float32).to(torch.bfloat16)
        self.v = torch.randn(n, H, D, generator=g, dtype=torch.float32).to(torch.bfloat16)
        self.q = torch.randn(n, HQ, D, generator=g, dtype=torch.float32).to(torch.bfloat16)
        self.k[:, :, 0] *= 20  # an outlier channel, so codes lose visibly
        self.req_to_token = torch.zeros(4, 256, dtype=torch.int32)
        self.slots = torch.arange(100, 100 + n)
        self.req_to_token[1, :n] = self.slots.int()

    def write(self, pool, a: int, b: int, extend: bool):
        loc = self.slots[a:b]
        if pool.kv_window is not None:
            pool.kv_window.plan(self.req_to_token, [1], [a], [b], loc, extend=extend)
        for layer in range(LAYERS):
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer), loc, self.k[a:b], self.v[a:b])

    def extend(self, pool, a: int, b: int) -> torch.Tensor:
        self.write(pool, a, b, extend=True)
        out = torch.zeros(b - a, HQ, D, dtype=torch.bfloat16)
        return cpu_attention.extend_attention(
            self.q[a:b], out, pool.get_key_buffer(0), pool.get_value_buffer(0),
            self.req_to_token, torch.tensor([1]), torch.tensor([b]), torch.tensor([a]),
            torch.tensor([b - a]), SCALE, True, True).float()

    def decode(self, pool, a: int) -> torch.Tensor:
        self.write(pool, a, a + 1, extend=False)
        plan = cpu_attention.plan_decode_batch(self.req_to_token, [1], [a + 1],
                                               window=pool.kv_window)
        return cpu_attention.shared_prefix_decode(self.q[a:a + 1], pool.get_key_buffer(0),
                                                  pool.get_value_buffer(0), plan, SCALE)

    def reference(self, i: int, sink: int, window: int, code: str) -> torch.Tensor:
        """Query i by brute force: key j exact if j < sink or i - j < window, else its codes."""
        j = torch.arange(i + 1)
        exact = ((j < sink) | (i - j < window))[:, None, None]
        k = torch.where(exact, self.k[:i + 1].float(),
                        fp8_kv.dequantize(*fp8_kv.quantize(self.k[:i + 1], code=code)))
        v = torch.where(exact, self.v[:i + 1].float(),
                        fp8_kv.dequantize(*fp8_kv.quantize(self.v[:i + 1], code=code)))
        k, v = k.repeat_interleave(HQ // H, 1), v.repeat_interleave(HQ // H, 1)
        s = torch.einsum("hd,khd->hk", self.q[i].float(), k) * SCALE
        return torch.einsum("hk,khd->hd", torch.softmax(s, -1), v)


def test_band_attention_is_the_brute_force_band():
    seq = Sequence(70)
    kq = fp8_kv.dequantize(*fp8_kv.quantize(seq.k, code="int8")).transpose(0, 1)
    vq = fp8_kv.dequantize(*fp8_kv.quantize(seq.v, code="int8")).transpose(0, 1)
    kf, vf = seq.k.float().transpose(0, 1), seq.v.float().transpose(0, 1)
    for first, chunk in ((0, 256), (0, 7), (30, 16)):
        got = kv_window.band_attention(seq.q[first:].float().transpose(0, 1), kq, vq, kf, vf,
                                       first, 4, 8, SCALE, chunk=chunk)
        want = torch.stack([seq.reference(i, 4, 8, "int8") for i in range(first, 70)], 1)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("code", ["int8", "e4m3"])
def test_prefill_and_decode_read_what_token_by_token_decoding_reads(monkeypatch, code):
    """Prefill of 70 tokens at once, prefill in two chunks, and 30 tokens prefilled then 40
    decoded one at a time: every token's attention output is the brute-force band's."""
    sink, window = 4, 8
    seq = Sequence(70)
    want = torch.stack([seq.reference(i, sink, window, code) for i in range(70)])
    whole = seq.extend(_pool(monkeypatch, f"{sink},{window}", code), 0, 70)
    pool = _pool(monkeypatch, f"{sink},{window}", code)
    chunks = torch.cat([seq.extend(pool, 0, 25), seq.extend(pool, 25, 70)])
    pool = _pool(monkeypatch, f"{sink},{window}", code)
    stepped = [seq.extend(pool, 0, 30)] + [seq.decode(pool, i) for i in range(30, 70)]
    for got in (whole, chunks, torch.cat(stepped)):
        torch.testing.assert_close(got, want, atol=1.5e-2, rtol=0)  # bf16 outputs
    # and the window matters here: bare codes are further off than bf16 rounding
    bare = torch.stack([seq.reference(i, 0, 0, code) for i in range(70)])
    assert (bare - want).abs().max() > 0.05


def test_a_window_over_everything_is_16_bit_kv(monkeypatch):
    seq = Sequence(60)
    monkeypatch.setenv(fp8_kv.ENV, "per-tensor")  # a plain 16-bit pool for the reference
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    ref = MHATokenToKVPool(size=512, page_size=1, dtype=torch.bfloat16, head_num=H,
                           head_dim=D, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    ref.kv_window = None
    want = torch.cat([seq.extend(ref, 0, 20)] + [seq.decode(ref, i) for i in range(20, 60)])
    pool = _pool(monkeypatch, "0,4096")
    got = torch.cat([seq.extend(pool, 0, 20)] + [seq.decode(pool, i) for i in range(20, 60)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_entries_of_another_request_or_a_released_slot_are_not_read(monkeypatch):
    pool = _pool(monkeypatch, "0,8")
    seq = Sequence(40)
    seq.extend(pool, 0, 40)
    win = pool.kv_window
    # the next request in the same lane shares the first 20 slots (a radix-cache match) and
    # then has its own: entries for positions 32..39 belong to the old request's slots
    other = seq.req_to_token[1].clone()
    other[20:41] = torch.arange(300, 321, dtype=torch.int32)
    reqs = seq.req_to_token.clone()
    reqs[1] = other
    win.plan(reqs, [1], [40], [41], torch.tensor([320]), extend=False)
    suffix, _ = win.decode_reads(reqs[[1]], [41], [1], None, [0], 41)
    assert suffix.dest.tolist() == [40]  # only the token it wrote itself
    # released columns 34..37 of the first request: those entries are skipped
    win.plan(seq.req_to_token, [1], [40], [41], seq.slots[40:41] if len(seq.slots) > 40
             else torch.tensor([140]), extend=False)
    seq.req_to_token[1, 40] = 140
    suffix, _ = win.decode_reads(seq.req_to_token[[1]], [41], [1], [torch.arange(34, 38)],
                                 [0], 37)
    assert sorted(suffix.dest.tolist()) == [33, 34, 35, 36]  # positions 33, 38, 39, 40
    # scattered freed columns (scored retention): 35 and 37 kept, 34, 36 and 38 freed
    suffix, _ = win.decode_reads(seq.req_to_token[[1]], [41], [1], [torch.tensor([34, 36, 38])],
                                 [0], 38)
    assert sorted(suffix.dest.tolist()) == [33, 34, 35, 36, 37]  # 33, 35, 37, 39, 40 shifted


def test_a_write_no_plan_announced_fails_loudly(monkeypatch):
    pool = _pool(monkeypatch, "0,8")
    seq = Sequence(10)
    seq.extend(pool, 0, 5)
    with pytest.raises(RuntimeError, match="a KV write that no attention plan announced"):
        pool.set_kv_buffer(SimpleNamespace(layer_id=0), seq.slots[5:7], seq.k[5:7], seq.v[5:7])


def test_flag_parsing_and_launch_refusals(monkeypatch):
    assert kv_window.parse("4,64") == (4, 64)
    for bad in ("64", "a,b", "-1,4"):
        with pytest.raises(ValueError, match="--kv-full-precision-tokens"):
            kv_window.parse(bad)
    env = {k: v for k, v in os.environ.items() if k not in (fp8_kv.ENV, fp8_kv.CODES_ENV)}
    monkeypatch.setattr(os, "environ", env)
    env[kv_window.ENV] = "0,64"
    args = SimpleNamespace(kv_cache_dtype="int8_per_token_head", max_running_requests=None,
                           attention_backend="torch_native", disable_cuda_graph=True)
    fp8_kv.prepare(args)
    assert args.max_running_requests == kv_window.DEFAULT_LANES  # one lane per request
    fp8_kv.validate(args)
    with pytest.raises(ValueError, match="--attention-backend triton"):
        fp8_kv.validate(SimpleNamespace(**{**vars(args), "attention_backend": "triton"}))
    with pytest.raises(ValueError, match="--speculative-algorithm EAGLE"):
        fp8_kv.validate(SimpleNamespace(**vars(args), speculative_algorithm="EAGLE"))
    env[cpu_attention.ENV] = "0"
    with pytest.raises(ValueError, match="SGL_REASON_CPU_ATTENTION=0"):
        fp8_kv.validate(args)
    del env[cpu_attention.ENV]
    env.pop(fp8_kv.ENV), env.pop(fp8_kv.CODES_ENV)
    with pytest.raises(ValueError, match="a 16-bit KV pool.*add --kv-cache-dtype int8_per_token_head"):
        fp8_kv.validate(SimpleNamespace(kv_cache_dtype="auto", attention_backend="torch_native"))
