"""Start, watch and stop one real SGLang HTTP server process group.

Shared by ``sgl-reason serve`` (foreground, log to the terminal) and :class:`EmbeddedRuntime`
(background, log kept in memory). The server runs in its own session, so stopping it stops the
launcher, the scheduler and the detokenizer together, by the group's id.
"""

from __future__ import annotations

import atexit
import collections
import ipaddress
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import requests

logger = logging.getLogger(__name__)

# Applied on machines without CUDA unless the user passed the flag. The pool is bounded because
# SGLang sizes it from free RAM by default (15 GB and 44 s to allocate on a 24 GB machine).
CPU_DEFAULTS: dict[str, str | None] = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--max-total-tokens": "16384",
    # --max-total-tokens sizes the pool; this fraction is only SGLang's headroom check: the free
    # RAM the load may use up, measured machine-wide. At 0.05 (about 1 GB here) a 135M model's
    # own start used it all (5.1-5.3%) when other servers ran: starts failed, or sized a pool
    # below --max-total-tokens.
    "--mem-fraction-static": "0.2",
    # Without it the idle scheduler busy-polls and holds a whole core of a 2-core machine.
    "--sleep-on-idle": None,
    # Thinking budgets are enforced inside one request by a custom logit processor. It runs
    # client-supplied code (SGLang unpickles it with dill), so it is a default only for a
    # server bound to a loopback address (LOOPBACK_ONLY); elsewhere the user must ask for it.
    "--enable-custom-logit-processor": None,
}
LOOPBACK_ONLY = frozenset({"--enable-custom-logit-processor"})
DEFAULT_HOST = "127.0.0.1"
LOG_TAIL_LINES = 60
# The smallest pool that serves SGLang's own warm-up and a short request.
MIN_TOTAL_TOKENS = 256


class ServerStartError(RuntimeError):
    """The server did not become ready; the message leads with the reason found in its log
    (``reason``, None when none was found) and carries the log's tail where that helps."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


_ARGPARSE_ERROR = re.compile(r"^\S[^:]*: error: (.+)$")
# uvicorn's line when the HTTP port was taken after the engine started; the process then waits
# for its shutdown instead of exiting, so the line is the only sign
_BIND_ERROR = re.compile(r"error while attempting to bind on address .*")
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b:? ?(.*)$")


def failure_reason(lines: list[str]) -> str | None:
    """The one log line that says why a server did not start: the argument parser's error
    (after its usage text), else the last exception's line."""
    for line in reversed(lines):
        if _ARGPARSE_ERROR.match(line.strip()):
            return line.strip()
    for line in reversed(lines):
        if _EXCEPTION.match(line.strip()) and not line.startswith(" "):
            return line.strip()
    return None


def cuda_available() -> bool:
    """CUDA kernels and a CUDA device: only then is the server left on SGLang's GPU defaults."""
    from sgl_reason.runtime import cpu_compat

    if not cpu_compat.has_real_kernels():
        return False
    import torch

    return torch.cuda.is_available()


# SGLang puts internal listeners up to 1,000 ports above the HTTP port (its distributed init)
_INTERNAL_SPAN = 1000


def _ephemeral_low(default: int = 32768) -> int:
    """The lowest port the kernel hands to outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port(host: str = DEFAULT_HOST) -> int:
    """A port free now and below the kernel's ephemeral range.

    Not ``bind(host, 0)``: that returns an ephemeral port, which any outgoing connection made
    before the server binds it (20 s later; the tests' own requests, the server's internal
    connections) may take as its local port, and the server then fails to bind."""
    top = _ephemeral_low() - _INTERNAL_SPAN
    if top > 10000:
        for port in random.SystemRandom().sample(range(10000, top), 64):  # not a seeded state
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # an odd port range
        s.bind((host, 0))
        return s.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as error:
            raise ServerStartError(
                f"Port {port} on {host} is in use ({error.strerror}). Pass another --port, or "
                "leave --port out to pick a free one."
            ) from None


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``--flag V`` or ``--flag=V`` in an argument list (last one wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is only reachable from this machine (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def describe_cpu_defaults() -> str:
    """The CPU defaults as one line, for ``--help`` (the README and user guide say the same)."""
    def spell(flags):
        return " ".join(f if CPU_DEFAULTS[f] is None else f"{f} {CPU_DEFAULTS[f]}" for f in flags)
    always = [f for f in CPU_DEFAULTS if f not in LOOPBACK_ONLY]
    return (f"{spell(always)}, and only when the host is a loopback address "
            f"{spell(f for f in CPU_DEFAULTS if f in LOOPBACK_ONLY)}")


def build_server_args(
    model: str | Path, host: str, port: int, extra: Sequence[str], cpu: bool
) -> list[str]:
    """The ``sglang.launch_server`` argument list: the user's flags win over CPU defaults.
    Defaults in :data:`LOOPBACK_ONLY` (code sent by clients) apply only on a loopback host."""
    args = ["--model-path", str(model), "--host", host, "--port", str(port)]
    if cpu:
        for flag, value in CPU_DEFAULTS.items():
            if has_flag(extra, flag):
                continue
            if flag in LOOPBACK_ONLY and not is_loopback(host):
                logger.warning(
                    "%s is off: the server binds %s, not a loopback address, and the flag lets "
                    "clients send code the server runs. Thinking budgets use two requests "
                    "instead of one; pass %s yourself if every client is trusted.",
                    flag, host, flag)
                continue
            args += [flag] if value is None else [flag, value]
    args += list(extra)
    total = flag_value(args, "--max-total-tokens")
    if total is not None and int(total) < MIN_TOTAL_TOKENS:
        raise ServerStartError(
            f"--max-total-tokens {total} is too small: the server needs at least "
            f"{MIN_TOTAL_TOKENS} KV slots for its warm-up. Pass --max-total-tokens >= "
            f"{MIN_TOTAL_TOKENS} (the longest request's prompt plus max_new_tokens)."
        )
    return args


def resolve_model(model: str | Path | None) -> Path:
    """``None`` means the prepared SmolLM2 folder; a name of ``sgl_reason.model.MODEL_NAMES``
    is prepared on demand (offline, idempotent); any other path must exist."""
    from sgl_reason import model as default_model

    if isinstance(model, str) and model in default_model.MODEL_NAMES:
        return default_model.prepare(model=model)
    if model is None:
        path = default_model.default_model_path()
        if not default_model.is_prepared(path):
            raise ServerStartError(
                f"The default model is not prepared at {path}. Run `sgl-reason model prepare` "
                "(or `make setup model`), or pass --model PATH."
            )
        return path
    path = Path(model).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ServerStartError(
            f"Model {str(model)!r} is not a known model name "
            f"({', '.join(default_model.MODEL_NAMES)}) and not a model folder (no config.json "
            "there). Pass a name or a local Hugging Face model folder with --model (`sgl-reason "
            "model prepare --model NAME` builds a named one). Models are never downloaded at "
            "run time."
        )
    return path


class ServerProcess:
    """One SGLang server process group.

    Contract: :meth:`start` returns once ``/health`` answers 200, or raises
    :class:`ServerStartError` with the log tail after stopping whatever it started;
    :meth:`stop` is idempotent and leaves no process of the group running.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        host: str = DEFAULT_HOST,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        log_sink: Callable[[str], None] | None = None,
        env: dict[str, str] | None = None,
        module: str = "sglang.launch_server",
    ):
        self.model = resolve_model(model)
        self.host = host
        self.picked_port = port is None  # ours to replace if it is taken before the bind
        if port is None:
            port = free_port(host)
        else:
            check_port_free(host, port)
        self.port = port
        self.cpu = not cuda_available()
        self.args = build_server_args(self.model, host, port, extra_args, self.cpu)
        self.module = module
        self.env = env or {}
        self.log_sink = log_sink
        self.log_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._shm: list[str] = []  # /dev/shm files its processes made (see _leftover_shm)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, *self.args]

    def start(self, timeout: float = 180.0, attempts: int = 3) -> "ServerProcess":
        """Start the group and wait for ``/health``. A port this object picked that another
        process binds first is replaced and the start retried (``attempts`` in all)."""
        tries = 1
        while True:
            try:
                return self._start_once(timeout)
            except ServerStartError as error:
                taken = error.reason is not None and _BIND_ERROR.search(error.reason)
                if not (taken and self.picked_port and tries < attempts):
                    raise
            logger.warning("port %d was taken before the server bound it; retrying on another",
                           self.port)
            self.port = free_port(self.host)
            self.args[self.args.index("--port") + 1] = str(self.port)
            tries += 1

    def _start_once(self, timeout: float) -> "ServerProcess":
        self.log_tail.clear()
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.update(self.env)
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group, stopped by id
            text=True,
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        _sigterm_unwinds(self, True)
        atexit.register(self.stop)  # a script that ends without stopping it
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self._shm = _leftover_shm(self.group_pids())
        return self

    def _read_log(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.log_tail.append(line)
            if self.log_sink is not None:
                self.log_sink(line)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            bind_error = next((m.group(0) for m in map(_BIND_ERROR.search, list(self.log_tail))
                               if m), None)
            if bind_error is not None:
                raise ServerStartError(
                    f"The SGLang server could not bind {self.host}:{self.port}: another process "
                    "took the port while the server started. Pass another --port, or leave "
                    f"--port out to pick a free one.\nLog: {bind_error}", bind_error)
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                reason = failure_reason(list(self.log_tail))
                usage = reason is not None and _ARGPARSE_ERROR.match(reason)
                raise ServerStartError(
                    f"The SGLang server exited with code {self.proc.returncode} before it was "
                    f"ready: {reason or 'no reason in its log'}\nCommand: "
                    f"{' '.join(self.command())}"
                    + ("" if usage else f"\nLast log lines:\n{self.tail()}"), reason)
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        raise ServerStartError(
            f"The SGLang server was not ready after {timeout:.0f} s. Raise the start-up timeout "
            f"if the machine is slow.\nLast log lines:\n{self.tail()}"
        )

    def tail(self, n: int = 30) -> str:
        return "\n".join(list(self.log_tail)[-n:])

    def group_pids(self) -> list[int]:
        """Pids of processes still alive in the server's process group."""
        return [] if self.proc is None else group_pids(self.proc.pid)

    def stop(self, grace: float = 20.0) -> None:
        """Interrupt the launcher (SGLang's Ctrl-C path: it stops its scheduler and
        detokenizer), wait for the group to go, then SIGKILL whatever is left and remove the
        shared-memory files SGLang leaves behind.

        Not SIGTERM: SGLang's drain polls every 5 s, and a SIGTERM to the whole group reads as
        a crashed scheduler (a 5 s diagnostics sleep). Either way a stop took 5 s, not 0.5."""
        if self.proc is None:
            return
        atexit.unregister(self.stop)
        pgid = self.proc.pid
        # asked again here, while the group lives: a start that failed (a port taken during
        # start-up) stops a group whose files were never listed at ready
        self._shm = sorted(set(self._shm) | set(_leftover_shm(self.group_pids())))
        if self.proc.poll() is None:
            try:
                os.kill(pgid, signal.SIGINT)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            logger.warning("server group %d did not stop in %.0f s; killing it", pgid, grace)
        deadline = time.monotonic() + grace
        while self.group_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        _signal_group(pgid, signal.SIGKILL)
        self.proc.wait()
        _sigterm_unwinds(self, False)
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        for path in self._shm:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._shm = []


def _leftover_shm(pids: list[int]) -> list[str]:
    """The /dev/shm files of a running server's processes that no exit removes: SGLang's load
    snapshot (``sglang_loads_*``, unlinked by nothing) and joblib's semaphores named after
    the scheduler's pid (``sem.loky-<pid>-*``). 16 KB each, one set per server started."""
    import psutil

    shm = Path("/dev/shm")
    found: set[str] = set()
    for pid in pids:
        try:
            held = [m.path for m in psutil.Process(pid).memory_maps()]
        except (psutil.Error, OSError):
            continue
        found.update(p for p in held if p.startswith(str(shm / "sglang_loads_")))
        if shm.is_dir():
            found.update(str(p) for p in shm.glob(f"sem.loky-{pid}-*"))
    return sorted(found)


_LIVE: set[int] = set()  # ids of started servers that rely on the SIGTERM handler below


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _sigterm_unwinds(server: ServerProcess, up: bool) -> None:
    """While a server started here is up, SIGTERM raises KeyboardInterrupt, as Ctrl-C does.

    A script killed by SIGTERM (``kill``, ``timeout``, a CI runner) otherwise dies without
    running its ``with`` and ``finally`` blocks, and its server outlives it. Only where the
    program left SIGTERM at its default and only from the main thread (Python's rule); the
    default comes back when the last such server stops."""
    if threading.current_thread() is not threading.main_thread():
        return
    if up:
        if not _LIVE and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the program handles SIGTERM itself
        _LIVE.add(id(server))
        signal.signal(signal.SIGTERM, _raise_interrupt)
    elif id(server) in _LIVE:
        _LIVE.discard(id(server))
        if not _LIVE and signal.getsignal(signal.SIGTERM) is _raise_interrupt:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def group_pids(pgid: int) -> list[int]:
    """Pids of live (not zombie) processes in process group ``pgid``."""
    import psutil

    pids = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return pids


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
