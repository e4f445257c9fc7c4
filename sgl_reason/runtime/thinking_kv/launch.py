"""Launch-time flags and checks: every setting that cannot work fails before serving.

Runs in the launcher process (``ServerArgs`` hooks from ``runtime.flags``); the flags are
exported to the environment, where the scheduler's :func:`Policy.from_env` reads them.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from sgl_reason.runtime.flags import export_to, has_flag
from sgl_reason.runtime.thinking_kv.policy import (
    DEFAULT_OBSERVE,
    DEFAULT_SINK,
    DEFAULT_WINDOW,
    ENV,
    POLICIES,
    REQUEST_KEYS,
    SCORE_REDUCTIONS,
    Policy,
    parse_keep,
)

BACKEND = "sgl-reason"
# the one attention path that skips freed columns and records scores (runtime/cpu_attention.py)
SUPPORTED_ATTENTION = "torch_native"


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    if has_flag(parser, "--thinking-kv-policy"):
        return
    parser.add_argument(
        "--thinking-kv-policy", choices=POLICIES, default=None, action=export_to(ENV["policy"]),
        help="(sgl-reason) what happens to a reasoning request's thinking KV: keep (stock), "
             "strip (freed at finish, only the prompt is cached), demote (cached, evicted "
             "first), release-on-answer (freed as soon as the answer starts, but the first "
             "--thinking-kv-sink and last --thinking-kv-window tokens and the "
             "--thinking-kv-keep best-scored ones) or release-on-pressure (the same tokens, "
             "freed lowest score first only when the next decode step would not fit, before "
             "SGLang retracts a request). Implies "
             f"--radix-cache-backend {BACKEND}. Per request: custom_params "
             f"{{\"{REQUEST_KEYS['policy']}\": ...}}",
    )
    parser.add_argument(
        "--thinking-kv-window", type=int, default=None, action=export_to(ENV["window"]),
        help=f"(sgl-reason) thinking tokens kept before the end marker (default {DEFAULT_WINDOW})",
    )
    parser.add_argument(
        "--thinking-kv-sink", type=int, default=None, action=export_to(ENV["sink"]),
        help=f"(sgl-reason) first thinking tokens kept (default {DEFAULT_SINK})",
    )
    parser.add_argument(
        "--thinking-kv-keep", default=None, action=export_to(ENV["keep"]),
        help="(sgl-reason) scored retention at release: also keep the thinking tokens the end "
             "of thinking attends to most, as a fraction of the thinking (0.1 or 10%%) or a "
             "token count (64). Default: none (sink and window only)",
    )
    parser.add_argument(
        "--thinking-kv-score", choices=SCORE_REDUCTIONS, default=None,
        action=export_to(ENV["score"]),
        help="(sgl-reason) a token's score aggregates attention over heads and layers by their "
             "mean (default) or max",
    )
    parser.add_argument(
        "--thinking-kv-observe", type=int, default=None, action=export_to(ENV["observe"]),
        help="(sgl-reason) last decode steps of the thinking (the one reading the end marker "
             f"included) whose attention makes the scores (default {DEFAULT_OBSERVE})",
    )
    parser.add_argument(
        "--think-end", default=None, action=export_to(ENV["think_end"]),
        help="(sgl-reason) end-of-thinking marker text (default: the model profile's)",
    )


def think_end_for(model_path: str) -> tuple[str, str]:
    """(marker text, where it came from): the flag, else the model's profile."""
    text = os.environ.get(ENV["think_end"])
    if text is not None:
        return text, "--think-end"
    from sgl_reason.profiles import profile_for

    profile = profile_for(model_path)
    return profile.end_marker, f"the {profile.name!r} profile"


def release_supported(server_args) -> list[str]:
    """Why a releasing policy cannot run with these settings (empty: it can).

    Freed columns point at slot 0; anything that reads a row without knowing that (another
    attention path, a captured graph, a host copy of the row, a KV transfer, a session that
    reuses the row) would read or move the wrong KV, so each of those is refused here."""
    from sgl_reason.runtime import cpu_attention

    problems = []
    if server_args.attention_backend != SUPPORTED_ATTENTION or not cpu_attention.enabled():
        problems.append(f"it needs the plugin's CPU attention (--attention-backend "
                        f"{SUPPORTED_ATTENTION}, {cpu_attention.ENV} not 0), the only one that "
                        "skips freed columns")
    for phase in ("prefill", "decode"):  # a per-phase backend overrides --attention-backend
        chosen = getattr(server_args, f"{phase}_attention_backend", None)
        if chosen not in (None, SUPPORTED_ATTENTION):
            problems.append(f"--{phase}-attention-backend {chosen} does not skip freed columns "
                            f"(supported: {SUPPORTED_ATTENTION})")
    if server_args.page_size not in (None, 1):
        problems.append("it needs --page-size 1")
    if server_args.speculative_algorithm:
        problems.append("speculative decoding is not supported")
    if server_args.enable_mixed_chunk:
        problems.append("--enable-mixed-chunk is not supported")
    if getattr(server_args, "enable_torch_compile", False):
        problems.append("--enable-torch-compile (a captured graph reads rows without the "
                        "freed columns) is not supported")
    on_cpu = _resolved(server_args, "device", "cpu") in ("cpu", None)
    if not on_cpu and not _resolved(server_args, "disable_cuda_graph", True):
        problems.append("CUDA graphs (add --disable-cuda-graph)")
    # With overlap scheduling, a release is decided while the next batch is already launched.
    # On CPU that forward has run to completion (no streams), so freeing is safe; on a GPU it
    # may still be reading the row.
    if not on_cpu and not _resolved(server_args, "disable_overlap_schedule", True):
        problems.append("overlap scheduling on a GPU would free slots the batch in flight may "
                        "still read (add --disable-overlap-schedule)")
    if getattr(server_args, "enable_hierarchical_cache", False):
        problems.append("--enable-hierarchical-cache (its host copies move rows with freed "
                        "columns) is not supported")
    if getattr(server_args, "disaggregation_mode", "null") not in ("null", None):
        problems.append(f"--disaggregation-mode {server_args.disaggregation_mode} (its KV "
                        "transfer moves rows with freed columns) is not supported")
    if getattr(server_args, "enable_streaming_session", False):
        problems.append("--enable-streaming-session (a session's next turn reuses the row, "
                        "freed columns included) is not supported")
    return problems


def _resolved(server_args, name: str, default):
    """A setting as SGLang resolved it (its resolution declares some, e.g. no overlap
    scheduling on CPU, over the field), else the field."""
    try:
        from sglang.srt.arg_groups.model_override_base import resolved_view

        return getattr(resolved_view(server_args), name, default)
    except Exception:  # a plain namespace (tests) or another SGLang layout
        return getattr(server_args, name, default)


def requested(server_args) -> bool:
    return server_args.radix_cache_backend == BACKEND or any(
        os.environ.get(name) is not None for name in ENV.values())


def prepare(server_args) -> None:
    """Before SGLang resolves the arguments: the flags imply the backend (and, for demote,
    priority eviction)."""
    if not requested(server_args):
        return
    backend = server_args.radix_cache_backend
    if backend not in (None, BACKEND):
        raise ValueError(f"--thinking-kv-* flags need --radix-cache-backend {BACKEND}, "
                         f"not {backend!r}. Drop --radix-cache-backend or set it to {BACKEND}.")
    server_args.radix_cache_backend = BACKEND
    policy = Policy.from_env()  # raises on an unknown policy, a negative window or sink
    if policy.name == "demote":
        if server_args.radix_eviction_policy not in ("lru", "priority"):
            raise ValueError("--thinking-kv-policy demote orders eviction by node priority; it "
                             f"cannot run with --radix-eviction-policy "
                             f"{server_args.radix_eviction_policy}. Drop that flag.")
        server_args.radix_eviction_policy = "priority"


def check_window(policy: Policy, context: int) -> None:
    if policy.window + policy.sink >= context:
        raise ValueError(f"--thinking-kv-window {policy.window} + --thinking-kv-sink "
                         f"{policy.sink} >= the context length {context}: no thinking could "
                         "ever be released. Use a smaller window.")


def _config_context(model_path: str) -> int | None:
    """The model's context length from its local ``config.json`` (None if not a local folder)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("max_position_embeddings")


def validate(server_args) -> None:
    """Launch-time checks (launcher process): every bad setting fails here, before serving."""
    if not requested(server_args):
        return
    parse_keep(os.environ.get(ENV["keep"]))  # a clear error for a malformed --thinking-kv-keep
    policy = Policy.from_env()
    marker, source = think_end_for(server_args.model_path)
    if not marker.strip():
        raise ValueError(f"No end-of-thinking marker: {source} gives {marker!r}. Pass "
                         "--think-end TEXT (the text the model writes when thinking ends).")
    if policy.releases:
        problems = release_supported(server_args)
        if problems:
            raise ValueError(f"--thinking-kv-policy {policy.name}: " + "; ".join(problems)
                             + ". Supported elsewhere: keep, strip, demote.")
    context = server_args.context_length or _config_context(server_args.model_path)
    if context is not None:
        check_window(policy, context)
