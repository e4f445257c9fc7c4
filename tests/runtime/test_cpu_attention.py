"""The plugin's CPU attention equals stock torch_native attention (random caches, no server)."""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sgl_reason.runtime import cpu_attention

N, HKV, HQ, D = 6000, 3, 9, 64
SCALE = D ** -0.5


def _cache(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(N, HKV, D, generator=g).bfloat16()
    v = torch.randn(N, HKV, D, generator=g).bfloat16()
    return k, v, g


def test_extend_matches_stock_with_cached_prefixes():
    k, v, g = _cache()
    specs = [(0, 300), (2000, 5), (100, 1), (40, 60)]  # (cached prefix, new tokens)
    rows = torch.zeros(len(specs), 4096, dtype=torch.int32)
    perm = torch.randperm(N, generator=g)
    seq, pre, new, off = [], [], [], 0
    for i, (p, n) in enumerate(specs):
        rows[i, :p + n] = perm[off:off + p + n].int()
        off += p + n
        seq.append(p + n), pre.append(p), new.append(n)
    q = torch.randn(sum(new), HQ, D, generator=g).bfloat16()
    args = (k, v, rows, torch.arange(len(specs)), torch.tensor(seq), torch.tensor(pre),
            torch.tensor(new))
    ref = TorchNativeAttnBackend._run_sdpa_forward_extend(
        None, q.clone(), torch.empty_like(q), *args, scaling=SCALE, enable_gqa=True, causal=True)
    out = cpu_attention.extend_attention(q, torch.empty_like(q), *args, SCALE, True, True)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)


def test_shared_prefix_decode_matches_stock():
    k, v, g = _cache(1)
    prefix = torch.randperm(N, generator=g)[:700]
    rows = torch.zeros(8, 2048, dtype=torch.int32)
    seq = []
    for i in range(6):
        r = torch.randint(0, N, (300,), generator=g) if i == 5 else torch.cat(
            [prefix, torch.randint(0, N, (3 + 5 * i,), generator=g)])
        rows[i, :len(r)] = r.int()
        seq.append(len(r))
    q = torch.randn(6, HQ, D, generator=g).bfloat16()
    idx = torch.arange(6)
    plan = cpu_attention.plan_decode(rows[idx], seq)
    shared = sorted((len(grp.members), grp.prefix_slots.numel()) for grp in plan.groups)
    assert shared == [(1, 0), (5, 700)]  # five forks share 700 slots; the stranger shares none
    ref = TorchNativeAttnBackend._run_sdpa_forward_decode(
        None, q.clone(), torch.empty_like(q), k, v, rows, idx, torch.tensor(seq),
        scaling=SCALE, enable_gqa=True)
    out = cpu_attention.shared_prefix_decode(q, k, v, plan, SCALE)
    torch.testing.assert_close(out, ref.float(), atol=2e-2, rtol=0)


def test_short_common_prefix_is_not_split():
    rows = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]], dtype=torch.int32)
    plan = cpu_attention.plan_decode(rows, [6, 6])
    assert [g.prefix_slots.numel() for g in plan.groups] == [0]
    assert plan.suffix_mask.sum().item() == 12


def test_decode_skips_released_holes_exactly():
    """A row with released columns [lo, hi) attends exactly as a row that never had them."""
    k, v, g = _cache(2)
    prefix = torch.randperm(N, generator=g)[:600]
    rows = torch.zeros(4, 2048, dtype=torch.int32)
    seq, holes = [], []
    for i in range(4):
        r = torch.cat([prefix, torch.randint(0, N, (400 + 10 * i,), generator=g)])
        rows[i, :len(r)] = r.int()
        seq.append(len(r))
        holes.append((604, 604 + 300) if i % 2 == 0 else None)  # two forks released thinking
    q = torch.randn(4, HQ, D, generator=g).bfloat16()
    before = rows.clone()
    closed, closed_seq = cpu_attention.close_holes(rows, seq, holes)
    assert torch.equal(rows, before)  # the pool's own rows are left as they are
    assert closed_seq == [s - (300 if h else 0) for s, h in zip(seq, holes)]
    plan = cpu_attention.plan_decode(closed, closed_seq)
    assert [grp.prefix_slots.numel() for grp in plan.groups] == [600]  # sharing survives holes
    out = cpu_attention.shared_prefix_decode(q, k, v, plan, SCALE)
    kept = torch.zeros_like(rows)
    for i, h in enumerate(holes):  # the reference: rows built without the released slots
        r = rows[i, :seq[i]]
        r = torch.cat([r[:h[0]], r[h[1]:]]) if h else r
        kept[i, :len(r)] = r
    ref = TorchNativeAttnBackend._run_sdpa_forward_decode(
        None, q.clone(), torch.empty_like(q), k, v, kept, torch.arange(4),
        torch.tensor(closed_seq), scaling=SCALE, enable_gqa=True)
    torch.testing.assert_close(out, ref.float(), atol=2e-2, rtol=0)
