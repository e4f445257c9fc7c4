"""One layer's decode attention over 16-bit KV, over int8 codes scaled per row (the pool's
decode), and over int8 rows dequantized before attention (the decode before session 24).

    .venv/bin/python benchmarks/lowbit_decode.py [--json results/lowbit_decode.json]

``cpu_attention.shared_prefix_decode`` at batch 8, requests of 450-590 tokens, the tiny
reasoner's shape (3 KV heads x 64, 9 query heads). The three take turns for 15 rounds of 20
calls; each reports its median round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sgl_reason.runtime import cpu_attention, fp8_kv

POOL, HKV, HQ, D, BATCH = 16384, 3, 9, 64, 8


class DequantizedFirst:
    """A low-bit view read the old way: every gathered element dequantized, no row scale."""

    def __init__(self, view: fp8_kv.PerTokenFP8View):
        self.view, self.shape = view, view.shape

    def coded_rows(self, slots):
        return self.view.rows(slots), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(POOL, HKV, D, generator=g).bfloat16()
    v = torch.randn(POOL, HKV, D, generator=g).bfloat16()
    k8, v8 = (fp8_kv.PerTokenFP8View(*fp8_kv.quantize(x, code="int8"), torch.bfloat16)
              for x in (k, v))
    rows = torch.zeros(BATCH, 1024, dtype=torch.int32)
    seq = []
    for i in range(BATCH):
        r = torch.randint(0, POOL, (450 + 20 * i,), generator=g)
        rows[i, :len(r)] = r.int()
        seq.append(len(r))
    q = torch.randn(BATCH, HQ, D, generator=g).bfloat16()
    plan = cpu_attention.plan_decode(rows, seq)
    cases = {"bf16": (k, v), "int8, scale per row": (k8, v8),
             "int8, dequantized first": (DequantizedFirst(k8), DequantizedFirst(v8))}
    outs = {name: cpu_attention.shared_prefix_decode(q, *kv, plan, D ** -0.5)
            for name, kv in cases.items()}
    torch.testing.assert_close(outs["int8, scale per row"], outs["int8, dequantized first"],
                               atol=1e-5, rtol=1e-5)
    rounds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(15):
        for name, kv in cases.items():
            t = time.perf_counter()
            for _ in range(20):
                cpu_attention.shared_prefix_decode(q, *kv, plan, D ** -0.5)
            rounds[name].append((time.perf_counter() - t) / 20 * 1e6)
    result = {name: round(statistics.median(xs)) for name, xs in rounds.items()}
    for name, us in result.items():
        print(f"{name:26} {us:6d} us per layer")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"us_per_layer": result, "batch": BATCH, "tokens": seq}, f, indent=1)


if __name__ == "__main__":
    main()
