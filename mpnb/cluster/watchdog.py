"""Kernel side of diagnosing ranks while a cell runs: who died (and how), where a rank is stuck.

A rank blocked in a collective cannot answer ipyparallel, so nothing here asks
the engine: death is read from the process table (local engines are children
of this kernel, so `waitid(WNOWAIT)` gives the signal without reaping them) and
from the controller's engine list; stacks come from the file each engine's
faulthandler writes on SIGUSR1 (`mpnb.engine.control`), sent through the
engine's nanny, which works while the engine is busy.

Kernel side: never imports torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpnb import private_files
from mpnb.cluster import host_reach
from mpnb.cluster.host_reach import is_local

if TYPE_CHECKING:
    from collections.abc import Iterable

    from mpnb.cluster.session import RankInfo, Session

STACK_SIGNAL = signal.SIGUSR1  # mpnb.engine.control.STACK_SIGNAL (that module imports torch lazily only)
READ_BACK_S = 2.0  # how long the stacks of ranks on other hosts may take to come back
ELSEWHERE = "(stack written on"
STACK_WAIT_S = 0.3  # faulthandler writes from the signal handler; the nanny relays the signal first
MAX_FRAMES = 8
REPORTING = "  (it raised; its engine is formatting the traceback)"


@dataclass
class Death:
    rank: int
    host: str
    pid: int
    cause: str  # "killed by SIGKILL", "exited with code 1", "stopped answering the controller"

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid} on {self.host}) {self.cause}"


def _launched_process(session: Session | None, pid: int) -> Any:
    """The psutil.Process ipyparallel's launcher holds for `pid` (it keeps the exit code once reaped)."""
    cluster = getattr(session, "cluster", None)
    for engine_set in (getattr(cluster, "engines", None) or {}).values():
        for launcher in (getattr(engine_set, "launchers", None) or {}).values():
            process = getattr(launcher, "process", None)
            if getattr(process, "pid", None) == pid:
                return process
    return None


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (exit code {code})"
    return f"exited with code {code}"


def exit_cause(pid: int, session: Session | None = None) -> str | None:
    """How local process `pid` ended, or None while it runs."""
    process = _launched_process(session, pid)
    if process is not None:  # started by this kernel: its launcher's process object knows the code
        try:
            code = process.wait(timeout=0)
        except Exception as exc:  # psutil.TimeoutExpired: still running
            if type(exc).__name__ == "TimeoutExpired":
                return None
        else:
            return _describe_exit(code) if code is not None else "exited"
    try:
        res = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # not our child: all we can know is whether it is gone
        return None if _exists(pid) else "exited"
    except OSError:
        return None
    if res is None:
        return None
    if res.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return _describe_exit(-res.si_status)
    return _describe_exit(res.si_status)


def _exists(pid: int) -> bool:
    try:
        import psutil

        return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def dead_ranks(session: Session, ranks: list[int]) -> list[Death]:
    """Ranks among `ranks` whose engine process is gone (local) or left the controller (any host)."""
    try:
        ids = set(session.client.ids)
    except Exception:
        ids = None
    found = []
    for r in ranks:
        info = session.ranks[r]
        cause = exit_cause(info.pid, session) if is_local(info) else None
        if cause is None and ids is not None and info.engine_id not in ids:
            cause = "stopped answering the controller (the engine is gone)"
        if cause is not None:
            found.append(Death(r, info.host, info.pid, cause))
    seen = {d.rank for d in found}
    for r, cause in host_reach.unreachable(session, [r for r in ranks if r not in seen]).items():
        found.append(Death(r, session.ranks[r].host, session.ranks[r].pid, cause))
    return found


# ----------------------------------------------------------------------------- stacks


def request_stacks(session: Session, ranks: list[int]) -> None:
    """Ask `ranks` to write their Python stacks (works while they are blocked in C code)."""
    if not ranks:
        return
    with contextlib.suppress(Exception):
        session.client.send_signal(
            int(STACK_SIGNAL), targets=[session.engine_id(r) for r in ranks], block=False
        )


def read_stacks(session: Session, ranks: list[int], execution_count: int | None = None) -> dict[int, str]:
    """Each rank's cell frames as short text (for ranks on other hosts: a note that `read_back` fills)."""
    out: dict[int, str] = {}
    for r in ranks:
        info = session.ranks[r]
        if not info.stacks:
            continue
        if not is_local(info):
            out[r] = f"{ELSEWHERE} {info.host} to {info.stacks})"  # `read_back` once the rank is idle
            continue
        text = ""
        for _ in range(5):  # the dump may still be being written
            # only our own 0600 file in our 0700 directory, never through a symlink: the text decides
            # release or interrupt and is shown in the notebook
            text = private_files.read(info.stacks) or ""
            if "most recent call first" in text:
                break
            time.sleep(0.05)
        formatted = format_stack(text, execution_count)
        if formatted:
            out[r] = formatted
    return out


def read_back(session: Session, stacks: dict[int, str], idle: list[int],
              execution_count: int | None = None) -> dict[int, str]:
    """The stacks of `idle` ranks on other hosts that `read_stacks` could only name, read through
    their own engines (each reads its own private file); a rank that does not answer keeps its note."""
    replies = {}
    for r in idle:
        if stacks.get(r, "").startswith(ELSEWHERE):
            with contextlib.suppress(Exception):
                engine = session.client[session.engine_id(r)]
                replies[r] = engine.apply_async(private_files.read, session.ranks[r].stacks)
    deadline = time.monotonic() + READ_BACK_S
    out = {}
    for r, reply in replies.items():
        with contextlib.suppress(Exception):
            formatted = format_stack(reply.get(timeout=max(deadline - time.monotonic(), 0.0)) or "",
                                     execution_count)
            if formatted:
                out[r] = formatted
    return out


def remove_stack_files(ranks: Iterable[RankInfo]) -> None:
    """Remove the stack-dump files of these ranks' engines (local ones; they have exited or are exiting)."""
    for info in ranks:
        if info.stacks and is_local(info):
            private_files.remove(info.stacks)


def dump_stacks(session: Session, ranks: list[int], execution_count: int | None = None) -> dict[int, str]:
    request_stacks(session, ranks)
    time.sleep(STACK_WAIT_S)
    return read_stacks(session, ranks, execution_count)


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>.+)$')
_CELL_FILE = re.compile(r"ipykernel_\d+[/\\]\d+\.py$|^<ipython-input-")


def format_stack(dump: str, execution_count: int | None = None) -> str:
    """faulthandler text -> the executing thread's frames from the cell inwards, most recent last."""
    blocks = [b for b in re.split(r"\n\s*\n", dump) if "most recent call first" in b]
    main = next((b for b in blocks if "run_cell" in b or "do_execute" in b), None)
    if main is None:
        return ""
    frames = []
    for line in main.splitlines():
        m = _FRAME.match(line)
        if not m:
            continue
        if "IPython/core/interactiveshell.py" in m["file"]:
            if m["func"] == "showtraceback":
                return REPORTING
            break  # below the cell: ipykernel/ipyparallel machinery
        frames.append((m["file"], int(m["line"]), m["func"]))
    if not frames:
        return ""
    frames.reverse()
    cell = str(execution_count) if execution_count else " "
    lines = []
    shown = frames if len(frames) <= MAX_FRAMES else [frames[0], *frames[-(MAX_FRAMES - 1) :]]
    for i, (file, line, func) in enumerate(shown):
        if i == 1 and len(frames) > MAX_FRAMES:
            lines.append(f"  ... {len(frames) - MAX_FRAMES} frames ...")
        if _CELL_FILE.search(file):
            lines.append(f"  Cell In[{cell}], line {line}")
        else:
            lines.append(f"  {_short_path(file)}, line {line}, in {func}")
    return "\n".join(lines)


def _short_path(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def is_reporting(stack: str) -> bool:
    """The rank already raised and its engine is formatting the traceback (slow for big torch files)."""
    return stack == REPORTING


def in_collective(stack: str) -> bool:
    """The rank is waiting inside torch.distributed (a collective or barrier)."""
    return "torch/distributed" in stack or "distributed_c10d" in stack
