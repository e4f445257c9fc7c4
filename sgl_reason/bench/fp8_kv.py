"""``sgl-reason bench fp8-kv``: 16-bit KV vs per-tensor FP8 vs per-token FP8, in one run.

Rows (each its own embedded server, same model, same requests; the tiny reasoner by default,
``--model smollm2`` for the non-reasoning baseline):

- ``bf16``: 16-bit KV (the default);
- ``per_tensor``: FP8 with one scale of 1.0 for everything, SGLang's uncalibrated default;
- ``per_tensor_calibrated``: FP8 with one scale per layer for K and for V, amax/448 measured on
  a calibration text (a different text from the one evaluated);
- ``per_token``: FP8 with one bf16 scale per token and head (``--kv-scale per-token``);
- ``int8_per_token``: int8 codes with one bf16 scale per token and head
  (``--kv-cache-dtype int8_per_token_head``), the same bytes as ``per_token``;
- ``int8_win64``: the int8 pool with a 16-bit copy of each request's last 64 tokens
  (``--kv-full-precision-tokens 0,64``; sink tokens and e4m3 under a window measured no better
  in ``experiments/kv_schemes.py``);
- ``int8_win_all``: the window over every token, so no code is ever read: the same stored
  values as ``bf16`` through the windowed path's arithmetic. Its distance from ``bf16`` is the
  measurement's noise floor (near-tied next tokens that a last-bit difference flips); window
  rows also report their distance from it (``by_text.<text>.same_arithmetic``): what their
  storage alone costs.

SGLang's own FP8 KV on CPU needs AMX kernels this machine lacks, so the two per-tensor rows are
emulated inside sgl-reason's pool with fixed scales (same arithmetic: divide, cast, multiply).

Quality is measured against ``bf16`` on two long teacher-forced texts, GSM8K worked answers and
a chat of the reasoner's own traces (mean KL of next-token distributions over the reference's
top-20, renormalized; top-1 agreement; a row's headline is its worse text), and as greedy
agreement over several prompts. Every row, ``bf16`` too, is also measured against the same
weights computing in fp32 (``vs_fp32``): how far 16-bit KV itself is from exact arithmetic.
Throughput: batch-8 decode tokens/s over prompts already in the prefix cache, as a ratio to
``bf16``, the servers up together and taking turns; each round's ratio against ``bf16``'s in
the same round, reported as the median over rounds with its spread.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

from sgl_reason import EmbeddedRuntime, model
from sgl_reason.bench import publish
from sgl_reason.runtime import fp8_kv

TOP = 20
DECODE_TOKENS = 64
ACCURACY_SEED = 8_000_000
ANSWER_BATCH = 50
ACCURACY_ROWS = ("int8_per_token", "int8_win64")
# chosen by this bench (docs/benchmarks.md): the window row keeps more, but decodes at 0.81-0.86x
DEFAULT_SCHEME = "int8_per_token"
WINDOW_ALL = ["--kv-full-precision-tokens", "0,4096", "--max-running-requests", "8"]  # > the texts
WINDOW_ROWS = ("int8_win64",)  # read through the windowed arithmetic, as int8_win_all is
ROWS = ("bf16", "per_tensor", "per_tensor_calibrated", "per_token", "int8_per_token",
        "int8_win64", "int8_win_all")
POOL_TOKENS = 16384  # per server: the longest request here is ~3,000 tokens, batches ~4,000
PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain why the sky is blue.",
    "What is 17 + 25? Think step by step.",
    "List three uses of a paperclip.",
    "Describe a sunrise over the sea.",
    "How do plants make food?",
]


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def gsm8k_text(skip: int, tokens_hint: int) -> str:
    path = Path(__file__).resolve().parents[2] / "data" / "gsm8k" / "test.jsonl"  # in the repo
    lines = path.read_text().splitlines()[skip:]
    out, n = [], 0
    for line in lines:
        r = json.loads(line)
        out.append(f"Question: {r['question']}\nAnswer: {r['answer']}\n")
        n += len(out[-1]) // 4
        if n >= tokens_hint:
            break
    return "\n".join(out)


def calibrate(model_path: Path, text: str) -> dict:
    """Per-layer amax/448 of K (post-RoPE) and V, from a transformers forward pass."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    ids = tok(text, return_tensors="pt").input_ids[:, :2048]
    with torch.no_grad():
        cache = lm(ids, use_cache=True).past_key_values
    layers = getattr(cache, "layers", None)
    ks = [layer.keys for layer in layers] if layers is not None else [c[0] for c in cache]
    vs = [layer.values for layer in layers] if layers is not None else [c[1] for c in cache]
    return {"k": [float(k.abs().amax()) / fp8_kv.FP8_MAX for k in ks],
            "v": [float(v.abs().amax()) / fp8_kv.FP8_MAX for v in vs]}


def upcast(path: Path, out: Path) -> Path:
    """``path``'s weights in fp32 at ``out``. The upcast is exact (every bf16 value is an fp32
    value), so a server of it differs from the bf16 one only in its arithmetic and its KV's
    precision: the yardstick against which 16-bit KV's own error is measured."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(out)
    for f in path.iterdir():  # tokenizer and chat template, as the model folder has them
        if f.is_file() and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out


def bytes_per_token(info: dict, fp8: bool, window: int = 0, context: int = 2000) -> float:
    """Pool bytes per token; with a 16-bit window of ``window`` tokens per request, plus that
    copy's share at a ``context``-token request."""
    layers, heads, dim = info["layers"], info["kv_heads"], info["head_dim"]
    full = 2 * layers * heads * dim * 2
    if not fp8:
        return full
    return 2 * layers * heads * dim + fp8_kv.scale_bytes_per_token(layers, heads) \
        + full * min(window, context) / context


def held_out_problems(per_family: int):
    from sgl_reason.data import gym_problems
    from sgl_reason.reasoner.traces import dataset

    return [p for family in ("chain_sum", "basic_arithmetic", "leg_counting")
            for p in gym_problems(family, dataset(family, per_family, ACCURACY_SEED))]


def answers(rt: EmbeddedRuntime, problems) -> list[str | None]:
    """The reasoner's greedy final answers (``ANSWER_BATCH`` problems in flight at once)."""
    from sgl_reason.reasoner.train import chat_prompt
    from sgl_reason.reasoner.traces import THINK_END
    from sgl_reason.vote.extract import extract_answer

    prompts = [chat_prompt(p.question) for p in problems]
    outs = [o for i in range(0, len(prompts), ANSWER_BATCH)  # 150 at once outran 600 s
            for o in rt.generate(prompts[i:i + ANSWER_BATCH], max_new_tokens=1024, temperature=0)]
    return [extract_answer(o["text"].split(THINK_END)[-1]) if THINK_END in o["text"] else None
            for o in outs]


def top_logprobs(rt: EmbeddedRuntime, text: str) -> list[dict[int, float]]:
    """Top-k logprobs of every next-token distribution along ``text`` (teacher forcing)."""
    import requests

    r = requests.post(rt.url + "/generate", json={
        "text": text, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": TOP}, timeout=600)
    r.raise_for_status()
    rows = r.json()["meta_info"]["input_top_logprobs"]
    return [{int(x[1]): float(x[0]) for x in row} for row in rows if row]


def kl_and_top1(ref: list[dict], test: list[dict]) -> tuple[float, float]:
    kls, agree = [], 0
    for p, q in zip(ref, test):
        floor = min(q.values())
        zp = math.log(sum(math.exp(v) for v in p.values()))
        zq = math.log(sum(math.exp(q.get(i, floor)) for i in p))
        kls.append(sum(math.exp(lp - zp) * ((lp - zp) - (q.get(i, floor) - zq)) for i, lp in p.items()))
        agree += max(p, key=p.get) == max(q, key=q.get)
    return sum(kls) / len(kls), agree / len(kls)


def decode_seconds(rt: EmbeddedRuntime, prompts: list[str]) -> float:
    """Wall time of DECODE_TOKENS batch decode steps over the prompts' KV, prefilled beforehand.

    The timed call finds its prompts in the prefix cache, and the time of a one-token call on
    the same cached prompts (the cache hit and the first token) is subtracted. Until session
    24 this subtracted a separately timed full prefill instead, whose noise (3-4.5 s, for a
    3 s decode) dominated: per-round ratios from 0.59 to 1.73 on a quiet machine."""
    rt.flush_cache()
    rt.generate(prompts, max_new_tokens=1, temperature=0)  # the KV to decode over, untimed
    t = time.perf_counter()
    rt.generate(prompts, max_new_tokens=1, temperature=0)
    hit = time.perf_counter() - t
    t = time.perf_counter()
    rt.generate(prompts, max_new_tokens=DECODE_TOKENS + 1, temperature=0, ignore_eos=True)
    return max(1e-6, time.perf_counter() - t - hit)


def decode_ratios(servers: dict[str, EmbeddedRuntime], context: str, rounds: int = 5,
                  ref: str = "bf16") -> dict[str, dict]:
    """Batch-8 decode tokens/s per server, as a ratio to ``ref``'s. This machine's speed drifts by
    tens of percent over minutes (one run of the best-of-3 version gave 0.97x, another 0.76x), so
    the servers take turns, each round in a fresh order, and every row's ratio is taken within a
    round, against ``ref``'s rate in that same round: the row reports the median over rounds and
    the spread (max - min) of its per-round ratios."""
    prompts = [f"{context}\nNote {i}: {p}" for i, p in enumerate(PROMPTS + PROMPTS[:2])]
    rates: dict[str, list[float]] = {name: [] for name in servers}
    order = list(servers)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:  # rotate who goes first
            rates[name].append(len(prompts) * DECODE_TOKENS / decode_seconds(servers[name],
                                                                             prompts))
    out = {}
    for name, xs in rates.items():
        ratios = sorted(x / y for x, y in zip(xs, rates[ref]))
        out[name] = {"decode_tok_s": round(statistics.median(xs), 2),
                     "decode_ratio": round(statistics.median(ratios), 3),
                     "decode_ratio_spread": round(ratios[-1] - ratios[0], 3),
                     "decode_ratios": [round(x, 3) for x in ratios]}
    return out


def traces_text(path: Path, tokens: int) -> str:
    """A chat of the tiny reasoner's own traces (thinking, marker, answer), about ``tokens`` long:
    seeds from 9,000,000, never trained on, never held out."""
    from transformers import AutoTokenizer

    from sgl_reason.reasoner.traces import FAMILIES, make_traces

    tok = AutoTokenizer.from_pretrained(path)
    traces = make_traces({f: 12 for f in FAMILIES}, seed=9_000_000)
    random.Random(0).shuffle(traces)
    turns, n = [], 0
    for trace in traces:
        turns += [{"role": "user", "content": trace.question},
                  {"role": "assistant", "content": trace.completion}]
        n += len(tok(trace.question + trace.completion).input_ids)
        if n >= tokens:
            break
    return tok.apply_chat_template(turns, tokenize=False)


def quality(rt: EmbeddedRuntime, texts: dict[str, str]) -> dict:
    return {"_logprobs": {name: top_logprobs(rt, text) for name, text in texts.items()},
            "_greedy": [rt.generate(chat(p), max_new_tokens=48, temperature=0)["text"]
                        for p in PROMPTS]}


def run(tokens: int = 2000, budget_gib: float = 1.0, rounds: int = 7,
        model_name: str = "reasoner", accuracy: int = 0, reference: bool = True,
        only: tuple[str, ...] = ROWS) -> dict:
    """Every row on ``model_name``; quality over two teacher-forced texts of about ``tokens``
    tokens each (GSM8K worked answers, the reasoner's own traces), the worst of the two as the
    row's ``kl`` and ``top1_agreement``. With ``reference``, every row (``bf16`` too) is also
    measured against the same weights computing in fp32 (``vs_fp32``). ``only``: the rows to
    run (``bf16`` always runs: every ratio is against it)."""
    if unknown := set(only) - set(ROWS):
        raise ValueError(f"unknown fp8-kv rows {sorted(unknown)}: choose from {', '.join(ROWS)}")
    path = model.model_path(model_name)
    config = json.loads((path / "config.json").read_text())
    info = {"layers": config["num_hidden_layers"], "kv_heads": config["num_key_value_heads"],
            "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]}
    texts = {"gsm8k": gsm8k_text(0, tokens), "reasoner_traces": traces_text(path, tokens)}
    context = gsm8k_text(200, 400)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        scales = Path(tmp) / "scales.json"
        scales.write_text(json.dumps(calibrate(path, gsm8k_text(600, 1500))))
        fp8 = ["--kv-cache-dtype", "fp8_e4m3"]
        int8 = ["--kv-cache-dtype", "int8_per_token_head"]
        window = "--kv-full-precision-tokens"
        configs = {
            "bf16": (None, []),
            "per_tensor": ({fp8_kv.ENV: "fixed:1.0"}, fp8),
            "per_tensor_calibrated": ({fp8_kv.ENV: f"layers:{scales}"}, fp8),
            "per_token": ({fp8_kv.ENV: "per-token"}, fp8),
            "int8_per_token": (None, int8),
            "int8_win64": (None, [*int8, window, "0,64"]),
            "int8_win_all": (None, [*int8, *WINDOW_ALL]),
        }
        # every row's server names its window (none: 0,0), whatever the environment holds
        configs = {name: (env, extra if window in extra or name == "bf16" else
                          [*extra, window, "0,0"]) for name, (env, extra) in configs.items()
                   if name == "bf16" or name in only}
        # all up at once (an idle server takes no CPU here), so decode speed is measured
        # in turns rather than minutes apart
        servers = {name: stack.enter_context(EmbeddedRuntime(
            model=model_name, extra_args=[*extra, "--max-total-tokens", str(POOL_TOKENS),
                                          # the pool is set above; with seven servers up, the
                                          # free-memory check at load needs more than 0.05
                                          "--mem-fraction-static", "0.2"],
            env=env)) for name, (env, extra) in configs.items()}
        rows = {name: quality(rt, texts) for name, rt in servers.items()}
        if reference:  # up only for its teacher-forced texts, then stopped
            with EmbeddedRuntime(model=upcast(path, Path(tmp) / "fp32"), extra_args=[
                    "--max-total-tokens", str(POOL_TOKENS), "--mem-fraction-static", "0.2"]) as rt:
                exact = {name: top_logprobs(rt, text) for name, text in texts.items()}
        for name, speed in decode_ratios(servers, context, rounds).items():
            rows[name].update(speed)
        if accuracy and model_name == "reasoner":  # its held-out families
            problems = held_out_problems(accuracy)
            for name in ("bf16", *(r for r in ACCURACY_ROWS if r in servers)):
                got = answers(servers[name], problems)
                rows[name]["_answers"] = got
                rows[name]["accuracy"] = round(
                    sum(p.grade(a) for p, a in zip(problems, got)) / len(problems), 4)
    ref = rows["bf16"]
    context_tokens = {name: len(lp) for name, lp in ref["_logprobs"].items()}
    report = {"model": str(path), "model_name": model_name, "context_tokens": context_tokens,
              "teacher_forced_tokens": min(context_tokens.values()),
              "memory_budget_gib": budget_gib, "decode_rounds": rounds,
              "default_scheme": DEFAULT_SCHEME,
              "accuracy_problems": 3 * accuracy if "accuracy" in ref else 0,
              "window_bytes_at_context_tokens": tokens}
    for name, row in rows.items():
        fp8_row = name != "bf16"
        win = 64 if name == "int8_win64" else 0  # win_all: a measuring device, not a scheme
        b = round(bytes_per_token(info, fp8_row, win, tokens))
        row["bytes_per_token"] = b
        row["tokens_in_budget"] = int(budget_gib * 2**30 // b)
        if fp8_row:
            row["by_text"] = {}
            for text in texts:
                kl, top1 = kl_and_top1(ref["_logprobs"][text], row["_logprobs"][text])
                row["by_text"][text] = {"kl": round(kl, 6), "top1_agreement": round(top1, 4)}
                # storage alone: against the window over everything, where that row ran
                if name in WINDOW_ROWS and "int8_win_all" in rows:
                    kl, top1 = kl_and_top1(rows["int8_win_all"]["_logprobs"][text],
                                           row["_logprobs"][text])
                    row["by_text"][text]["same_arithmetic"] = {
                        "kl": round(kl, 6), "top1_agreement": round(top1, 4)}
            row["kl"] = max(x["kl"] for x in row["by_text"].values())
            row["top1_agreement"] = min(x["top1_agreement"] for x in row["by_text"].values())
            row["greedy_agreement"] = sum(a == g for a, g in zip(row["_greedy"], ref["_greedy"])) / len(PROMPTS)
            if "_answers" in row:
                row["accuracy_delta"] = round(row["accuracy"] - ref["accuracy"], 4)
                row["answers_differ"] = round(sum(
                    a != b for a, b in zip(row["_answers"], ref["_answers"])) / len(row["_answers"]), 4)
    if reference:
        report["reference"] = "the same weights upcast to fp32, computing and caching in fp32"
        for row in rows.values():
            row["vs_fp32"] = {}
            for text in texts:
                kl, top1 = kl_and_top1(exact[text], row["_logprobs"][text])
                row["vs_fp32"][text] = {"kl": round(kl, 6), "top1_agreement": round(top1, 4)}
    for row in rows.values():
        row.pop("_logprobs"), row.pop("_greedy"), row.pop("_answers", None)
    report.update(rows)
    report["bytes_per_token_ratio_vs_16bit"] = round(
        bytes_per_token(info, True, 0, tokens) / ref["bytes_per_token"], 4)
    report["schemes"] = {name: {
        "bytes_ratio_vs_16bit": round(row["bytes_per_token"] / ref["bytes_per_token"], 4),
        "kl": row["kl"], "top1_agreement": row["top1_agreement"], "by_text": row["by_text"],
        "decode_ratio": row["decode_ratio"], "decode_ratio_spread": row["decode_ratio_spread"],
        "context_tokens": report["teacher_forced_tokens"],
        **({"accuracy_delta": row["accuracy_delta"]} if "accuracy_delta" in row else {}),
        **({"vs_fp32": row["vs_fp32"]} if "vs_fp32" in row else {})}
        for name, row in rows.items() if name != "bf16"}
    return report


def table(r: dict) -> str:
    texts = list(r["context_tokens"])
    lines = [f"{'row':22} {'B/token':>8} {'tokens/GiB':>11} "
             + " ".join(f"{t[:9] + ' KL':>12} {t[:9] + ' top1':>14}" for t in texts)
             + f" {'greedy':>7} {'decode x':>9} {'spread':>7}"]
    for name in (n for n in ROWS if n in r):
        x = r[name]
        by_text = x.get("by_text", {t: {"kl": 0.0, "top1_agreement": 1.0} for t in texts})
        lines.append(f"{name:22} {x['bytes_per_token']:>8} {x['tokens_in_budget']:>11} "
                     + " ".join(f"{by_text[t]['kl']:>12.5f} {by_text[t]['top1_agreement']:>14.4f}"
                                for t in texts)
                     + f" {x.get('greedy_agreement', 1):>7.2f} {x['decode_ratio']:>9.3f} "
                     f"{x['decode_ratio_spread']:>7.3f}"
                     + (f"  accuracy {x['accuracy']:.3f}" if "accuracy" in x else ""))
    for name in WINDOW_ROWS:
        if name not in r or "int8_win_all" not in r:  # --rows left one of the pair out
            continue
        same = {t: r[name]["by_text"][t]["same_arithmetic"] for t in texts}
        lines.append(f"{name} against int8_win_all (its storage alone): " + ", ".join(
            f"{t} KL {x['kl']:.5f} top-1 {x['top1_agreement']:.4f}" for t, x in same.items()))
    if "reference" in r:
        lines.append("against fp32 (" + r["reference"] + "), top-1: " + "; ".join(
            f"{name} " + ", ".join(f"{t} {r[name]['vs_fp32'][t]['top1_agreement']:.4f}"
                                   for t in texts) for name in ROWS if name in r))
    lines.append(f"model {r['model_name']}; bytes per token, per-token vs 16-bit: "
                 f"{r['bytes_per_token_ratio_vs_16bit']}; teacher-forced positions: "
                 + ", ".join(f"{t} {n}" for t, n in r["context_tokens"].items())
                 + f"; decode: median of {r['decode_rounds']} rounds; default scheme "
                 f"{r['default_scheme']}")
    return "\n".join(lines)


def main(args) -> int:
    report = run(tokens=args.tokens, rounds=args.rounds, model_name=args.model,
                 accuracy=args.accuracy, reference=args.fp32_reference,
                 only=tuple(args.rows) if args.rows else ROWS)
    publish(report, table(report), args.json)
    return 0
