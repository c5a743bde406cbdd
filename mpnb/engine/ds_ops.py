"""DeepSpeed ready before the first ZeRO cell: its JIT ops built by `make install`, imported at start.

Where a first ZeRO-2 `mpnb.prepare` on fresh CPU engines spent its time before this module
(2 ranks, idle 2-core machine, ops already built; see benchmarks/first_zero_cell.py):
`import deepspeed` 0.5-0.6 s; its op probe (`deepspeed.ops.__compatible_ops__`: a C compile and
a link against libaio per op, the `ld: cannot find -laio` lines) 0.1 s; loading the shared-memory
comm op 0.02 s (40 s on each machine where it was not built yet); importing the Muon optimizer that
`deepspeed.initialize` checks the optimizer against (torch.compile -> torch._inductor) 1.4 s;
`deepspeed.initialize` itself 0.1-0.4 s. So `warm_in_background()` (bootstrap.setup) does all but
the last on a daemon thread right after the process group forms, with its output in the engine's
log (`mpnb.engine.quiet`), and the ZeRO prepare waits for it (`wait`) before touching DeepSpeed.

`python -m mpnb.engine.ds_ops` builds the ops into $TORCH_EXTENSIONS_DIR (the Makefile's install).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mpnb.cluster import logs
from mpnb.engine import cell_raise, quiet

# The only JIT op DeepSpeed loads for mpnb's CPU ZeRO runs: deepspeed.comm's shared-memory
# all-reduce (`build_shm_op`, when the CPU accelerator's probe says it can be built).
COMM_OP = "ShareMemCommBuilder"
# imported lazily by `deepspeed.initialize` (is_zero_supported_optimizer): compiles Muon's kernels
OPTIMIZER_CHECK = "deepspeed.runtime.zero.muon.muon_optimizer"

STALE_LOCK_S = 600.0  # a build takes 1-2 min on 2 busy cores: a lock this old was left by a killed one
ORPHAN_RECHECK_S = 0.2

_thread: threading.Thread | None = None


def use_own_ninja() -> None:
    """Put the ninja installed beside this Python (the venv's) first on PATH, as the Makefile's build does.

    torch builds and checks JIT ops with whichever `ninja` PATH finds, and two ninja versions keep
    incompatible build logs (1.13 hashes commands differently from 1.11): each took the other's
    build for stale and compiled the op again, 1-2 min in the first ZeRO cell of a session whose
    PATH (a venv activated or not) differed from the one the ops were built with.
    """
    bindir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if os.path.exists(os.path.join(bindir, "ninja")) and path.split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + path


def installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def op_builders() -> list[Any]:
    """The op builders DeepSpeed would JIT-load on this accelerator when a ZeRO engine starts."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(COMM_OP)
    # the same test as deepspeed.comm.torch.build_shm_op, so we build exactly what it would load
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return []
    return [builder]


def is_built(builder: Any) -> bool:
    """The op's JIT build in $TORCH_EXTENSIONS_DIR is complete and current (`ninja -n`: no work to do).

    The warm-up loads only such ops: a build it started could be cut short by the engines' stop.
    torch's build `lock` says nothing here: every load of a built op holds it while ninja checks."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        return False
    build = os.path.join(root, builder.NAME)
    if not os.path.exists(os.path.join(build, f"{builder.NAME}.so")):
        return False
    try:
        done = subprocess.run(["ninja", "-n", "-C", build], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and "no work to do" in done.stdout


def lock_holders(path: str) -> list[int]:
    """Pids of the processes on this machine that have `path` open (torch's build lock stays open
    in the process holding it, from its O_EXCL create to its removal)."""
    target = os.path.realpath(path)
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            fds = os.path.join("/proc", pid, "fd")
            if any(os.readlink(os.path.join(fds, fd)) == target for fd in os.listdir(fds)):
                holders.append(int(pid))
    return holders


NETWORK_FILE_SYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "9p")


def on_network_file_system(path: str, mounts_file: str = "/proc/self/mounts") -> bool:
    """`path` is on a file system other hosts may share (a home directory over NFS, say)."""
    target, best, kind = os.path.realpath(path), "", ""
    with contextlib.suppress(OSError), open(mounts_file) as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1].replace("\\040", " ")
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind in NETWORK_FILE_SYSTEMS or kind.startswith("fuse.")


def clear_stale_locks(max_age_s: float = STALE_LOCK_S) -> None:
    """Remove torch's build lock of an op that no process here holds (its loader was killed: an
    engine stopped while it checked or built the op), or, on a file system other hosts share, that
    is older than any build. Every later load would wait on it forever."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        return
    for builder in op_builders():
        lock = os.path.join(root, builder.NAME, "lock")
        with contextlib.suppress(OSError):
            if _left_behind(lock, max_age_s):
                os.unlink(lock)
                logs.write(f"mpnb: removed a build lock its holder left behind: {lock}")


def _left_behind(lock: str, max_age_s: float) -> bool:
    first = os.lstat(lock)
    if time.time() - first.st_mtime > max_age_s:
        return True
    if on_network_file_system(lock) or lock_holders(lock):
        return False  # a holder on another host is not in this machine's /proc
    # torch closes the lock's fd a moment before it removes the file: unheld twice, the same file
    time.sleep(ORPHAN_RECHECK_S)
    return os.lstat(lock).st_ino == first.st_ino and not lock_holders(lock)


def load_ops(only_built: bool = False) -> list[str]:
    """Load the ops (building those not built yet unless `only_built`); their names.

    Output: fd 1/2 as they are."""
    names = []
    clear_stale_locks()
    for builder in op_builders():
        if only_built and not is_built(builder):
            logs.write(f"mpnb: DeepSpeed's {builder.NAME} op is not built for this machine: the first ZeRO "
                       "cell will build it (about a minute). `make install` builds it once for all.")
            continue
        builder.load(verbose=False)
        names.append(builder.NAME)
    return names


def default_extensions_dir() -> None:
    """$TORCH_EXTENSIONS_DIR, unless set: where `make install` builds the ops (and nothing else does)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "mpnb" / "torch_extensions"))


def warm(own_ninja: bool = False) -> None:
    """Import DeepSpeed and load its ops and lazy imports now; every line they print goes to the log.

    `own_ninja`: put the venv's ninja first on PATH here (only where no cell can run meanwhile)."""
    if not installed():
        return
    if own_ninja:
        use_own_ninja()
    with quiet.quiet_thread():
        try:
            # any optimizer's constructor imports it (1-2 s the first cell no longer pays); a cell waits
            # for this thread (`wait`), and the kernel waits for it before a new world's first cell
            importlib.import_module("torch._dynamo")
            importlib.import_module("deepspeed")
            with quiet.quiet_fds():  # only the op probe and the op load: they start compilers and linkers
                load_ops(only_built=True)
            importlib.import_module(OPTIMIZER_CHECK)
        except Exception as exc:  # the ZeRO prepare will meet (and show) the same problem
            logs.write(f"mpnb: DeepSpeed warm-up failed: {type(exc).__name__}: {exc}")


def warm_in_background() -> None:
    """Start `warm` on a daemon thread, once per engine (nothing if DeepSpeed is not installed).

    Every cell on the engine first waits for it (`wait`, an IPython pre_run_cell hook): a cell
    importing torch._dynamo (any optimizer's constructor does) while the warm-up imported
    torch._inductor saw half-initialised modules (ImportError: cannot import name ...)."""
    global _thread
    if _thread is not None or not installed():
        return
    use_own_ninja()  # here, on the engine's main thread: os.environ is not changed under a cell
    _thread = threading.Thread(target=_warm_then_freeze, name="mpnb-warm-deepspeed", daemon=True)
    _thread.start()
    with contextlib.suppress(ImportError):
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            shell.events.register("pre_run_cell", _wait_before_cell)


def _warm_then_freeze() -> None:
    warm()
    # DeepSpeed's import leaves ~300k objects that every full garbage collection would walk again
    # (0.3-0.4 s each on a CPU rank); no cell has made any yet: each waits for this thread
    gc.freeze()


def _wait_before_cell(info: Any = None) -> None:
    try:
        wait()
    except KeyboardInterrupt:
        # IPython swallows what a pre_run_cell hook raises and would run the cell anyway: the
        # stop button's interrupt is raised by the cell itself instead
        cell_raise.raise_in_next_cell(KeyboardInterrupt())


def wait() -> None:
    """Until the warm-up is done (at once if there is none): DeepSpeed is then imported and its ops loaded."""
    while _thread is not None and _thread.is_alive():
        _thread.join(0.2)  # in short joins, so a SIGINT (the stop button) is handled between them


def main() -> int:
    """Build DeepSpeed's ops for this machine into $TORCH_EXTENSIONS_DIR (idempotent; quick when built)."""
    if not installed():
        print("DeepSpeed is not installed: no ops to build.")
        return 0
    use_own_ninja()
    with contextlib.redirect_stdout(sys.stderr):  # the build's own lines; the summary goes to stdout
        names = load_ops()
    print(f"DeepSpeed ops ready: {', '.join(names) or 'none needed on this accelerator'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
