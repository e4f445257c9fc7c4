#!/usr/bin/env bash
# The tiny reasoner's held-out evaluation, beside plain SmolLM2-135M-Instruct in the same run:
# every figure in docs/benchmarks.md ("The tiny reasoner"). Each model gets one server
# (sgl-reason serve), and every eval is a plain `sgl-reason eval` against it.
#   bash benchmarks/reasoner_eval.sh [OUT_DIR] [SUBSET] [SC_SUBSET] [SMOLLM2_BUDGET]
# The reasoner's greedy run covers the whole held-out set (50 per family). The CPU server
# decodes ~70-100 tokens/s at 8 requests, so the other runs use the first SUBSET problems per
# family (default 8: SmolLM2's greedy run and both models' budget runs) and SC_SUBSET per
# arithmetic family for self-consistency (default 10). SmolLM2 never closes its thinking, so its
# budget always binds: it thinks SMOLLM2_BUDGET tokens (default 256). MODELS (default
# "reasoner smollm2") picks the models to run. ADAPTER=RUN/adapter evaluates a trained adapter
# in place of the shipped one (merged into its own folder first). Eval records resume: rerunning
# skips finished problems.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${1:-results/reasoner}
SUBSET=${2:-8}
SC_SUBSET=${3:-10}
SMOLLM2_BUDGET=${4:-256}
DATA=data/reasoner_heldout.jsonl  # 50 problems per family, seed 5,000,000
BIN=.venv/bin
mkdir -p "$OUT"

REASONER=reasoner
if [ -n "${ADAPTER:-}" ]; then
  "$BIN/sgl-reason" model prepare --model reasoner --adapter "$ADAPTER"
  REASONER=$("$BIN/sgl-reason" model path --model reasoner --adapter "$ADAPTER")
fi

serve() {  # serve MODEL PORT: start a server in its own process group, wait until it answers
  local path=$1
  [ "$1" = reasoner ] && path=$REASONER
  setsid "$BIN/sgl-reason" serve --model "$path" --port "$2" > "$OUT/server_$1.log" 2>&1 &
  echo $! > "$OUT/server_$1.pid"
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$2/get_server_info" > /dev/null && return 0
    sleep 1
  done
  echo "server $1 did not start: $OUT/server_$1.log" >&2
  exit 1
}
stop() { [ -f "$OUT/server_$1.pid" ] && kill -TERM -- "-$(cat "$OUT/server_$1.pid")" 2>/dev/null; sleep 6; }

# subset LIMIT OUT FAMILIES: the first LIMIT problems of each of FAMILIES (comma-separated)
subset() {
  python3 -c '
import json, sys
limit, dst, families = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
seen = {}
with open(dst, "w") as f:
    for line in open(sys.argv[4]):
        r = json.loads(line)
        if r["family"] in families and seen.get(r["family"], 0) < limit:
            seen[r["family"]] = seen.get(r["family"], 0) + 1
            f.write(line)
' "$1" "$2" "$3" "$DATA"
}
ARITH=chain_sum,basic_arithmetic,leg_counting
subset "$SUBSET" "$OUT/subset.jsonl" "$ARITH,gsm_symbolic"
subset "$SUBSET" "$OUT/budget_set.jsonl" "$ARITH"
subset "$SC_SUBSET" "$OUT/sc_set.jsonl" "$ARITH"

trap 'stop reasoner; stop smollm2' EXIT
for model in ${MODELS:-reasoner smollm2}; do
  port=$([ "$model" = reasoner ] && echo 30110 || echo 30120)
  full=$([ "$model" = reasoner ] && echo 1536 || echo "$SMOLLM2_BUDGET")
  url="http://127.0.0.1:$port"
  serve "$model" "$port"
  ev() { "$BIN/sgl-reason" eval --url "$url" --concurrency 8 "$@"; }
  # 1. greedy, a budget that does not bind for the reasoner (the code-written traces of the
  #    held-out problems think at most 942 tokens)
  data=$([ "$model" = reasoner ] && echo "$DATA" || echo "$OUT/subset.jsonl")
  ev --data "$data" --program think_then_answer --max-thinking-tokens "$full" \
     --max-answer-tokens 192 --temperature 0 --out "$OUT/${model}_greedy.jsonl"
  # 2. budgets of 25%, 50%, 100% of the reasoner's median natural thinking length (forced close)
  median=$(python3 -c "import json, statistics; print(int(statistics.median( \
r['thinking_tokens'] for r in map(json.loads, open('$OUT/reasoner_greedy.jsonl')) \
if r['family'] in '$ARITH'.split(','))))")
  for pct in 25 50 100; do
    ev --data "$OUT/budget_set.jsonl" --program think_then_answer \
       --max-thinking-tokens $((median * pct / 100)) --max-answer-tokens 192 --temperature 0 \
       --out "$OUT/${model}_budget${pct}.jsonl"
  done
  # 3. self-consistency n = 8 at temperature 0.7 against one sample at the same temperature
  for n in 8 1; do
    ev --data "$OUT/sc_set.jsonl" --program self_consistency --n $n \
       --max-thinking-tokens "$full" --max-answer-tokens 192 --temperature 0.7 \
       --out "$OUT/${model}_sc${n}.jsonl"
  done
  stop "$model"
done
echo "median natural thinking (reasoner, arithmetic families): $median tokens"
shopt -s nullglob  # MODELS may have left one model out
budgets=("$OUT"/reasoner_budget*.summary.json "$OUT"/smollm2_budget*.summary.json)
if [ ${#budgets[@]} -gt 0 ]; then "$BIN/sgl-reason" plot "${budgets[@]}" --out "$OUT/plots"; fi
