"""The engines mpnb launches run this: ipyparallel's engine, with torch imported while it registers.

Importing torch takes 2-3 s on this 2-core machine and registering with the controller about as
long, so doing both at once saves the shorter of the two on every start and restart. Only CPU
engines preload: a GPU engine must set CUDA_VISIBLE_DEVICES to its own GPU before torch starts,
and learns which GPU only when the world forms. `bootstrap.setup` calls `wait_for_torch()` before
its own `import torch`, so no cell ever sees a half-imported torch.

$MPNB_PRELOAD says what to import: "torch" for the engines of a world being formed now; "warm"
for a spare engine set (`mpnb.cluster.spares`): torch and DeepSpeed's warm-up, on a nice-19 thread
so that a spare takes only CPU time nobody else wants.

Standard library only until the thread runs: this module is the engine's `__main__`.
"""

from __future__ import annotations

import os
import threading
import time

PRELOAD_ENV = "MPNB_PRELOAD"

_thread: threading.Thread | None = None
_took_s: float | None = None  # the preload's own time, for the start breakdown (benchmarks/dispatch.py)


IDLE_NICE = 19  # a spare's preload thread: runs only when the cores are otherwise idle


def _preload(what: str) -> None:
    global _took_s
    t0 = time.perf_counter()
    try:
        if what == "warm":
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IDLE_NICE)  # this thread only
        from mpnb.engine import ds_ops, quiet

        with quiet.quiet_thread():  # import-time warnings go to the engine's log, as in `setup`
            quiet.install_warnings()
            ds_ops.default_extensions_dir()  # where `make install` built DeepSpeed's ops
            import torch
            import torch.distributed  # noqa: F401
        if what == "warm":
            ds_ops.warm(own_ninja=True)
    except Exception as exc:  # `setup` imports torch again and reports the failure properly
        from mpnb.cluster import logs

        logs.write(f"mpnb: preloading {what} failed: {type(exc).__name__}: {exc}")
    _took_s = time.perf_counter() - t0


def start_preload() -> None:
    """Import what $MPNB_PRELOAD asks for on a daemon thread (once per process)."""
    global _thread
    what = os.environ.get(PRELOAD_ENV, "")
    if _thread is None and what in ("torch", "warm"):
        _thread = threading.Thread(target=_preload, args=(what,), name="mpnb-preload", daemon=True)
        _thread.start()


def preloaded() -> bool:
    """The preload (if any) is done: a spare engine is ready to become a rank."""
    return _thread is None or not _thread.is_alive()


def wait_for_torch() -> float | None:
    """Until the preload is done (at once if there is none); the seconds it took, if it ran."""
    while _thread is not None and _thread.is_alive():
        _thread.join(0.2)  # short joins: a SIGINT (the stop button) is handled between them
    return _took_s


def main() -> None:
    start_preload()
    from ipyparallel.engine.app import main as ipengine_main

    ipengine_main()


if __name__ == "__main__":
    # through the importable module, so `setup` (which imports mpnb.engine.boot) sees this thread
    from mpnb.engine import boot

    boot.main()
