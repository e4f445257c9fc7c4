"""How much could any early stop save on the reasoner? Where its answer first appears in its
thinking (issue #19's first bar: >= 40% of thinking-plus-answer tokens saved).

    python3 experiments/answer_position.py SC_RECORDS.jsonl

SC_RECORDS: ``sgl-reason eval --program self_consistency`` records (every sample's thinking,
answer and token counts are kept). For each sample with an answer, the oracle stops its
thinking right after the first place where the thinking writes that answer as a number (not as
a step label, "Step 1"), and still decodes the answer. It saves the thinking after that point,
counted as its share of the thinking's characters times the thinking tokens, over thinking plus
answer tokens. A coincidental early match (an operand equal to the result) only makes the
bound looser. No signal can stop before the answer is on the page and keep it, short of a
lucky guess, so this bounds every early-stop rule on these traces.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict


def saving_bound(thinking: str, answer: str, thinking_tokens: float, answer_tokens: float) -> float:
    number = re.escape(answer.strip())
    match = re.search(rf"(?<![\d.])(?<!Step ){number}(?![\d.])", thinking)
    after = 1.0 - (match.end() / len(thinking) if match else 1.0)
    return after * thinking_tokens / (thinking_tokens + answer_tokens)


def main(path: str) -> dict:
    by_family = defaultdict(list)
    for line in open(path):
        r = json.loads(line)
        for s in r["samples"]:
            if s["answer"] and s["thinking"]:
                by_family[r["family"]].append(saving_bound(
                    s["thinking"], s["answer"], s["thinking_tokens"], s["answer_tokens"]))
    by_family["all"] = [x for v in list(by_family.values()) for x in v]
    result = {f: {"samples": len(v), "saving_bound": round(sum(v) / len(v), 4)}
              for f, v in by_family.items()}
    for f, x in result.items():
        print(f"{f}: {x['samples']} samples, the oracle saves at most {x['saving_bound']:.1%}")
    return result


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
