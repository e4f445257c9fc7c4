"""Which low-bit KV scheme keeps the answer? A numerics study for issue #20, before any pool code.

    HF_HUB_OFFLINE=1 .venv/bin/python experiments/kv_schemes.py [--tokens 2048] [--model reasoner]

A transformers pass (eager attention) over two contexts of ``--tokens`` tokens each: GSM8K
questions with their worked answers (the fp8-kv bench's text, a later slice) and the reasoner's
own traces (chat turns with thinking, seeds 9,000,000+: never trained on, never held out). In
every layer, K (post-RoPE) and V are replaced by a stored-and-read-back copy right before
attention, as SGLang's pool does: every query, the token's own included, reads the stored rows.
Against the same pass with the rows unrounded: mean KL of the next-token distributions and
top-1 agreement, over every position and over the last half alone (errors grow with context).

Schemes (bytes per token and layer for 3 KV heads x 64, K and V, scales counted):

| scheme | rows | bytes |
|---|---|---|
| ``e4m3`` | float8_e4m3fn, bf16 scale per (token, head): today's ``--kv-scale per-token`` | 396 |
| ``int8`` | int8 symmetric, bf16 scale amax/127 per (token, head) | 396 |
| ``int8k-e4m3v`` / ``e4m3k-int8v`` | K and V in different formats | 396 |
| ``int8-smooth`` | int8, K divided by a per-channel factor first (calibrated on other text) | 396 |
| ``+sink4+win64`` | any of the above with the first 4 tokens and the last 64 (behind each query) read at 16 bits | + a 16-bit copy of 68 tokens per request |

The window rows read a token at 16 bits only while it is within 64 tokens of the query: what
a pool that writes the last W tokens of a request at 16 bits, and quantizes them as they age
out, serves (KIVI's residual window).
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama import modeling_llama

from sgl_reason import model
from sgl_reason.bench.fp8_kv import gsm8k_text, traces_text
from sgl_reason.runtime import fp8_kv

INT8_MAX = 127.0


def e4m3(x: torch.Tensor, smooth: torch.Tensor | None = None) -> torch.Tensor:
    q, s = fp8_kv.quantize(x)
    return fp8_kv.dequantize(q, s, torch.float32)


def int8(x: torch.Tensor, smooth: torch.Tensor | None = None, group: int = 0) -> torch.Tensor:
    """Symmetric int8 with one bf16 scale per (token, head), or per ``group`` channels."""
    x = x.float()
    if smooth is not None:
        x = x / smooth
    shape = x.shape
    if group:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
    scale = (x.abs().amax(-1, keepdim=True) / INT8_MAX).clamp(min=1e-12)
    scale = scale.to(fp8_kv.SCALE_DTYPE).float()
    out = ((x / scale).round().clamp(-INT8_MAX, INT8_MAX) * scale).reshape(shape)
    return out * smooth if smooth is not None else out


def int8_g32(x, smooth=None):
    return int8(x, smooth, group=32)


def int8_g16(x, smooth=None):
    return int8(x, smooth, group=16)


def exact(x: torch.Tensor, smooth: torch.Tensor | None = None) -> torch.Tensor:
    return x.float()


SCHEMES = {  # name -> (K's store, V's store, smooth K)
    "e4m3": (e4m3, e4m3, False),
    "int8": (int8, int8, False),
    "int8k-e4m3v": (int8, e4m3, False),
    "e4m3k-int8v": (e4m3, int8, False),
    "int8-smooth": (int8, int8, True),
    "e4m3-k-only": (e4m3, exact, False),
    "e4m3-v-only": (exact, e4m3, False),
    "int8-g32": (int8_g32, int8_g32, False),
    "int8k-g16-int8v": (int8_g16, int8, False),
}
WINDOWS = {"": (0, 0), "+sink4+win64": (4, 64), "+sink4": (4, 0), "+win64": (0, 64),
           "+sink4+win128": (4, 128)}


class Store:
    """The attention function, with the scheme it applies set per pass."""

    def __init__(self):
        self.k = self.v = exact
        self.sink = self.window = 0
        self.smooth: dict[int, torch.Tensor] | None = None
        self.calibrating: dict[int, torch.Tensor] | None = None

    def __call__(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        layer = module.layer_idx
        if self.calibrating is not None:  # per-channel amax of K: [1, H, 1, D]
            self.calibrating[layer] = key.float().abs().amax(2, keepdim=True)
        smooth = None
        if self.smooth is not None:
            amax = self.smooth[layer]
            smooth = (amax / amax.mean(-1, keepdim=True)).sqrt().clamp(min=0.1)
        groups = module.num_key_value_groups
        q = query.float()
        k_full = modeling_llama.repeat_kv(key.float(), groups)
        v_full = modeling_llama.repeat_kv(value.float(), groups)
        k_read = modeling_llama.repeat_kv(self.k(key, smooth), groups)
        v_read = modeling_llama.repeat_kv(self.v(value), groups)
        t = key.shape[2]
        i = torch.arange(t).unsqueeze(1)
        j = torch.arange(t).unsqueeze(0)
        full = (j < self.sink) | (i - j < self.window)  # read at 16 bits
        scores = torch.where(full, q @ k_full.transpose(2, 3), q @ k_read.transpose(2, 3))
        scores = scores * scaling
        if attention_mask is not None:
            scores = scores + attention_mask.float()
        p = torch.softmax(scores, dim=-1)
        out = (p * full) @ v_full + (p * ~full) @ v_read
        return out.to(query.dtype).transpose(1, 2).contiguous(), None


def compare(ref: torch.Tensor, out: torch.Tensor) -> dict:
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (ref.argmax(-1) == out.argmax(-1)).float()
    half = len(kl) // 2
    return {"kl": round(kl.mean().item(), 6), "top1": round(top1.mean().item(), 4),
            "kl_late": round(kl[half:].mean().item(), 6),
            "top1_late": round(top1[half:].mean().item(), 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--model", default="reasoner")
    parser.add_argument("--json", default=None)
    parser.add_argument("--rows", default=None,
                        help="comma-separated scheme[+window] rows (default: every scheme, "
                             "bare and +sink4+win64)")
    args = parser.parse_args()
    path = model.model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                              attn_implementation="eager").eval()
    store = Store()
    modeling_llama.eager_attention_forward = store

    def ids(text):
        return tok(text, return_tensors="pt").input_ids[:, :args.tokens]

    texts = {"gsm8k": ids(gsm8k_text(1000, args.tokens + 500)),
             "reasoner_traces": ids(traces_text(path, args.tokens + 200))}

    def logits(tokens):
        with torch.no_grad():
            return lm(tokens).logits[0].float()

    store.calibrating = {}
    logits(ids(gsm8k_text(600, 1500)))  # another slice than the ones scored
    calibration, store.calibrating = store.calibrating, None

    report = {"model": args.model, "tokens": {k: v.shape[1] for k, v in texts.items()}, "rows": {}}
    refs = {name: logits(x) for name, x in texts.items()}
    rows = (args.rows.split(",") if args.rows else
            [f"{name}{w}" for name in SCHEMES for w in ("", "+sink4+win64")])
    for row in rows:
        name = row.split("+")[0]
        suffix = row[len(name):]
        if name not in SCHEMES or suffix not in WINDOWS:
            raise SystemExit(f"unknown row {row!r}: schemes {sorted(SCHEMES)}, "
                             f"suffixes {sorted(WINDOWS)}")
        k, v, smooth = SCHEMES[name]
        store.k, store.v, store.smooth = k, v, calibration if smooth else None
        store.sink, store.window = WINDOWS[suffix]
        report["rows"][row] = {t: compare(refs[t], logits(x)) for t, x in texts.items()}
        print(row, json.dumps(report["rows"][row]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
