"""The ``sgl-reason`` command line: ``model``, ``serve`` (and, later, ``bench``, ``eval``)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

logger = logging.getLogger("sgl_reason")


def _cmd_model(args: argparse.Namespace) -> int:
    from sgl_reason import model

    if args.action == "train-reasoner":
        return _cmd_train(args)
    if args.adapter:  # a trained adapter other than the shipped one
        if args.model != model.REASONER:
            raise SystemExit("--adapter is the reasoner's: add --model reasoner")
        path = model.adapter_path(args.adapter, args.dtype)
        prepared = model.is_prepared(path, model.adapter_sha256(args.adapter))
        again = f"--model reasoner --adapter {args.adapter}"
    else:
        path = model.model_path(args.model, args.dtype)
        prepared, again = model.is_prepared(path), f"--model {args.model}"
    if args.action == "path":
        if not prepared:
            print(f"not prepared: run `sgl-reason model prepare {again}` (would be {path})",
                  file=sys.stderr)
            return 1
        print(path)
        return 0
    start = time.monotonic()
    already = prepared and not args.force
    if args.adapter:
        path = model.prepare_adapter(args.adapter, dtype=args.dtype, force=args.force)
    else:
        path = model.prepare(dtype=args.dtype, force=args.force, model=args.model)
    verb = "already prepared" if already else f"prepared in {time.monotonic() - start:.1f} s"
    print(f"{path} ({verb})")
    return 0


def _counts(text: str) -> dict[str, int]:
    """``chain_sum=400,leg_counting=100`` -> traces per family (families from the traces'
    own list)."""
    from sgl_reason.reasoner.traces import FAMILIES

    counts = {}
    for item in text.split(","):
        name, _, n = item.partition("=")
        if name.strip() not in FAMILIES or not n.strip().isdigit():
            raise SystemExit(f"--counts: {item!r} is not FAMILY=N with FAMILY one of "
                             f"{', '.join(FAMILIES)}")
        counts[name.strip()] = int(n)
    return counts


def _cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sgl_reason import model
    from sgl_reason.reasoner.train import TrainConfig, train

    from pydantic import ValidationError

    defaults = TrainConfig()
    counts = _counts(args.counts) if args.counts else defaults.counts
    try:
        config = TrainConfig(
            counts={f: max(1, round(n * args.scale)) for f, n in counts.items()},
            seed=args.seed, device=args.device, init_adapter=args.init_adapter,
            lr=args.lr or defaults.lr, decision_weight=args.decision_weight,
            max_len=args.max_len or defaults.max_len,
        )
    except ValidationError as error:
        for e in error.errors():
            where = ".".join(map(str, e["loc"]))
            msg = e["msg"].removeprefix("Value error, ")
            print(f"sgl-reason: error: {where + ': ' if where else ''}{msg}", file=sys.stderr)
        return 2
    stats = train(model.prepare(), Path(args.out), config)
    print(f"trained {stats['steps']} steps, {stats['tokens_trained']:,} tokens in "
          f"{stats['train_seconds']:.0f} s ({stats['tokens_per_second']} tokens/s); "
          f"adapter in {args.out}/adapter, loss curve {args.out}/loss.png")
    return 0


def _cmd_serve(args: argparse.Namespace, sglang_args: list[str]) -> int:
    from sgl_reason.runtime.server import ServerProcess

    ready = False

    def show(line: str) -> None:  # SGLang's start-up log only with -v: its 500-line usage
        if ready or args.verbose:  # text would bury the one line that names a bad flag
            print(line, flush=True)

    server = ServerProcess(
        model=args.model, host=args.host, port=args.port, extra_args=sglang_args,
        log_sink=show,
    )
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    try:
        print(f"sgl-reason: starting SGLang on {server.url} (its log: -v) ...", flush=True)
        server.start(timeout=args.startup_timeout)
        ready = True
        print(
            f"sgl-reason: SGLang server ready at {server.url} in "
            f"{time.monotonic() - started:.1f} s (pid {server.pid}); Ctrl-C stops it.",
            flush=True,
        )
        server.proc.wait()
        print(f"sgl-reason: server exited with code {server.proc.returncode}", file=sys.stderr)
        return server.proc.returncode or 1
    except KeyboardInterrupt:
        print("sgl-reason: stopping the server ...", file=sys.stderr, flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # no second interrupt mid-cleanup
        server.stop()


def _cmd_gateway(args: argparse.Namespace) -> int:
    import contextlib

    import uvicorn

    from sgl_reason.connection import connect
    from sgl_reason.service import Service, ServiceConfig, create_app

    try:
        config = ServiceConfig(**{k: getattr(args, k) for k in ServiceConfig.model_fields})
    except ValueError as error:
        print(f"sgl-reason: error: {str(error).splitlines()[-1].strip()}", file=sys.stderr)
        return 2
    if args.upstream and args.server_arg:
        print("sgl-reason: error: --server-arg configures the embedded server; the server at "
              "--upstream runs with its own flags", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if args.upstream:
            backend = stack.enter_context(connect(args.upstream))
        else:
            backend = stack.enter_context(connect(
                model=args.model, extra_args=["--thinking-kv-policy", "keep", *args.server_arg]))
        service = Service(backend, config, args.served_model_name or backend.get_model_name())
        print(f"sgl-reason: gateway on http://{args.host}:{args.port}/v1 (model id "
              f"{service.model_id!r}) -> {backend.base_url}", flush=True)
        uvicorn.run(create_app(service), host=args.host, port=args.port, log_level="warning")
    return 0


def _options(pairs: list[str], fields=None) -> dict[str, str]:
    """``KEY=VALUE`` strings as keyword arguments (pydantic converts and validates the values);
    a key that is not one of ``fields`` is refused with the list of valid ones."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{pair!r} is not KEY=VALUE: write e.g. probe_confidence=0.4")
        key = key.strip().replace("-", "_")
        if fields is not None and key not in fields:
            import difflib

            near = difflib.get_close_matches(key, fields, n=1)
            hint = f" Did you mean {near[0]}?" if near else ""
            raise ValueError(f"{key!r} is not an option.{hint} Options: {', '.join(sorted(fields))}")
        options[key] = value.strip()
    return options


def _int_or_tier(value: str) -> int | str:
    from sgl_reason.programs.budget import TIERS

    if value in TIERS:
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer or one of {sorted(TIERS)}, got {value!r}") from None


# best_of_n's verifiers by name: sgl_reason.programs.<name>_verifier
VERIFIERS = ("arithmetic", "p_yes")


def _program(args: argparse.Namespace, think, extra: dict):
    """The program ``eval`` runs on each question, its options bound (``evaluate.run`` passes
    each problem its own cancellable backend)."""
    import functools

    from sgl_reason import programs

    if args.program == "think_then_answer":
        return functools.partial(programs.think_then_answer, budget=think, **extra)
    if args.program == "self_consistency":
        return functools.partial(programs.self_consistency, n=args.n, max_tokens=args.max_tokens,
                                 think=think, **extra)
    verifier = getattr(programs, f"{args.verifier or 'p_yes'}_verifier")
    return functools.partial(programs.best_of_n, n=args.n, max_tokens=args.max_tokens,
                             think=think, verifier=verifier, **extra)


def _cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sgl_reason import evaluate, programs
    from sgl_reason.data import DataError, load

    try:
        problems = load(args.data)
    except DataError as error:
        print(f"sgl-reason: error: {error}", file=sys.stderr)
        return 2
    if args.families:
        problems = [p for p in problems if p.family in args.families]
        if not problems:
            print(f"sgl-reason: error: no problem of --families {','.join(args.families)} in "
                  f"{args.data}", file=sys.stderr)
            return 2
    if args.limit is not None:
        problems = problems[: args.limit]
    if args.url and args.model:
        print("sgl-reason: error: --model chooses the embedded server's model; a server at "
              "--url serves its own", file=sys.stderr)
        return 2
    out = Path(args.out or f"results/{args.program}.jsonl")
    think = None
    if args.max_thinking_tokens is not None or args.program == "think_then_answer":
        think = programs.ThinkingBudget(
            max_thinking_tokens=args.max_thinking_tokens or "low",
            max_answer_tokens=args.max_answer_tokens,
        )
    early = {}
    if args.verifier and args.program != "best_of_n":
        print(f"sgl-reason: error: --verifier scores best_of_n's candidates; --program "
              f"{args.program} has none (use --program best_of_n)", file=sys.stderr)
        return 2
    if args.early_stop and args.program == "best_of_n":
        print("sgl-reason: error: --early-stop applies to self_consistency and "
              "think_then_answer, not best_of_n", file=sys.stderr)
        return 2
    if args.early_stop_option and not args.early_stop:
        print("sgl-reason: error: --early-stop-option needs --early-stop SIGNAL", file=sys.stderr)
        return 2
    if args.early_stop:
        from sgl_reason.early_stop import EarlyStop

        try:
            options = _options(args.early_stop_option, set(EarlyStop.model_fields) - {"signal"})
            config = EarlyStop(signal=args.early_stop, **options)
            if think is not None and args.early_stop != "consensus":
                config.check_budget(think.thinking_tokens)
        except ValueError as error:
            print(f"sgl-reason: error: --early-stop: {error}", file=sys.stderr)
            return 2
        early = {"early_stop": config}
    if args.vote_weights != "equal":
        if args.program != "self_consistency":
            print(f"sgl-reason: error: --vote-weights weighs self_consistency's vote; --program "
                  f"{args.program} has none", file=sys.stderr)
            return 2
        from sgl_reason.vote import VoteConfig

        early["vote_config"] = VoteConfig(weigh=args.vote_weights)
    if args.min_p is not None and (args.temperature is None or not 0 <= args.min_p <= 1):
        print("sgl-reason: error: --min-p takes a share from 0 to 1 and needs --temperature "
              "(the sampling it trims)", file=sys.stderr)
        return 2
    if args.temperature is not None:
        from sgl_reason.profiles import Sampling

        early["sampling"] = Sampling(temperature=args.temperature, min_p=args.min_p or 0.0)
    # the model: the embedded server's name, or the folder the server at --url reports
    info = {"program": args.program, "model": args.url or args.model or "smollm2",
            "data": args.data,
            "n": None if args.program == "think_then_answer" else args.n,
            "budget": think.thinking_tokens if think is not None else None,
            "early_stop": args.early_stop, "verifier": args.verifier,
            "vote_weights": args.vote_weights, "temperature": args.temperature,
            "min_p": args.min_p}
    if problems and not evaluate.pending(problems, out):
        print(f"every problem already has a record in {out}: nothing to run, no server "
              "started (delete the file to run again)", file=sys.stderr)
        summary = evaluate.finish(problems, out, info=info)
    else:
        from sgl_reason.connection import connect

        with connect(args.url, model=args.model, extra_args=args.server_arg) as backend:
            if args.url:
                info["model"] = backend.server_info.get("model_path") or args.url
            summary = evaluate.run(_program(args, think, early), problems, out,
                                   concurrency=args.concurrency, info=info, backend=backend)
    print(evaluate.summary_table(summary))
    print(f"records: {out}\nsummary: {evaluate.summary_path(out)}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from sgl_reason.plot import plot

    try:
        written = plot(args.results, args.out)
    except (FileNotFoundError, ValueError) as error:
        print(f"sgl-reason: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"sgl_reason.bench.{args.bench.replace('-', '_')}")
    return module.main(args)


def _shape(text: str) -> tuple[int, int, int]:
    from sgl_reason.bench.thinking_kv import parse_shape

    try:
        return parse_shape(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _rows(text: str) -> tuple[str, ...]:
    from sgl_reason.bench.early_stop import check_rows

    try:
        return check_rows(name.strip() for name in text.split(",") if name.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _model_name(text: str) -> str:
    from sgl_reason.model import MODEL_NAMES

    if text not in MODEL_NAMES:
        raise argparse.ArgumentTypeError(
            f"unknown model {text!r}; known models: {', '.join(MODEL_NAMES)}")
    return text


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    from sgl_reason.runtime.server import describe_cpu_defaults

    parser = argparse.ArgumentParser(prog="sgl-reason", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("model", help="prepare, locate or train the offline models")
    p.add_argument("action", choices=["prepare", "path", "train-reasoner"])
    p.add_argument("--model", default="smollm2", type=_model_name,
                   help="prepare/path: reasoner (sgl-reason's tiny reasoner) or smollm2 "
                   "(the plain SmolLM2-135M-Instruct; default)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--force", action="store_true", help="convert again even if prepared")
    p.add_argument("--adapter", metavar="DIR",
                   help="prepare/path with --model reasoner: merge this trained adapter (a "
                   "train-reasoner run's adapter/ folder) instead of the shipped one, into its "
                   "own folder, to serve or evaluate before shipping it")
    p.add_argument("--out", default="runs/reasoner",
                   help="train-reasoner: run folder (a rerun resumes from its checkpoint)")
    p.add_argument("--device", default="cpu", help="train-reasoner: cpu or cuda")
    p.add_argument("--seed", type=int, default=1_000_000, help="train-reasoner: data and init seed")
    p.add_argument("--scale", type=float, default=1.0,
                   help="train-reasoner: fraction of the default number of traces (pilot: 0.05)")
    p.add_argument("--counts", metavar="FAMILY=N[,...]",
                   help="train-reasoner: traces per family instead of the default mix "
                   "(scaled by --scale)")
    p.add_argument("--init-adapter", metavar="DIR",
                   help="train-reasoner: continue from this adapter folder instead of zeros "
                   "(the shipped one: sgl_reason/reasoner/adapter)")
    p.add_argument("--lr", type=float, help="train-reasoner: peak learning rate (default 1e-3)")
    p.add_argument("--max-len", type=int,
                   help="train-reasoner: longest trace trained on, in tokens with its prompt "
                   "(default 768; longer ones are left out and counted)")
    p.add_argument("--decision-weight", type=float, default=1.0,
                   help="train-reasoner: loss weight of digit, comparison, borrow/carry and "
                   "verdict tokens (default 1: every token alike)")

    p = sub.add_parser(
        "serve",
        help="start the real SGLang HTTP server (unknown flags go to sglang.launch_server)",
        description="Start SGLang's HTTP server. Flags not listed here are passed to "
        "sglang.launch_server unchanged. Without CUDA, CPU defaults apply unless overridden: "
        f"{describe_cpu_defaults()} (it lets clients send code the server runs). Host "
        "127.0.0.1 unless --host says otherwise.",
    )
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="reasoner, smollm2 or a local model folder (default: the prepared "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds")

    p = sub.add_parser(
        "gateway", help="OpenAI-compatible reasoning service in front of an SGLang server",
        description="POST /v1/chat/completions with reasoning_effort tiers, max_thinking_tokens, "
        "early stop, n > 1 as prefix-shared self-consistency, reasoning_content and the cost "
        "ledger in usage; /v1/models; /metrics. Without --upstream it starts an embedded "
        "server (--model, default the tiny reasoner, with the thinking-KV cache).")
    p.add_argument("--upstream", default=None, help="an SGLang server or sglang-router URL")
    p.add_argument("--model", default="reasoner", type=_model_name,
                   help="the embedded server's model (without --upstream)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the upstream's model path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30100)
    # ServiceConfig's fields (a test keeps the two equal; importing it here would cost seconds)
    p.add_argument("--max-n", type=int, default=16, help="most samples per request")
    p.add_argument("--max-thinking-tokens", type=int, default=65536,
                   help="most thinking tokens a request may ask for")
    p.add_argument("--max-answer-tokens", type=int, default=1024,
                   help="most answer tokens (max_tokens) a request may ask for")
    p.add_argument("--default-answer-tokens", type=int, default=512,
                   help="answer tokens when a request names none")
    p.add_argument("--max-concurrency", type=int, default=8,
                   help="requests in flight; more are answered 429")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="seconds before a request is aborted (504)")
    p.add_argument("--default-effort", choices=("low", "medium", "high"), default="low",
                   help="tier when a request names neither reasoning_effort nor a budget")
    p.add_argument("--normalize-prompt", action=argparse.BooleanOptionalAction, default=True,
                   help="normalize message whitespace so drifted prompts share the cache")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra sglang.launch_server flag for the embedded server (repeatable)")

    p = sub.add_parser("eval", help="run a program over a data set; resumable JSONL + summary")
    p.add_argument("--program", required=True,
                   choices=["self_consistency", "think_then_answer", "best_of_n"])
    p.add_argument("--data", required=True,
                   help="JSONL with question/answer fields, or reasoning-gym:NAME[?size=K&seed=S]")
    p.add_argument("--n", type=int, default=4, help="samples or candidates per problem")
    p.add_argument("--verifier", choices=VERIFIERS, default=None,
                   help="best_of_n's verifier: p_yes asks the model (default), arithmetic "
                   "recomputes the candidate's written arithmetic")
    p.add_argument("--limit", type=int, default=None, help="first K problems only")
    p.add_argument("--max-tokens", type=int, default=256, help="per sample without thinking")
    p.add_argument("--max-thinking-tokens", type=_int_or_tier, default=None,
                   help="thinking budget (an integer or low/medium/high)")
    p.add_argument("--max-answer-tokens", type=int, default=256)
    p.add_argument("--early-stop", default=None,
                   help="early-stop signal: entropy, probe, confidence (thinking or branches), "
                   "consensus (self_consistency)")
    p.add_argument("--early-stop-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an EarlyStop field, e.g. probe_confidence=0.4 (repeatable)")
    p.add_argument("--vote-weights", choices=("equal", "confidence"), default="equal",
                   help="self_consistency: confidence weighs each trace's vote by its lowest "
                   "32-token group confidence (DeepConf offline; its samples record it as score)")
    p.add_argument("--concurrency", type=int, default=2, help="problems in flight")
    p.add_argument("--model", default=None,
                   help="the embedded server's model: reasoner, smollm2 or a local folder "
                   "(default: smollm2)")
    p.add_argument("--families", type=_names, default=None, metavar="NAME[,NAME]",
                   help="only problems whose 'family' field is one of these")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (0: greedy; default: the model profile's)")
    p.add_argument("--min-p", type=float, default=None, metavar="P",
                   help="with --temperature: sample only tokens at least P times as likely as "
                   "the likeliest (min-p; default 0, off)")
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra sglang.launch_server flag for the embedded server (repeatable)")
    p.add_argument("--out", default=None, help="records JSONL (default results/PROGRAM.jsonl)")

    p = sub.add_parser("plot", help="PNG charts from eval results and benchmark JSON")
    p.add_argument("results", nargs="+")
    p.add_argument("--out", default="plots", help="folder for the PNG files")

    p = sub.add_parser("bench", help="benchmarks, each against its baseline in the same run")
    benches = p.add_subparsers(dest="bench", required=True)
    b = benches.add_parser("prefix-sharing", help="single vs N naive vs N forked samples")
    b.add_argument("--n", type=int, default=8)
    b.add_argument("--prompt-tokens", type=int, default=2000)
    b.add_argument("--new-tokens", type=int, default=32)
    b = benches.add_parser("early-stop", help="tokens saved and answers kept by each signal")
    b.add_argument("--model", default="reasoner", type=_model_name,
                   help="embedded server's model (default: reasoner)")
    b.add_argument("--data", default=None, metavar="FILE.jsonl",
                   help="graded problems (question, answer, family); default: --dataset")
    b.add_argument("--families", type=_names, default=None, metavar="NAME[,NAME]",
                   help="with --data: only these families")
    b.add_argument("--dataset", type=_names, default=("chain_sum", "basic_arithmetic", "leg_counting"),
                   metavar="NAME[,NAME]", help="reasoning-gym families (the reasoner's get its "
                   "config); default: chain_sum,basic_arithmetic,leg_counting")
    b.add_argument("--limit", type=int, default=50, help="problems per family")
    b.add_argument("--seed", type=int, default=0,
                   help="reasoning-gym seed; item i is drawn from seed + i, so sets whose seeds "
                   "are less than --limit apart share problems (use e.g. 0, 1000, 2000)")
    b.add_argument("--budget", type=int, default=1536,
                   help="thinking budget in tokens (default: one the reasoner never reaches)")
    b.add_argument("--answer-tokens", type=int, default=192, help="answer tokens at most")
    b.add_argument("--chunk", type=int, default=16,
                   help="tokens per checked chunk (Dynasor probes every 32 tokens of traces "
                   "~10x longer than the reasoner's)")
    b.add_argument("--n", type=int, default=8, help="self-consistency rows: samples voted")
    b.add_argument("--sc-limit", type=int, default=10,
                   help="self-consistency rows: the first K problems of each family")
    b.add_argument("--concurrency", type=int, default=8,
                   help="problems in flight (1: bit-reproducible rows, see docs/benchmarks.md)")
    b.add_argument("--rows", type=_rows, default=None, metavar="NAME[,NAME]",
                   help="run only these rows besides full (default: all but full_repeat): "
                   "half_budget, entropy, probe, probe_agree3, probe_confident, probe_cue, "
                   "confidence, full_repeat, consensus, deepconf_low, deepconf_high")
    b = benches.add_parser("fp8-kv", help="16-bit vs low-bit KV schemes (FP8, int8, 16-bit windows)")
    b.add_argument("--tokens", type=int, default=2000, help="teacher-forced sequence length (about)")
    b.add_argument("--rounds", type=int, default=7,
                   help="decode rounds; each row's ratio is the median over rounds")
    b.add_argument("--model", default="reasoner", type=_model_name,
                   help="every row's model (default: reasoner)")
    b.add_argument("--accuracy", type=int, default=20, metavar="N",
                   help="held-out problems per family for the reasoner's accuracy per scheme "
                        "(0: skip)")
    b.add_argument("--no-fp32-reference", dest="fp32_reference", action="store_false",
                   help="skip measuring every row (16-bit too) against the same weights in fp32")
    b.add_argument("--rows", type=lambda v: [x for x in v.split(",") if x], default=None,
                   metavar="NAME[,NAME]", help="run only these rows besides bf16: per_tensor, "
                   "per_tensor_calibrated, per_token, int8_per_token, int8_win64, int8_win_all")
    b = benches.add_parser("thinking-kv", help="stock vs each thinking-KV policy at a fixed pool")
    b.add_argument("--requests", type=int, default=10, help="requests sent at once per row")
    b.add_argument("--max-total-tokens", type=int, default=1400, help="the KV pool, in tokens")
    b.add_argument("--shape", type=_shape, default="32,256,256",
                   help="prompt,thinking,answer tokens (the default also runs 32,400,100)")
    b.add_argument("--workload", choices=("forced", "problems"), default="forced",
                   help="forced: every request forced to --shape (stock vs each policy at a "
                        "fixed pool); problems: the reasoner at natural lengths on graded "
                        "problems, each release rule against keep")
    b.add_argument("--data", default=None, metavar="FILE.jsonl",
                   help="problems workload: graded problems with a family field (default: "
                        "the reasoner's held-out set, data/reasoner_heldout.jsonl)")
    b.add_argument("--limit", type=int, default=34, help="problems workload: per family")
    b.add_argument("--rows", type=_names, default=None, metavar="NAME[,NAME]",
                   help="problems workload: rows besides keep (default: keep_repeat, "
                        "release-on-answer, scored-5%%, scored-10%%, scored-25%%, scored-50%%; "
                        "also scored-10%%-max)")
    b.add_argument("--concurrency", type=int, default=16,
                   help="problems workload: --max-running-requests of its server")
    b.add_argument("--model", default="smollm2", type=_model_name,
                   help="forced workload's model (default: smollm2; the problems workload "
                        "always runs the reasoner)")
    b = benches.add_parser("prompt-drift", help="prefix-cache hit rate under whitespace drift, "
                           "raw vs normalized prompts")
    b.add_argument("--requests", type=int, default=24, help="requests per stream")
    b.add_argument("--seed", type=int, default=0, help="questions and drifts")
    b.add_argument("--model", default="reasoner", type=_model_name,
                   help="embedded server's model (default: reasoner)")
    b = benches.add_parser("agent", help="K-step agent carrying answers vs carrying all thinking")
    b.add_argument("--steps", type=int, default=30)
    b.add_argument("--seed", type=int, default=0, help="the plan's numbers")
    b.add_argument("--plan", choices=("farm", "till"), default="farm",
                   help="farm: independent leg-counting steps; till: each step on the last answer")
    b.add_argument("--step-budget", type=int, default=128, help="thinking tokens per step, at most")
    b.add_argument("--total-budget", type=int, default=None,
                   help="thinking tokens for the run; steps get a fair share of what is left")
    b.add_argument("--agents", type=int, default=1,
                   help="agents at once on the server, each with its own questions")
    b.add_argument("--max-total-tokens", type=int, default=None,
                   help="the embedded server's KV pool (default: SGLang's)")
    b.add_argument("--model", default="reasoner", type=_model_name,
                   help="embedded server's model (default: reasoner)")
    b = benches.add_parser("service", help="the gateway: n=8 vs n=1 prefill, overhead vs "
                           "calling the program, a mixed-tier load run")
    b.add_argument("--reps", type=int, default=3, help="alternated gateway/direct calls")
    b.add_argument("--requests", type=int, default=24, help="requests of the load run")
    b.add_argument("--concurrency", type=int, default=4, help="load run: requests in flight")
    b.add_argument("--model", default="reasoner", type=_model_name,
                   help="embedded server's model (default: reasoner)")
    b = benches.add_parser("soak", help="mixed load, aborts, disconnects and hostile input on "
                           "a small pool; every request and KV slot accounted for")
    b.add_argument("--requests", type=int, default=1000,
                   help="requests in all, shared evenly by the rows")
    b.add_argument("--seconds", type=float, default=3600,
                   help="stop sending to a row after this long")
    b.add_argument("--concurrency", type=int, default=16)
    b.add_argument("--max-total-tokens", type=int, default=1536,
                   help="the KV pool, small enough that SGLang retracts requests")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--rows", type=_names, default=("bf16", "fp8-per-token"),
                   help="bf16, fp8-per-token")
    for b in benches.choices.values():
        b.add_argument("--json", default=None, help="write the report here")
        b.add_argument("--url", default=None, help="a running server (default: start one)")
        b.add_argument("--server-arg", action="append", default=[],
                       help="extra sglang.launch_server flag for the embedded server (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    if args.command != "serve" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "url", None) and getattr(args, "server_arg", None):
        parser.error("--server-arg configures the embedded server; the server at --url runs "
                     "with its own flags: pass one or the other")
    if args.command != "serve":  # serve installs its own handler
        # SIGTERM unwinds like Ctrl-C, so an embedded server started here is stopped on exit
        signal.signal(signal.SIGTERM, _raise_interrupt)
    from sgl_reason.connection import ServerUnreachable
    from sgl_reason.model import ModelPrepareError
    from sgl_reason.runtime.server import ServerStartError

    try:
        if args.command == "model":
            return _cmd_model(args)
        if args.command == "serve":
            return _cmd_serve(args, rest)
        if args.command == "gateway":
            return _cmd_gateway(args)
        if args.command == "bench":
            return _cmd_bench(args)
        if args.command == "eval":
            return _cmd_eval(args)
        if args.command == "plot":
            return _cmd_plot(args)
    except (ModelPrepareError, ServerStartError, ServerUnreachable) as error:
        print(f"sgl-reason: error: {error}", file=sys.stderr)
        if isinstance(error, ServerStartError) and not args.verbose:
            print("sgl-reason: rerun with -v for SGLang's whole log", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what it started is stopped by now
        print(f"sgl-reason: {args.command} interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
