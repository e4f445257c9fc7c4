"""Which thinking tokens does the reasoner's answer need? Release rules replayed teacher-forced.

For each held-out problem: the tiny reasoner's greedy trace (thinking, ``</think>``, answer),
generated here with transformers in fp32. One forward with attentions and keys gives every
rule's scores over the thinking; then, per rule and retention share, the answer is re-read
teacher-forced with the freed thinking columns hidden from every query after the marker (as on
the server: the marker's own query reads everything, the release follows it). The columns come
from the server's own ``columns_to_free`` (sink 4, window 16, the share of the thinking kept
by score). A rule keeps an answer when every answer token is still the argmax: greedy decoding
then writes the same answer, token for token. Answer NLL beside it.

Rules (scores over thinking columns; higher is kept):

| rule | score |
|---|---|
| ``last32`` | the server's: attention of the last 32 thinking rows and the marker, mean over heads and layers, summed over rows |
| ``last32-pool7`` | the same, max-pooled over 7 neighbouring columns (SnapKV's and R-KV's smoothing: a number's digits go together) |
| ``rkv`` | R-KV's: last 8 rows' attention pooled over 7, weight 0.1, minus 0.9 x key redundancy (mean cosine similarity to the other thinking keys, softmax-normalized) |
| ``answer`` | the attention the answer's own rows pay (what it really reads): a bound no rule can see at release |
| ``answer-pool7`` | the same, pooled |

    HF_HUB_OFFLINE=1 .venv/bin/python experiments/retention_rules.py --limit 10 \
        --json experiments/results/retention_rules.json
    HF_HUB_OFFLINE=1 .venv/bin/python experiments/retention_rules.py --limit 5 \
        --rules last32,answer --shares 0.15,0.2 --decode   # free-running answers too

With ``--decode`` each answer is also decoded free-running (greedy, every query after the
marker blind to the freed columns): agreement of its final answer with keep's, and accuracy.

Lab notes: experiments/README.md.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from sgl_reason.bench.early_stop import REASONER_FAMILIES, problem_set
from sgl_reason.bench.thinking_kv import HELDOUT, chat_prompt
from sgl_reason.model import prepare
from sgl_reason.profiles import profile_for
from sgl_reason.runtime.thinking_kv.policy import Policy, columns_to_free
from sgl_reason.vote import extract_answer

RULES = ("last32", "last32-pool7", "rkv", "answer", "answer-pool7")
SHARES = (0.1, 0.15, 0.2, 0.25, 0.5)


def pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    return F.max_pool1d(scores.view(1, 1, -1), kernel, stride=1, padding=kernel // 2).view(-1)


def redundancy(keys: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """Per column of ``[lo, hi)``: mean cosine similarity of its keys to the other columns'
    (every layer and KV head averaged), softmax-normalized over the span (R-KV)."""
    total = torch.zeros(hi - lo)
    for k in keys:  # [Hkv, S, D]
        part = F.normalize(k[:, lo:hi].float(), dim=-1)
        sim = part @ part.transpose(1, 2)  # [Hkv, n, n]
        sim.diagonal(dim1=1, dim2=2).zero_()
        total += sim.mean(dim=(0, 2))
    return torch.softmax(total / len(keys), dim=0)


def rule_scores(att: torch.Tensor, keys, prompt: int, marker: int, end: int) -> dict:
    """Scores over columns ``[0, marker)`` for every rule. ``att`` [S, S]: attention probability
    of row i on column j, mean over heads and layers."""
    last32 = att[max(prompt, marker + 1 - 32):marker + 1, :marker].sum(0)
    last8 = att[max(prompt, marker + 1 - 8):marker + 1, :marker].sum(0)
    answer = att[marker + 1:end, :marker].sum(0)
    importance = pool(last8, 7)
    importance = importance / importance[prompt:].sum().clamp_min(1e-12)
    rkv = torch.zeros(marker)
    rkv[prompt:] = 0.1 * importance[prompt:] - 0.9 * redundancy(keys, prompt, marker)
    rkv[:prompt] = rkv[prompt:].min()  # never released: the range table starts after them
    return {"last32": last32, "last32-pool7": pool(last32, 7), "rkv": rkv, "answer": answer,
            "answer-pool7": pool(answer, 7)}


def replay(lm, ids: torch.Tensor, prompt: int, marker: int, freed: torch.Tensor):
    """Teacher-forced answer with ``freed`` columns hidden from rows after the marker: (every
    answer token still the argmax, mean answer NLL)."""
    n = ids.numel()
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    allowed[marker + 1:, freed] = False
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))
    with torch.no_grad():
        logits = lm(ids.unsqueeze(0), attention_mask=mask).logits[0].float()
    pred, target = logits[marker:n - 1], ids[marker + 1:]
    same = bool((pred.argmax(-1) == target).all())
    nll = float(F.cross_entropy(pred, target))
    return same, nll


def decode(lm, ids: torch.Tensor, marker: int, freed: torch.Tensor, eos: int,
           limit: int) -> list[int]:
    """Greedy answer after the marker, every query after it blind to ``freed`` (as served)."""
    with torch.no_grad():
        out = lm(ids[:marker + 1].unsqueeze(0), use_cache=True)
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
        answer = [token]
        while token != eos and len(answer) < limit:
            mask = torch.zeros(1, 1, 1, marker + 1 + len(answer))
            mask[..., freed] = float("-inf")
            out = lm(torch.tensor([[token]]), past_key_values=cache, attention_mask=mask,
                     use_cache=True)
            cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
            answer.append(token)
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=10, help="held-out problems per family")
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--shares", default=",".join(map(str, SHARES)))
    parser.add_argument("--decode", action="store_true",
                        help="also decode each answer free-running under each rule and share: "
                             "final-answer agreement with keep and accuracy")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rules = tuple(args.rules.split(","))
    shares = tuple(float(x) for x in args.shares.split(","))
    torch.manual_seed(0)
    path = prepare(model="reasoner")
    tok = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    profile = profile_for(path.name)
    end_id = tok.convert_tokens_to_ids(profile.end_token)
    problems = problem_set(HELDOUT, limit=args.limit, families=REASONER_FAMILIES)
    rows = {(r, s): [] for r in rules for s in shares}
    rows[("keep", 0)] = []
    freed_share = {(r, s): [] for r in rules for s in shares}
    decoded = {key: [] for key in rows}  # (same final answer as keep, correct)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    t0 = time.time()
    for i, p in enumerate(problems):
        prompt_ids = tok(chat_prompt(p.question, profile), return_tensors="pt",
                         add_special_tokens=False).input_ids[0]
        with torch.no_grad():
            out = lm.generate(prompt_ids.unsqueeze(0), max_new_tokens=900, do_sample=False)[0]
        gen = out[prompt_ids.numel():].tolist()
        if end_id not in gen:
            print(f"{p.id}: no </think> in {len(gen)} tokens; skipped")
            continue
        prompt, marker, n = prompt_ids.numel(), prompt_ids.numel() + gen.index(end_id), out.numel()
        with torch.no_grad():
            fwd = lm(out.unsqueeze(0), output_attentions=True, use_cache=True)
        att = torch.stack([a[0].float().mean(0) for a in fwd.attentions]).mean(0)  # [S, S]
        keys = [fwd.past_key_values.layers[j].keys[0] for j in range(len(fwd.attentions))]
        scores = rule_scores(att, keys, prompt, marker, n)
        none = torch.empty(0, dtype=torch.long)
        rows[("keep", 0)].append(replay(lm, out, prompt, marker, none))
        reference = extract_answer(tok.decode(gen[gen.index(end_id) + 1:],
                                              skip_special_tokens=True))

        def answer_under(freed):
            text = tok.decode(decode(lm, out, marker, freed, eos, n - marker + 16),
                              skip_special_tokens=True)
            got = extract_answer(text)
            return got == reference, p.grade(got)

        if args.decode:
            decoded[("keep", 0)].append(answer_under(none))
        thinking = marker - prompt
        for rule in rules:
            for share in shares:
                policy = Policy("release-on-answer", keep=share)
                freed = columns_to_free(prompt, prompt, thinking, policy, scores[rule])
                rows[(rule, share)].append(replay(lm, out, prompt, marker, freed))
                freed_share[(rule, share)].append(freed.numel() / thinking)
                if args.decode:
                    decoded[(rule, share)].append(answer_under(freed))
        print(f"[{i + 1}/{len(problems)} {time.time() - t0:.0f}s] {p.family} thinking "
              f"{thinking}: " + " ".join(f"{r}@{s}={int(rows[(r, s)][-1][0])}"
                                         for r in rules for s in shares), flush=True)
    report = {}
    for (rule, share), got in rows.items():
        name = rule if rule == "keep" else f"{rule}-{int(share * 100)}%"
        report[name] = {
            "problems": len(got),
            "answer_identical": round(sum(s for s, _ in got) / len(got), 3),
            "answer_nll": round(sum(n for _, n in got) / len(got), 4),
            "freed_fraction": (0.0 if rule == "keep" else round(
                sum(freed_share[(rule, share)]) / len(got), 3)),
        }
        if decoded[(rule, share)]:
            d = decoded[(rule, share)]
            report[name]["answer_agreement"] = round(sum(a for a, _ in d) / len(d), 3)
            report[name]["accuracy"] = round(sum(c for _, c in d) / len(d), 3)
    print("| rule | freed | answer identical | answer NLL | answer agreement | accuracy |\n"
          "|---|---|---|---|---|---|")
    for name, r in report.items():
        print(f"| {name} | {r['freed_fraction']} | {r['answer_identical']} | {r['answer_nll']} "
              f"| {r.get('answer_agreement', '')} | {r.get('accuracy', '')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
