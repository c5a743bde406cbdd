"""The engines mpnb launches run this: ipyparallel's engine, with torch imported while it registers.

Importing torch takes 2-3 s on this 2-core machine and registering with the controller about as
long, so doing both at once saves the shorter of the two on every start and restart. Only CPU
engines preload (`$MPNB_PRELOAD=torch`): a GPU engine must set CUDA_VISIBLE_DEVICES to its own
GPU before torch starts, and learns which GPU only when the world forms. `bootstrap.setup` calls
`wait_for_torch()` before its own `import torch`, so no cell ever sees a half-imported torch.

Standard library only until the thread runs: this module is the engine's `__main__`.
"""

from __future__ import annotations

import os
import threading
import time

PRELOAD_ENV = "MPNB_PRELOAD"

_thread: threading.Thread | None = None
_took_s: float | None = None  # the preload's own time, for the start breakdown (benchmarks/dispatch.py)


def _preload() -> None:
    global _took_s
    t0 = time.perf_counter()
    try:
        from mpnb.engine import quiet

        with quiet.quiet_thread():  # import-time warnings go to the engine's log, as in `setup`
            quiet.install_warnings()
            import torch
            import torch.distributed  # noqa: F401
    except Exception as exc:  # `setup` imports torch again and reports the failure properly
        from mpnb.cluster import logs

        logs.write(f"mpnb: preloading torch failed: {type(exc).__name__}: {exc}")
    _took_s = time.perf_counter() - t0


def start_preload() -> None:
    """Import torch on a daemon thread if this engine was launched to (once per process)."""
    global _thread
    if _thread is None and os.environ.get(PRELOAD_ENV) == "torch":
        _thread = threading.Thread(target=_preload, name="mpnb-preload-torch", daemon=True)
        _thread.start()


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
