"""Kill ipyparallel nanny processes that outlive their engine: `python reaper.py ENGINE:NANNY ...`.

ipyparallel's nanny relays signals to its engine and exits a few seconds after the engine does (it
lingers to tell the controller). Sometimes it hangs in `zmq.Context.term()` instead and stays
forever, a child of init (4 orphans after about 7 stops here). mpnb starts this script detached
when it stops or restarts engines and when the kernel exits, so it outlives the kernel. A nanny is
killed only once its engine has been gone for `GRACE_S`; one whose engine lives is never touched.
Run as a script by path, so it imports neither mpnb nor torch.
"""

from __future__ import annotations

import os
import sys
import time

GRACE_S = 8.0  # a healthy nanny is gone ~3 s after its engine
WATCH_S = 120.0  # engines stopped at kernel exit may take a while to go


def is_nanny(proc: object) -> bool:
    """A psutil.Process running ipyparallel's engine nanny."""
    return "ipyparallel.engine.nanny" in " ".join(proc.cmdline())  # type: ignore[attr-defined]


def reap(pairs: list[tuple[int, int]], grace: float = GRACE_S, watch: float = WATCH_S) -> list[int]:
    """Watch (engine pid, nanny pid) pairs; kill each nanny left `grace` s after its engine. Returns those."""
    import psutil

    nannies = {}
    for engine, nanny in pairs:
        try:
            proc = psutil.Process(nanny)
            if is_nanny(proc):
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
    pairs = [(int(e), int(n)) for e, n in (arg.split(":") for arg in argv)]
    if hasattr(os, "fork") and os.fork():
        os._exit(0)  # the starter reaps this parent at once; the watcher lives on, a child of init
    reap(pairs)


if __name__ == "__main__":
    main(sys.argv[1:])
