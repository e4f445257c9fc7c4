#!/usr/bin/env bash
# Decode speed of the real server with the CPU attention's length buckets off and on
# (SGL_REASON_DECODE_BUCKETS=0|1), on a batch of mixed lengths: 6 gsm_symbolic problems that
# think up to a budget of 1,024 beside 18 arithmetic problems of ~430 tokens, all 24 in flight
# at once, greedy, on the tiny reasoner. Each run starts its own embedded server; runs take
# turns (off, on) for ROUNDS rounds, and each prints decoded tokens per second of eval wall time.
#   bash benchmarks/decode_buckets_server.sh [OUT_DIR] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${1:-results/decode_buckets_server}
ROUNDS=${2:-1}
BIN=.venv/bin
mkdir -p "$OUT"
MIX=$OUT/mix.jsonl
python3 - "$MIX" <<'EOF'
import json, sys
want = {"gsm_symbolic": 6, "chain_sum": 6, "basic_arithmetic": 6, "leg_counting": 6}
taken = {f: 0 for f in want}
with open(sys.argv[1], "w") as out:
    for line in open("data/reasoner_heldout.jsonl"):
        family = json.loads(line)["family"]
        if taken[family] < want[family]:
            taken[family] += 1
            out.write(line)
EOF
for round in $(seq "$ROUNDS"); do
  for buckets in 0 1; do
    rec=$OUT/buckets${buckets}_round${round}.jsonl
    rm -f "$rec" "${rec%.jsonl}.summary.json"
    SGL_REASON_DECODE_BUCKETS=$buckets "$BIN/sgl-reason" eval --model reasoner --data "$MIX" \
      --concurrency 24 --program think_then_answer --max-thinking-tokens 1024 \
      --max-answer-tokens 128 --temperature 0 --out "$rec" > "$OUT/buckets${buckets}_round${round}.log" 2>&1
    python3 - "${rec%.jsonl}.summary.json" "$buckets" "$round" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
tokens = s["tokens_per_problem"] * s["problems"]
print(f"round {sys.argv[3]} buckets {'on ' if sys.argv[2] == '1' else 'off'}: "
      f"{tokens:.0f} tokens in {s['wall_seconds']:.1f} s = {tokens / s['wall_seconds']:.1f} "
      f"tokens/s, accuracy {s['accuracy']:.3f}")
EOF
  done
done
