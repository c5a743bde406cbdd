"""The first traceback an engine formats, paid for before any cell can fail.

IPython formats a rank's error with stack_data, which reads and splits the source
of every frame. Done cold, that took 0.27-0.36 s on the first error of an engine
(0.08-0.1 s after), and when a failure crosses hosts the ranks' errors come one
after the other, each waiting for the last. A daemon thread does it once at
start: pygments' lexer compiled, torch.distributed's biggest files parsed and
split, and inspect's module-by-file cache filled once DeepSpeed's warm-up has
imported its modules (on its first miss that cache looks at every loaded module).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading

_started = False


def start_in_background() -> None:
    """Once per engine: `warm` on a daemon thread."""
    global _started
    if not _started:
        _started = True
        threading.Thread(target=warm, daemon=True, name="mpnb-warm-tracebacks").start()


def warm() -> None:
    from mpnb.engine import ds_ops

    with contextlib.suppress(Exception):
        from IPython.core.ultratb import AutoFormattedTB
        from stack_data.core import Source

        try:
            raise RuntimeError("warming the traceback formatter")
        except RuntimeError as exc:  # a formatter of its own: the shell's may be formatting a cell's error
            AutoFormattedTB(mode="Context").structured_traceback(type(exc), exc, exc.__traceback__)
        if "torch.distributed" in sys.modules:
            from torch.distributed import c10d_logger, distributed_c10d

            for module in (distributed_c10d, c10d_logger):
                source = Source.for_filename(module.__file__)
                source.asttext()
                _ = source.pieces  # a cached property: computed once, here
        ds_ops.wait()
        inspect.getmodule(compile("", "<mpnb: filling inspect's module cache>", "exec"))
