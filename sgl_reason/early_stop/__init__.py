"""Early stop: stop thinking (or sampling) once the answer is settled.

One interface, :class:`Signal`, one registry; a signal is chosen by name in :class:`EarlyStop`:

| signal | used by | stops when |
|---|---|---|
| ``entropy`` | think_then_answer, self-consistency branches | mean top-k entropy over the last ``window`` tokens < ``threshold`` (0.1) |
| ``probe`` | think_then_answer | the last ``probe_agree`` probes ("...final answer:") extract the same answer; a probe counts if it ended its line within ``probe_tokens`` and its mean token probability is >= ``probe_confidence`` (0) |
| ``confidence`` | self-consistency branches | lowest sliding-window group confidence < ``threshold``: the trace is dropped; votes weighted by confidence |
| ``consensus`` | self_consistency | a window of ``batch`` samples is unanimous, or P(majority share > 1/2) >= ``confidence_level`` (Beta posterior) |
| ``none`` | baselines | never: the full budget, chunked like the others |

Thinking is generated in chunks of ``chunk_tokens``; every chunk and probe is a new request whose
prompt is the text so far, so the radix cache serves it and only the new tokens are prefilled.
"""

from sgl_reason.early_stop.base import (
    SIGNALS, Chunk, EarlyStop, Probe, Signal, StopDecision, get_signal, token_entropies,
)
from sgl_reason.early_stop import confidence, consensus, entropy, none, probe  # noqa: F401  (register)

__all__ = ["SIGNALS", "Chunk", "EarlyStop", "Probe", "Signal", "StopDecision", "get_signal",
           "token_entropies"]
