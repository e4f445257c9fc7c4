"""Time an embedded server's stop: SIGTERM to the whole process group (sgl-reason before
session 21) against ``ServerProcess.stop`` (SIGINT to the launcher), on the same machine in
one run, and count what each leaves in /dev/shm.

    HF_HUB_OFFLINE=1 .venv/bin/python experiments/server_stop.py [ROUNDS]
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from sgl_reason import EmbeddedRuntime
from sgl_reason.runtime.server import group_pids


def shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if Path("/dev/shm").is_dir() else set()


def group_sigterm(rt: EmbeddedRuntime) -> None:
    pgid = rt.pid
    os.killpg(pgid, signal.SIGTERM)
    while group_pids(pgid):
        time.sleep(0.05)


def main(rounds: int) -> None:
    rows: dict[str, list[tuple[float, int]]] = {"group SIGTERM": [], "ServerProcess.stop": []}
    for _ in range(rounds):
        for name in rows:
            before = shm()
            rt = EmbeddedRuntime().start()
            started = time.perf_counter()
            if name == "group SIGTERM":
                group_sigterm(rt)
                rows[name].append((time.perf_counter() - started, len(shm() - before)))
                rt.shutdown()  # bookkeeping only (and it removes the files counted above)
            else:
                rt.shutdown()
                rows[name].append((time.perf_counter() - started, len(shm() - before)))
    for name, runs in rows.items():
        seconds = sorted(s for s, _ in runs)[len(runs) // 2]
        print(f"{name:>20}: median stop {seconds:.2f} s, /dev/shm files left per server "
              f"{max(n for _, n in runs)}")
    old = sorted(s for s, _ in rows["group SIGTERM"])[rounds // 2]
    new = sorted(s for s, _ in rows["ServerProcess.stop"])[rounds // 2]
    print(f"ratio {old / new:.1f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
