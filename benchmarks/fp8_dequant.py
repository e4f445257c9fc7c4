"""Reading per-token FP8 KV rows: PyTorch's fp8 cast vs sgl-reason's bit move vs plain bf16.

    .venv/bin/python benchmarks/fp8_dequant.py [--json results/fp8_dequant.json]

One decode step's KV reads for the default model's shape (30 layers, K and V, 3 KV heads x 64)
at batch 8 x 450 tokens: gather the rows, turn them into fp32. The three ways take turns, five
rounds, and each keeps its best round (this machine's speed drifts).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sgl_reason.runtime import fp8_kv

LAYERS, HEADS, DIM, POOL, ROWS = 30, 3, 64, 4096, 8 * 450


def fp8_cast(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What ``dequantize`` did before: PyTorch's own fp8 -> fp32 cast."""
    return q.float() * scale.float().unsqueeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(POOL, HEADS, DIM, generator=g) * 3 for _ in range(LAYERS)]
    quantized = [fp8_kv.quantize(x) for x in xs]
    bf16 = [x.bfloat16() for x in xs]
    slots = torch.randint(1, POOL, (ROWS,), generator=g)
    for q, s in quantized:
        assert torch.equal(fp8_cast(q, s), fp8_kv.dequantize(q, s))

    def fp8_read(dequant):
        def step():
            for q, s in quantized:
                for _ in ("k", "v"):
                    dequant(torch.index_select(q, 0, slots), torch.index_select(s, 0, slots))
        return step

    def bf16_read():
        for b in bf16:
            for _ in ("k", "v"):
                torch.index_select(b, 0, slots).float()

    ways = {"fp8_cast": fp8_read(fp8_cast), "fp8_bit_move": fp8_read(fp8_kv.dequantize),
            "bf16": bf16_read}
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(5):
        for name, step in ways.items():
            t = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - t)
    report = {f"{name}_ms_per_step": round(s * 1e3, 2) for name, s in best.items()}
    for name, ms in report.items():
        print(f"{name:28s} {ms:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
