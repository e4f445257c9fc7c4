"""The plugin's CPU attention equals stock torch_native attention (random caches, no server)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sgl_reason.runtime import cpu_attention, fp8_kv
from sgl_reason.runtime.thinking_kv.columns import close_rows
from sgl_reason.runtime.thinking_kv.scoring import ScoreBook

N, HKV, HQ, D = 6000, 3, 9, 64
SCALE = D ** -0.5


def _cache(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(N, HKV, D, generator=g).bfloat16()
    v = torch.randn(N, HKV, D, generator=g).bfloat16()
    return k, v, g


def _forks(g, n: int, prefix: int, first: int, step: int, width: int):
    """Block-table rows of ``n`` requests sharing ``prefix`` random slots, request i followed by
    ``first + step * i`` slots of its own; and their lengths."""
    shared = torch.randperm(N, generator=g)[:prefix]
    rows = torch.zeros(n, width, dtype=torch.int32)
    seq = []
    for i in range(n):
        r = torch.cat([shared, torch.randint(0, N, (first + step * i,), generator=g)])
        rows[i, :len(r)] = r.int()
        seq.append(len(r))
    return rows, seq


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


@pytest.mark.parametrize("code", ["int8", "e4m3"])
def test_low_bit_decode_scales_scores_as_dequantized_rows_would(code):
    """Decode over a low-bit view reads codes and applies their scales to scores and
    probabilities: the same attention, to fp32 rounding, as over the rows dequantized first
    (shared prefix and private suffixes both)."""
    k, v, g = _cache(2)
    (kq, ks), (vq, vs) = fp8_kv.quantize(k, code=code), fp8_kv.quantize(v, code=code)
    k_view = fp8_kv.PerTokenFP8View(kq, ks, torch.bfloat16)
    v_view = fp8_kv.PerTokenFP8View(vq, vs, torch.bfloat16)
    rows, seq = _forks(g, 4, 500, 7, 9, 1024)
    q = torch.randn(4, HQ, D, generator=g).bfloat16()
    plan = cpu_attention.plan_decode(rows, seq)
    assert [grp.prefix_slots.numel() for grp in plan.groups] == [500]
    out = cpu_attention.shared_prefix_decode(q, k_view, v_view, plan, SCALE)
    every = torch.arange(N)
    ref = cpu_attention.shared_prefix_decode(q, k_view.rows(every), v_view.rows(every), plan,
                                             SCALE)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_short_common_prefix_is_not_split():
    rows = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]], dtype=torch.int32)
    plan = cpu_attention.plan_decode(rows, [6, 6])
    assert [g.prefix_slots.numel() for g in plan.groups] == [0]
    assert plan.suffix_mask.sum().item() == 12


def test_suffixes_are_batched_with_others_of_similar_length(monkeypatch):
    """A suffix joins a bucket while it is more than half the bucket's width (or within the
    slack of it): padding at most doubles a request's work, short ones stay together. The
    environment variable turns buckets off, for benchmarks."""
    rows = torch.arange(2 * 600, dtype=torch.int32).view(2, 600)
    assert [len(m) for m, _ in cpu_attention.plan_decode(rows, [600, 20]).buckets] == [1, 1]
    monkeypatch.setenv(cpu_attention.BUCKETS_ENV, "0")
    assert cpu_attention.plan_decode(rows, [600, 20]).buckets is None
    buckets = cpu_attention.length_buckets([400, 1700, 400, 30, 1700, 900, 300])
    assert [(m.tolist(), w) for m, w in buckets] == [([1, 4, 5], 1700), ([0, 2, 6], 400),
                                                      ([3], 30)]
    slack = cpu_attention.BUCKET_SLACK
    assert len(cpu_attention.length_buckets([slack + 1, 40, 1])) == 1


@pytest.mark.parametrize("code", [None, "int8"])
def test_decode_over_length_buckets_matches_stock(code):
    """Forks of one prefix with suffixes of very different lengths, and a stranger: attention
    computed bucket by bucket equals stock attention (16-bit pool), and equals attention over
    the dequantized rows (a low-bit pool)."""
    k, v, g = _cache(5)
    prefix = torch.randperm(N, generator=g)[:300]
    own = [1500, 20, 700, 15, 1400]
    rows = torch.zeros(6, 2048, dtype=torch.int32)
    seq = []
    for i in range(6):
        r = torch.randint(0, N, (1800,), generator=g) if i == 5 else torch.cat(
            [prefix, torch.randint(0, N, (own[i],), generator=g)])
        rows[i, :len(r)] = r.int()
        seq.append(len(r))
    q = torch.randn(6, HQ, D, generator=g).bfloat16()
    plan = cpu_attention.plan_decode(rows, seq)
    # suffixes 1,800 (the stranger's) 1,500 1,400 | 700 | 20 15
    assert sorted(len(m) for m, _ in plan.buckets) == [1, 2, 3]
    if code is None:
        ref = TorchNativeAttnBackend._run_sdpa_forward_decode(
            None, q.clone(), torch.empty_like(q), k, v, rows, torch.arange(6), torch.tensor(seq),
            scaling=SCALE, enable_gqa=True).float()
    else:
        (kq, ks), (vq, vs) = fp8_kv.quantize(k, code=code), fp8_kv.quantize(v, code=code)
        k = fp8_kv.PerTokenFP8View(kq, ks, torch.bfloat16)
        v = fp8_kv.PerTokenFP8View(vq, vs, torch.bfloat16)
        every = torch.arange(N)
        ref = cpu_attention.shared_prefix_decode(q, k.rows(every), v.rows(every), plan, SCALE)
    out = cpu_attention.shared_prefix_decode(q, k, v, plan, SCALE)
    one = cpu_attention.shared_prefix_decode(q, k, v, replace(plan, buckets=None), SCALE)
    torch.testing.assert_close(out, ref, atol=2e-2 if code is None else 1e-5,
                               rtol=0 if code is None else 1e-5)
    torch.testing.assert_close(out, one, atol=1e-6, rtol=1e-5)  # one padded batch: the same


def test_decode_skips_freed_columns_exactly():
    """A row with freed columns (a run, and scattered ones as scored retention leaves them)
    attends exactly as a row that never had them."""
    k, v, g = _cache(2)
    prefix = torch.randperm(N, generator=g)[:600]
    rows = torch.zeros(4, 2048, dtype=torch.int32)
    seq, freed = [], []
    for i in range(4):
        r = torch.cat([prefix, torch.randint(0, N, (400 + 10 * i,), generator=g)])
        rows[i, :len(r)] = r.int()
        seq.append(len(r))
    run = torch.arange(604, 904)  # request 0: one run, the window-only rule
    scattered = torch.sort(torch.randperm(300, generator=g)[:250] + 604).values  # request 2
    freed = [run, None, scattered, None]  # two forks released thinking
    q = torch.randn(4, HQ, D, generator=g).bfloat16()
    before = rows.clone()
    closed, closed_seq = close_rows(rows, seq, freed)
    assert torch.equal(rows, before)  # the pool's own rows are left as they are
    assert closed_seq == [s - (0 if f is None else f.numel()) for s, f in zip(seq, freed)]
    plan = cpu_attention.plan_decode(closed, closed_seq)
    assert [grp.prefix_slots.numel() for grp in plan.groups] == [600]  # sharing survives
    out = cpu_attention.shared_prefix_decode(q, k, v, plan, SCALE)
    kept = torch.zeros_like(rows)
    for i, f in enumerate(freed):  # the reference: rows built without the freed slots
        cols = [c for c in range(seq[i]) if f is None or c not in set(f.tolist())]
        kept[i, :len(cols)] = rows[i, cols]
    ref = TorchNativeAttnBackend._run_sdpa_forward_decode(
        None, q.clone(), torch.empty_like(q), k, v, kept, torch.arange(4),
        torch.tensor(closed_seq), scaling=SCALE, enable_gqa=True)
    torch.testing.assert_close(out, ref.float(), atol=2e-2, rtol=0)


def test_decode_records_true_attention_probabilities_for_scored_requests():
    """Scores are each observed request's softmax over its own columns (shared prefix merged
    in), aggregated over heads by mean or max, summed over layers."""
    k, v, g = _cache(3)
    rows, seq = _forks(g, 3, 40, 30, 5, 128)
    q = torch.randn(3, HQ, D, generator=g).bfloat16()
    books = [ScoreBook(4, "mean"), ScoreBook(4, "max")]
    for book, b in zip(books, (0, 2)):
        book.begin_step(seq[b])
    base = cpu_attention.plan_decode(rows, seq)
    assert base.shared == [40, 40, 40]  # the prefix is shared: scores cover the own suffix
    plan = cpu_attention.DecodePlan(base.groups, base.suffix_slots, base.suffix_mask,
                                    base.shared, None, (torch.tensor([0, 2]), books))
    cpu_attention.shared_prefix_decode(q, k, v, plan, SCALE)
    for book, b in zip(books, (0, 2)):
        keys = k[rows[b, :seq[b]].long()].float()  # [L, Hkv, D]
        qq = q[b].float().view(HKV, HQ // HKV, D)
        p = torch.softmax(torch.einsum("hrd,lhd->hrl", qq, keys) * SCALE, dim=-1)
        p = p.reshape(HQ, -1)
        ref = p.mean(0) if book.reduce == "mean" else p.amax(0)
        got = book.scores(seq[b])
        assert torch.all(got[:40] == 0)  # tree-owned prefix: never released, never scored
        torch.testing.assert_close(got[40:], ref[40:], atol=1e-5, rtol=1e-4)


def test_an_extend_observes_the_rows_decoding_would_have():
    """A prompt that holds its thinking (the declared route) is observed inside its prefill:
    each observed query row scores the columns it reads exactly as the decode step with that
    query would, so its book equals the decode steps' book."""
    k, v, g = _cache(4)
    specs = [(0, 50), (20, 90)]  # (cached prefix, new tokens); request 1 is observed
    rows = torch.zeros(2, 256, dtype=torch.int32)
    perm = torch.randperm(N, generator=g)
    off = 0
    for i, (p, n) in enumerate(specs):
        rows[i, :p + n] = perm[off:off + p + n].int()
        off += p + n
    total = sum(n for _, n in specs)
    q = torch.randn(total, HQ, D, generator=g).bfloat16()
    lo, hi = 70, 100  # absolute positions, inside request 1's new tokens [20, 110)
    for reduce in ("mean", "max"):
        book = ScoreBook(64, reduce)
        book.begin_step(110, (lo, hi))
        for _ in range(2):  # two layers
            cpu_attention.extend_attention(
                q, torch.empty_like(q), k, v, rows, torch.arange(2), torch.tensor([50, 110]),
                torch.tensor([0, 20]), torch.tensor([50, 90]), SCALE, True, True,
                (torch.tensor([1]), [book]))
        assert len(book.steps) == 0 and book.scores(110) is not None
        assert len(book.steps) == hi - lo  # one step per observed row
        ref = ScoreBook(64, reduce)
        for p in range(lo, hi):  # the decode steps whose queries are those rows
            ref.begin_step(p + 1)
            qp = q[50 + p - 20].unsqueeze(0)
            plan = cpu_attention.plan_decode(rows[1:2], [p + 1])
            plan = cpu_attention.DecodePlan(plan.groups, plan.suffix_slots, plan.suffix_mask,
                                            plan.shared, None, (torch.tensor([0]), [ref]))
            for _ in range(2):
                cpu_attention.shared_prefix_decode(qp, k, v, plan, SCALE)
        torch.testing.assert_close(book.scores(110), ref.scores(110), atol=1e-5, rtol=1e-4)
