"""Engine side of `%mpnb run script.py args`: run a torchrun-style script on this rank, as torchrun would.

`run_script` gives the script what `torchrun --nproc_per_node N script.py args` gives each worker:
`__name__ == "__main__"`, `__file__`, `sys.argv`, the script's directory first on `sys.path`, the
notebook's directory as the current one, and torchrun's environment (`torchrun_env`). The script's
own `init_process_group` / `destroy_process_group` run for real inside `own_group.script_owns_group()`,
which parks mpnb's group before and re-forms it after. `mp.spawn` is refused while the script runs:
mpnb already is the launcher.

Everything the run changed in this process is put back afterwards (argv, path, cwd, environment,
`sys.modules["__main__"]`), and the modules the script imported from its own directory tree are
forgotten, so an edited sibling module is read again next run. With `keep`, the script's globals are
merged into the engine namespace, like IPython's `%run`.

The frames here carry `__tracebackhide__`, so IPython's traceback starts at the script's own lines;
the kernel (`mpnb.execution.script`) drops the one generated cell line above them.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import os
import site
import sys
import sysconfig
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mpnb.errors import MpnbError

SPAWN_REFUSED = (
    "mpnb is the launcher: it already runs this script once per rank, as torchrun would, so "
    "{name}() would start a second set of workers. Call the worker function directly with "
    "rank=int(os.environ['RANK']) and world_size=int(os.environ['WORLD_SIZE']), e.g. "
    "`if 'RANK' in os.environ: main(int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])) "
    "else: mp.spawn(main, ...)`, which runs under torchrun and `%mpnb run` alike."
)


class ScriptExit(Exception):
    """The script called `sys.exit` with a failure: a code other than 0, or a message."""


def run_script(
    path: str,
    argv: Sequence[str],
    cwd: str,
    keep: bool = False,
    *,
    argv0: str | None = None,
    run_id: str = "mpnb",
) -> None:
    """Run the script at `path` (absolute) with `argv` from directory `cwd`, as a torchrun worker.

    `argv0` is `sys.argv[0]` as the user typed the path (torchrun passes it on unchanged);
    `run_id` is `TORCHELASTIC_RUN_ID`, the same on every rank of one run.
    """
    __tracebackhide__ = True  # IPython shows the script's frames, not this one
    code = compile(_read(path), path, "exec", dont_inherit=True)  # no __future__ flags from this module
    main = types.ModuleType("__main__")
    namespace = main.__dict__
    namespace.update(
        __file__=path, __builtins__=builtins, __package__=None, __spec__=None, __loader__=None,
        __cached__=None,
    )
    script_dir = os.path.dirname(path)
    try:
        with _restored(script_dir):
            sys.argv = [argv0 or path, *argv]
            sys.path.insert(0, script_dir)
            _chdir(cwd)
            os.environ.update(torchrun_env(run_id))
            sys.modules["__main__"] = main  # pickle finds the script's classes as `__main__.Name`, as usual
            from mpnb.engine import own_group

            with spawn_refused(), own_group.script_owns_group():
                try:
                    exec(code, namespace)
                except SystemExit as exc:
                    failure = exit_failure(exc.code, os.path.basename(path))
                    if failure is not None:  # its traceback: the script's frames, down to its sys.exit call
                        raise ScriptExit(failure).with_traceback(_script_frames(exc.__traceback__)) from None
                    if not own_group.script_formed_group():  # `if not torch.cuda.is_available(): sys.exit()`
                        print(early_exit_note(path, exc), flush=True)
    finally:
        if keep:  # also after a failure: that is when there is most to inspect
            _keep_globals(namespace)
    if not keep:  # the script's functions hold its globals in cycles: free its model now, as an exit would
        del main, namespace
        gc.collect()


def exit_failure(code: Any, name: str) -> str | None:
    """What a `sys.exit(code)` means for a run: None for success, else the message saying why it failed.

    As in Python's own exit: None and 0 succeed; another int is the exit code; anything else is a
    message (printed, exit code 1)."""
    if code is None or (code == 0 and isinstance(code, int)):
        return None
    if isinstance(code, int):
        return f"{name} exited with code {int(code)}"
    return f"{name} exited with code 1: {code}"


def early_exit_note(path: str, exc: SystemExit) -> str:
    """The line shown when a script exits successfully before forming a process group: it trained nothing,
    which a silent success would hide."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = tb.tb_lineno  # the script's last frame: where it called sys.exit
        tb = tb.tb_next
    where = f" at line {line}" if line is not None else ""
    code = "" if exc.code is None else repr(exc.code)
    return (
        f"mpnb: {os.path.basename(path)} called sys.exit({code}){where} "
        "before forming a process group, so it did no distributed work."
    )


def torchrun_env(run_id: str) -> dict[str, str]:
    """The variables torchrun's agent sets for each worker (torch/distributed/elastic/agent/server/
    local_elastic_agent.py, `_start_workers`), for this rank of the live world."""
    from mpnb.engine import state

    env = {
        "RANK": state.rank,
        "LOCAL_RANK": state.local_rank,
        "WORLD_SIZE": state.world_size,
        "LOCAL_WORLD_SIZE": state.local_world_size,
        "GROUP_RANK": state.group_rank,
        "GROUP_WORLD_SIZE": state.group_world_size,
        "ROLE_RANK": state.rank,  # one role, "default": its ranks are the global ones
        "ROLE_WORLD_SIZE": state.world_size,
        "ROLE_NAME": "default",
        "MASTER_ADDR": state.master_addr,
        "MASTER_PORT": state.master_port,
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": 0,
        "TORCHELASTIC_MAX_RESTARTS": 0,
        # rank 0 serves the script's store itself (no agent store to join, unlike torchrun's c10d rendezvous)
        "TORCHELASTIC_USE_AGENT_STORE": False,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    return {k: str(v) for k, v in env.items()}


# ----------------------------------------------------------------------------- helpers


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise MpnbError(
            f"This rank cannot read the script {path}: {exc.strerror or exc}. On several hosts the script "
            "must be at the same path on each, as for torchrun; copy it there and run again."
        ) from None


def _chdir(cwd: str) -> None:
    try:
        os.chdir(cwd)
    except OSError as exc:
        raise MpnbError(
            f"This rank cannot enter the notebook's directory {cwd}: {exc.strerror or exc}. On several hosts "
            "it must exist on each (as torchrun needs); create it there, or `%cd` to one that does."
        ) from None


def _script_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The part of a traceback caught in `run_script` that lies in the script (from its module frame on)."""
    return tb.tb_next if tb is not None else None


@contextlib.contextmanager
def _restored(script_dir: str) -> Iterator[None]:
    """Put argv, sys.path, the cwd, the environment and `__main__` back after the run, and forget the
    modules the script imported from its own tree (torchrun's next run would read them afresh)."""
    __tracebackhide__ = True
    argv, path, cwd = sys.argv, sys.path, os.getcwd()
    argv_items, path_items = list(argv), list(path)
    environ = dict(os.environ)
    main = sys.modules.get("__main__")
    before = set(sys.modules)
    try:
        yield
    finally:
        sys.argv, sys.path = argv, path  # the same lists (a script may have replaced them), as they were
        argv[:], path[:] = argv_items, path_items
        with contextlib.suppress(OSError):
            os.chdir(cwd)
        _restore_environ(environ)
        _current_master_port()
        if main is not None:
            sys.modules["__main__"] = main
        for name in own_modules(script_dir, set(sys.modules) - before):
            sys.modules.pop(name, None)


def _current_master_port() -> None:
    """MASTER_PORT names mpnb's group as it is now: `own_group` formed it again on a new port."""
    from mpnb.engine import state

    if state.master_port and "MASTER_PORT" in os.environ:
        os.environ["MASTER_PORT"] = str(state.master_port)


def _restore_environ(saved: dict[str, str]) -> None:
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def own_modules(script_dir: str, names: set[str]) -> list[str]:
    """Of the modules `names`, those loaded from files in `script_dir`'s tree, but not from an installed
    place inside it (a project's `.venv`) and not mpnb itself: the script's own modules."""
    root = os.path.realpath(script_dir)
    installed = [os.path.realpath(p) for p in _install_dirs()]
    found = []
    for name in names:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if not file or name == "mpnb" or name.startswith("mpnb."):
            continue
        real = os.path.realpath(file)
        if _inside(real, root) and not any(_inside(real, d) for d in installed if not _inside(root, d)):
            found.append(name)
    return found


def _install_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    dirs = [sys.prefix, sys.base_prefix, sys.exec_prefix, paths.get("purelib"), paths.get("platlib")]
    with contextlib.suppress(Exception):
        dirs += [*site.getsitepackages(), site.getusersitepackages()]
    return [d for d in dirs if d]


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


@contextlib.contextmanager
def spawn_refused() -> Iterator[None]:
    """While the script runs, `mp.spawn` / `start_processes` raise `SPAWN_REFUSED` instead of forking."""
    __tracebackhide__ = True
    import torch.multiprocessing as mp

    spawn_module = sys.modules.get("torch.multiprocessing.spawn")
    places = [(mp, "spawn"), (mp, "start_processes")]
    if isinstance(spawn_module, types.ModuleType):
        places += [(spawn_module, "spawn"), (spawn_module, "start_processes")]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr in places if hasattr(obj, attr)]
    for obj, attr, _ in saved:
        setattr(obj, attr, _refusal(attr))
    try:
        yield
    finally:
        for obj, attr, original in saved:
            setattr(obj, attr, original)


def _refusal(name: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise MpnbError(SPAWN_REFUSED.format(name=f"mp.{name}"))

    refused.__name__ = name
    return refused


def _keep_globals(namespace: dict[str, Any]) -> None:
    """`--keep`: the script's globals join the engine namespace (dunder names excluded), as `%run` does."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None:
        shell.user_ns.update({k: v for k, v in namespace.items() if not _dunder(k)})


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


__all__ = [
    "SPAWN_REFUSED", "ScriptExit", "early_exit_note", "exit_failure", "own_modules", "run_script",
    "spawn_refused", "torchrun_env",
]
