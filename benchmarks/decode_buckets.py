"""One layer's decode attention with each request's suffix padded to the batch's longest (before
session 33) and batched by length bucket (``cpu_attention.length_buckets``), on decode batches
of mixed lengths.

    .venv/bin/python benchmarks/decode_buckets.py [--json results/decode_buckets.json]

``cpu_attention.shared_prefix_decode`` over a 16-bit pool, the tiny reasoner's shape (3 KV
heads x 64, 9 query heads), no shared prefix. Each batch's two ways take turns for 9 rounds
of 10 calls; each reports its median round. The batches:
- 20 requests of 400 tokens and 6 of 1,700 (self-consistency beside long gsm_symbolic
  thoughts, the mix that slowed session 33's v9 self-consistency run);
- three self-consistency problems at different stages, 8 samples each at 600, 300 and 50;
- 24 requests of 420-500 tokens (one bucket: both ways are the same code).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from sgl_reason.runtime import cpu_attention

POOL, HKV, HQ, D = 65536, 3, 9, 64
BATCHES = {
    "20 x 400 + 6 x 1,700": [400] * 20 + [1700] * 6,
    "8 x 600 + 8 x 300 + 8 x 50": [600] * 8 + [300] * 8 + [50] * 8,
    "24 of 420-500": [420 + (i * 80) // 23 for i in range(24)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(POOL, HKV, D, generator=g).bfloat16()
    v = torch.randn(POOL, HKV, D, generator=g).bfloat16()
    report = {}
    for name, lengths in BATCHES.items():
        rows = torch.zeros(len(lengths), 2048, dtype=torch.int32)
        for i, n in enumerate(lengths):
            rows[i, :n] = torch.randint(0, POOL, (n,), generator=g).int()
        q = torch.randn(len(lengths), HQ, D, generator=g).bfloat16()
        bucketed = cpu_attention.plan_decode(rows, lengths)
        plans = {"padded": dataclasses.replace(bucketed, buckets=None), "bucketed": bucketed}
        outs = {way: cpu_attention.shared_prefix_decode(q, k, v, plan, D ** -0.5)
                for way, plan in plans.items()}
        torch.testing.assert_close(outs["bucketed"], outs["padded"], atol=1e-6, rtol=1e-5)
        rounds: dict[str, list[float]] = {way: [] for way in plans}
        for _ in range(9):
            for way, plan in plans.items():
                t0 = time.perf_counter()
                for _ in range(10):
                    cpu_attention.shared_prefix_decode(q, k, v, plan, D ** -0.5)
                rounds[way].append((time.perf_counter() - t0) / 10)
        ms = {way: statistics.median(r) * 1e3 for way, r in rounds.items()}
        buckets = [(len(m), w) for m, w in bucketed.buckets or [(lengths, max(lengths))]]
        report[name] = {"ms_padded": ms["padded"], "ms_bucketed": ms["bucketed"],
                        "ratio": ms["bucketed"] / ms["padded"], "buckets": buckets}
        print(f"{name:28s} padded {ms['padded']:6.2f} ms  bucketed {ms['bucketed']:6.2f} ms  "
              f"ratio {ms['bucketed'] / ms['padded']:.2f}  buckets (requests, width) {buckets}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
