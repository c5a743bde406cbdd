"""Engine side of stopping and diagnosing a cell: cooperative stop, stack dumps, releasing peers.

The notebook's stop button reaches every rank as a SIGINT, but not at the same
moment: a plain KeyboardInterrupt can leave one rank a step ahead, waiting in a
collective the others will never enter. So during a `%%distributed` cell whose
code calls `mpnb.should_stop()`, the first SIGINT only sets a flag, and
`should_stop()` all-reduces that flag so every rank sees the same answer at the
same step. A second SIGINT (or one that arrives before the loop first asked)
raises KeyboardInterrupt as usual. ipykernel puts its own SIGINT handler back
after each execute, so nothing here outlives the cell.

`faulthandler` writes this rank's Python stacks to a file on SIGUSR1 from C,
so the kernel can see where a rank is stuck even inside a gloo collective.
`release_peers()` ends this rank's process group so a peer blocked waiting for
this rank gets an error at once instead of at the process-group timeout; on
Linux it also shuts down this process's connections to the peers on this host
(`mpnb.engine.gloo_unblock`), which a live DDP model would otherwise keep open.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import re
import signal
import socket
import sys
from typing import Any

from mpnb import private_files
from mpnb.engine import gloo_unblock, own_group

STACK_SIGNAL = signal.SIGUSR1
CELL_MARK = "# %%distributed"  # line 1 of what mpnb.execution sends (a comment, so line numbers match)
COLLECTIVE_MARK = "  # all ranks"  # appended when the cell runs on every rank (should_stop all-reduces)
STOP_NOTE = "mpnb: stopped at should_stop() call"  # the kernel shows no more than this line for the stop

_in_cell = False
_collective = True  # the cell runs on every rank, so the flag can be all-reduced
_armed = False  # should_stop() has been called in this cell: SIGINT only sets the flag
_requested = False  # a stop was asked for on this rank
_agreed = False  # every rank agreed to stop (sticky for the rest of the cell)
_calls = 0
_stop_call: int | None = None  # the should_stop() call at which the ranks agreed
_stack_fd: int | None = None  # this process's dump file, created once and kept open for faulthandler


def stack_path() -> str:
    """Where this engine's faulthandler writes its stacks: in this user's private 0700 directory.

    Named by pid and start time: a file a dead engine left (killed on a host the kernel cannot
    clean) is never taken for this one's once its pid comes round again.
    `bootstrap.engine_info` reports it, so the kernel reads (and at stop removes) exactly this file.
    """
    from mpnb.cluster.reaper import start_ticks

    pid = os.getpid()
    return os.path.join(private_files.private_dir(), f"stacks-{pid}-{start_ticks(pid)}.txt")


_STACK_NAME = re.compile(r"stacks-(?P<pid>\d+)(?:-(?P<ticks>\d+|None))?\.txt")


def sweep_dead_stack_files() -> list[str]:
    """Remove the dump files of engines on this host that are gone (their stacks are of no use); returns them.

    Engines killed outright (SIGKILL, a host cut off) never remove their own, and the kernel removes
    only those of local engines. A live engine's file names its pid and start time, which still match.
    """
    from mpnb.cluster.reaper import start_ticks

    home = private_files.private_dir()
    removed = []
    for name in os.listdir(home):
        m = _STACK_NAME.fullmatch(name)
        alive = start_ticks(m["pid"]) if m else None
        if m and (alive is None if m["ticks"] is None else str(alive) != m["ticks"]):  # gone, or pid reused
            path = os.path.join(home, name)
            if private_files.remove(path):
                removed.append(path)
    return removed


def _register_stack_dump() -> None:
    global _stack_fd
    if _stack_fd is None:
        with contextlib.suppress(OSError):
            sweep_dead_stack_files()
        # one fresh 0600 file per engine process (O_EXCL|O_NOFOLLOW), emptied through this fd per cell
        _stack_fd = private_files.create(stack_path())
        atexit.register(remove_stack_file)
    faulthandler.register(STACK_SIGNAL, file=_stack_fd, all_threads=True, chain=False)


def remove_stack_file() -> None:
    """At engine exit: the dump file goes (the kernel also removes it when it stops the engines)."""
    global _stack_fd
    if _stack_fd is not None:
        with contextlib.suppress(ValueError, OSError):
            faulthandler.unregister(STACK_SIGNAL)
        with contextlib.suppress(OSError):
            os.close(_stack_fd)
        _stack_fd = None
        private_files.remove(stack_path())


def install() -> None:
    """Watch this engine's cells (bootstrap.setup calls it): `%%distributed` cells get `begin_cell`."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None and _pre_run_cell not in shell.events.callbacks["pre_run_cell"]:
        shell.events.register("pre_run_cell", _pre_run_cell)


def _pre_run_cell(info: Any) -> None:
    global _in_cell
    first = (getattr(info, "raw_cell", "") or "").split("\n", 1)[0]
    if first.startswith(CELL_MARK):
        begin_cell(collective=COLLECTIVE_MARK in first)
        own_group.before_cell(collective=COLLECTIVE_MARK in first)  # a cell destroyed the group: form it
    else:
        _in_cell = False


def begin_cell(collective: bool = True) -> None:
    """Before every `%%distributed` cell: fresh stop state, cooperative SIGINT, stack dumps."""
    global _in_cell, _collective, _armed, _requested, _agreed, _calls, _stop_call
    _in_cell, _collective = True, collective
    _armed = _requested = _agreed = False
    _calls, _stop_call = 0, None
    with contextlib.suppress(ValueError, OSError):  # not the main thread, or no file system
        _register_stack_dump()
        if _stack_fd is not None:
            os.ftruncate(_stack_fd, 0)
            os.lseek(_stack_fd, 0, os.SEEK_SET)
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, _on_sigint)


def _on_sigint(signum: int, frame: Any) -> None:
    global _requested
    if _in_cell and _armed and not _requested:
        _requested = True  # should_stop() will tell every rank at the same step
        return
    raise KeyboardInterrupt


def should_stop(every: int = 1) -> bool:
    """True on every rank at the same call once the notebook's stop button was pressed.

    Call it once per step on every rank (it is a collective when the cell runs
    on all ranks). `every=N` checks only every N-th call, for very short steps.
    """
    global _armed, _agreed, _calls, _stop_call
    _armed = True
    _calls += 1
    if _agreed:
        return True
    if every > 1 and _calls % every:
        return False
    flag = _requested
    dist = sys.modules.get("torch.distributed")
    if _collective and dist is not None and dist.is_available() and dist.is_initialized():
        import torch

        from mpnb.engine import state

        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=state.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flag = bool(t.item())
    if flag:
        _agreed, _stop_call = True, _calls
        print(f"{STOP_NOTE} {_calls}", file=sys.stderr, flush=True)
    return flag


def release_peers(peers_by_host: dict[str, list[tuple[int, int | None]]] | None = None) -> bool:
    """End this rank's process group so peers blocked on it fail now. True if there was one.

    `peers_by_host`: the live ranks' (pid, start time when the world formed) by host name; the
    connections to those on this host are shut down too (`mpnb.engine.gloo_unblock`, Linux only),
    but only where the pid still names the same process (`gloo_unblock.same_processes`), and so
    are the connections mpnb's group opened when it formed, which reach the ranks on other hosts.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return False
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:  # closes NCCL communicators; a no-op for gloo
        with contextlib.suppress(Exception):
            abort()
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    peers = (peers_by_host or {}).get(socket.gethostname(), [])
    with contextlib.suppress(OSError):
        gloo_unblock.shut_down_connections_to(gloo_unblock.same_processes([(p, t) for p, t in peers]))
    from mpnb.engine import state

    with contextlib.suppress(OSError):  # the group's own connections: also those to other hosts
        gloo_unblock.shut_down(state.group_connections)
    return True
