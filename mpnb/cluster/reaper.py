"""Kill ipyparallel nanny processes that outlive their engine: `python reaper.py ENGINE:NANNY:STARTED ...`.

ipyparallel's nanny relays signals to its engine and exits a few seconds after the engine does (it
lingers to tell the controller). Sometimes it hangs in `zmq.Context.term()` instead and stays
forever, a child of init (4 orphans after about 7 stops here). mpnb starts this script detached
when it stops or restarts engines and when the kernel exits, so it outlives the kernel. A nanny is
killed only once its engine has been gone for `GRACE_S`; one whose engine lives is never touched.
STARTED is the nanny's `start_time` recorded when the world formed: a pid that now belongs to a
process started at another time (the nanny died and its pid was reused, perhaps by another
cluster's nanny) is never touched either, since a command line alone cannot tell them apart.
Run as a script by path, so it imports neither mpnb nor torch.
"""

from __future__ import annotations

import os
import sys
import time

GRACE_S = 8.0  # a healthy nanny is gone ~3 s after its engine
WATCH_S = 120.0  # engines stopped at kernel exit may take a while to go
SAME_START_S = 0.005  # start times are whole clock ticks (Linux) or psutil's exact create time


def pair(engine_pid: int, nanny_pid: int, started: float | None) -> str:
    """One ENGINE:NANNY:STARTED argument."""
    return f"{engine_pid}:{nanny_pid}:{started!r}"


def is_nanny(proc: object) -> bool:
    """A psutil.Process running ipyparallel's engine nanny."""
    return "ipyparallel.engine.nanny" in " ".join(proc.cmdline())  # type: ignore[attr-defined]


def start_ticks(pid: int | str) -> int | None:
    """`pid`'s start time in clock ticks after boot (/proc/PID/stat field 22); None if gone or not Linux.

    Fixed for the life of one process, so with the pid it names one process: a pid reused later
    has another start time. (psutil's create time adds the boot time, which moves when the wall
    clock is set.)
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])  # the fields after "comm)" start at 3
    except (OSError, IndexError, ValueError):
        return None


def start_time(proc: object) -> float:
    """When `proc` started: `start_ticks` on Linux, psutil's create time elsewhere."""
    ticks = start_ticks(proc.pid)  # type: ignore[attr-defined]
    return float(ticks) if ticks is not None else float(proc.create_time())  # type: ignore[attr-defined]


def reap(
    nannies_started: list[tuple[int, int, float]], grace: float = GRACE_S, watch: float = WATCH_S
) -> list[int]:
    """Watch (engine pid, nanny pid, nanny start_time) triples; kill each nanny left `grace` s after
    its engine. Returns the pids killed.
    """
    import psutil

    nannies = {}
    for engine, nanny, started in nannies_started:
        try:
            proc = psutil.Process(nanny)
            if is_nanny(proc) and abs(start_time(proc) - started) < SAME_START_S:
                nannies[nanny] = (engine, proc)
        except psutil.Error:
            pass
    engine_gone_at: dict[int, float] = {}
    killed = []
    deadline = time.monotonic() + watch
    while nannies and time.monotonic() < deadline:
        now = time.monotonic()
        for pid, (engine, proc) in list(nannies.items()):
            try:
                if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                    del nannies[pid]
                    continue
                if psutil.pid_exists(engine) and proc.ppid() == engine:
                    continue
                if now - engine_gone_at.setdefault(pid, now) >= grace:
                    proc.kill()
                    killed.append(pid)
                    del nannies[pid]
            except psutil.Error:
                nannies.pop(pid, None)
        time.sleep(0.5)
    return killed


def main(argv: list[str]) -> None:
    triples = [(int(e), int(n), float(t)) for e, n, t in (arg.split(":") for arg in argv)]
    if hasattr(os, "fork") and os.fork():
        os._exit(0)  # the starter reaps this parent at once; the watcher lives on, a child of init
    reap(triples)


if __name__ == "__main__":
    main(sys.argv[1:])
