"""Code that brings its own `init_process_group` / `destroy_process_group` to engines that have a group.

Three cases (issue 15):
- A cell calls `dist.init_process_group(...)` while mpnb's group is live: when the request fits that
  group (`group_request.incompatibility` says None) the call returns at once with a one-line note;
  otherwise a `ConfigError` names the difference and `%mpnb run` (the patched function, `install`).
- A cell calls `dist.destroy_process_group()`: it really destroys; the next `%%distributed` cell on
  every rank forms mpnb's group again before its code runs (`before_cell`, from control's hook).
- A script that owns its group (`%mpnb run`): `script_owns_group()` parks mpnb's group around it.

Whenever the default group is formed again, its store is mpnb's: bound to the ranks' address only
(torch's env:// store listens on every interface, unauthenticated), on a port rank 0 holds from the
moment it is chosen (no race), agreed through the store `bootstrap.setup` formed the world with. That
store stays referenced here, so it outlives any destroy; a new port each time, because an old group
kept alive by a reference (a DDP model in the namespace) keeps its store listening on the old port.
Port agreements are numbered, so every rank must form groups in the same order: only cells on every
rank (and scripts, which run on every rank) form one.

Imports no torch at module level (the kernel imports `mpnb.engine.control`, which imports this).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from mpnb.engine import cell_raise, rendezvous
from mpnb.engine.group_request import (
    CAPABILITY,
    InitRequest,
    RunningGroup,
    describe,
    incompatibility,
    is_loopback,
    parse_backends,
    same_host,
)
from mpnb.errors import ConfigError, RankError

REFORMED_NOTE = "mpnb: process group re-formed (it was destroyed in an earlier cell)."
SUBSET_HINT = (
    "mpnb: the process group was destroyed in an earlier cell and this cell does not run on every "
    "rank, so it is not formed again here: run a %%distributed cell on all ranks first."
)
# modules that bound `init_process_group` by name when imported (torch 2.13); distributed_c10d defines it
_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d", "torch.distributed.device_mesh")


# -- engine state: set by `install` (bootstrap.setup), read by the patched function and the hooks
_original: Callable[..., Any] | None = None
_store: Any = None  # the store the world was formed with: kept, so port agreements outlive any destroy
_agreements = 0  # port agreements made so far on this rank (the store keys are numbered)
_parked = False  # a script owns the default group (script_owns_group): no interception
_script_formed = False  # the parked script called init_process_group (an early sys.exit did not)
_cell = 0  # %%distributed cells seen, for the once-per-cell note
_collective = True  # the current %%distributed cell runs on every rank (control's CELL_MARK line)
_noted_cell = -1


def install(store: Any) -> None:
    """After mpnb formed the world (bootstrap.setup): patch `init_process_group`, keep `store`."""
    global _original, _store, _agreements, _parked
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if _original is None:
        _original = distributed_c10d.init_process_group
        patched = functools.wraps(_original)(_init_process_group)
        for name in _MODULES:
            module = sys.modules.get(name)
            if module is not None and getattr(module, "init_process_group", None) is _original:
                module.init_process_group = patched
        dist.init_process_group = patched
        destroy = distributed_c10d.destroy_process_group
        dist.destroy_process_group = distributed_c10d.destroy_process_group = functools.wraps(destroy)(
            functools.partial(_destroy_then_yield_gil, destroy)
        )
    _store, _agreements, _parked = store, 0, False


def _destroy_then_yield_gil(destroy: Callable[..., Any], group: Any = None) -> None:
    """torch's `destroy_process_group`, then a short sleep that lets gloo's worker threads take the GIL.

    A DDP model freed right after (a script's `main()` returning) drops the last reference to the gloo
    group and joins its worker threads with the GIL held, while a worker still releasing a finished
    collective's tensors waits for the GIL: a deadlock (pytorch/pytorch#56297). In a torchrun worker it
    is rare; on an engine, whose other threads also want the GIL, it hung 3 runs in 5."""
    destroy(group)
    time.sleep(0.05)


def forget() -> None:
    """Drop the kept store (bootstrap.teardown): the engine leaves the world."""
    global _store
    _store = None


def real_init_process_group(*args: Any, **kwargs: Any) -> Any:
    """torch's own function, never intercepted (mpnb's own group formation). The connections the
    group opens are recorded, so that `control.release_peers` can end them on any host, and those to
    other hosts fail within seconds if that host drops off the network (`gloo_unblock.fail_fast`)."""
    from mpnb.engine import gloo_unblock

    if _original is not None:
        init = _original
    else:
        import torch.distributed as dist

        init = dist.init_process_group
    result, _state().group_connections = gloo_unblock.connections_opened_by(lambda: init(*args, **kwargs))
    gloo_unblock.fail_fast(_state().group_connections)
    return result


def _state() -> Any:
    from mpnb.engine import state

    return state


def running_group() -> RunningGroup:
    import torch.distributed as dist

    state = _state()
    config = str(dist.get_backend_config())
    backends = parse_backends(config) if ":" in config else parse_backends(config, _capability())
    hosts = {socket.gethostname()} if is_loopback(state.master_addr) else set()
    return RunningGroup(
        backends=backends,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        master_addr=state.master_addr,
        device_type=str(state.device).split(":")[0],
        hosts=frozenset(hosts),
    )


def _capability() -> Mapping[str, Sequence[str]]:
    from torch.distributed import Backend

    return getattr(Backend, "backend_capability", CAPABILITY)


def _bind(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name (defaults left out), as torch's signature binds them."""
    assert _original is not None
    return dict(inspect.signature(_original).bind(*args, **kwargs).arguments)


def _request(call: Mapping[str, Any]) -> InitRequest:
    backend = call.get("backend")
    return InitRequest(
        backend=None if backend is None else str(backend),
        init_method=call.get("init_method"),
        rank=int(call.get("rank", -1)),
        world_size=int(call.get("world_size", -1)),
        store=call.get("store") is not None,
    )


def _init_process_group(*args: Any, **kwargs: Any) -> Any:
    """`torch.distributed.init_process_group` on an mpnb engine (see the module's docstring)."""
    import torch.distributed as dist

    assert _original is not None
    global _script_formed
    call = _bind(args, kwargs)
    _script_formed = _script_formed or _parked
    if not _parked and dist.is_initialized():
        group = running_group()
        problem = incompatibility(_request(call), group, _capability())
        if problem is not None:
            raise ConfigError(
                f"init_process_group() asks for another process group than the one mpnb formed on these "
                f"engines ({describe(group)}): {problem}. To run a script with its own process group, use "
                "`%mpnb run script.py`; in a cell, call dist.init_process_group() without these arguments "
                "to use mpnb's group (or dist.destroy_process_group() first to replace it)."
            )
        _note_once(
            f"mpnb: init_process_group() uses mpnb's process group ({describe(group)}) "
            "already formed on these engines."
        )
        return None
    if not dist.is_initialized() and _injectable(call):  # (initialized: torch's own error, at once)
        return _init_with_mpnb_store(call)
    return _original(*args, **kwargs)


def _note_once(line: str) -> None:
    global _noted_cell
    if _noted_cell != _cell:
        _noted_cell = _cell
        print(line, flush=True)  # informational: stdout, not painted as an error


def _injectable(call: Mapping[str, Any]) -> bool:
    """A default-group request on mpnb's world that torch would serve with its env:// store."""
    state = _state()
    if _store is None or call.get("store") is not None or not (_parked or _collective):
        return False
    if str(call.get("backend") or "").lower() in ("mpi", "fake"):
        return False
    group = RunningGroup(
        backends={}, rank=state.rank, world_size=state.world_size, master_addr=state.master_addr
    )
    init_method = call.get("init_method")
    if init_method in (None, "env://") and not same_host(os.environ.get("MASTER_ADDR", ""), group):
        return False  # the code pointed env:// at another host itself
    if init_method is not None:
        url = urlsplit(str(init_method))
        if (
            url.query
            or url.scheme not in ("env", "tcp")
            or (url.scheme == "tcp" and not same_host(url.hostname or "", group))
        ):
            return False
    return call.get("rank", -1) in (-1, state.rank) and call.get("world_size", -1) in (-1, state.world_size)


def _init_with_mpnb_store(call: Mapping[str, Any]) -> Any:
    import datetime

    assert _original is not None
    state = _state()
    rest = {k: v for k, v in call.items() if k not in ("init_method", "rank", "world_size", "store")}
    timeout = rest.get("timeout") or datetime.timedelta(seconds=state.timeout_s)
    port, listener = agree_port(hold=True)
    store = rendezvous.store(
        state.rank, state.world_size, state.master_addr, port, timeout, listener=listener
    )
    return _original(store=store, rank=state.rank, world_size=state.world_size, **rest)


def agree_port(hold: bool) -> tuple[int, socket.socket | None]:
    """A port on the ranks' address that every rank agrees on (a collective through the kept store).

    Rank 0 chooses it; with `hold`, it keeps it as a listening socket (for `rendezvous.store`)."""
    global _agreements
    state = _state()
    if _store is None:
        raise RuntimeError("mpnb's world was not formed on this engine (no rendezvous store)")
    key = f"mpnb/own_group/port/{_agreements}"
    _agreements += 1
    if state.rank != 0:
        return int(_store.get(key)), None
    listener = rendezvous.listen(state.master_addr)
    port = listener.getsockname()[1]
    if not hold:
        listener.close()
        listener = None
    _store.set(key, str(port))
    return port, listener


def form_again() -> None:
    """mpnb's group on the same engines, rank, world size, backend and timeout; on a new agreed port."""
    import datetime

    state = _state()
    timeout = datetime.timedelta(seconds=state.timeout_s)
    port, listener = agree_port(hold=True)
    store = rendezvous.store(
        state.rank, state.world_size, state.master_addr, port, timeout, listener=listener
    )
    real_init_process_group(
        state.backend, store=store, rank=state.rank, world_size=state.world_size, timeout=timeout
    )
    state.master_port = port
    os.environ["MASTER_PORT"] = str(port)


def _end_group(broken: bool) -> None:
    """Destroy the default group whatever state it is in (abort first when it may be broken: NCCL)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return
    if broken:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            with contextlib.suppress(Exception):
                abort()
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()


def _heal_advice(why: BaseException) -> str:
    return (
        f"mpnb could not form its process group again ({type(why).__name__}: {why}); a rank may have died "
        "or be stuck. Run `%mpnb heal` to rebuild it on the live engines (namespaces kept), or "
        "`%mpnb restart` for fresh engines."
    )


@contextlib.contextmanager
def script_owns_group() -> Iterator[None]:
    """Run a script that forms and destroys its own default group; mpnb's group is back afterwards.

    Every rank enters and leaves together. Inside, `init_process_group` is torch's own, except that a
    request torch would serve with its env:// store gets mpnb's loopback-bound store instead (the
    script's backend, timeout, device_id... kept); MASTER_PORT is a port free for the script. On exit
    (also by an exception or KeyboardInterrupt) whatever group the script left is destroyed and mpnb's
    formed again; if that fails, a RankError says to heal or restart, chained to the script's error.
    """
    global _parked, _script_formed
    state = _state()
    master_port = os.environ.get("MASTER_PORT")
    _script_formed = False
    script_port, _ = agree_port(hold=False)  # for a script that makes its own TCPStore on MASTER_PORT
    _end_group(broken=False)
    _parked = True
    os.environ["MASTER_PORT"] = str(script_port)
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        _parked = False
        os.environ["MASTER_PORT"] = master_port or str(state.master_port)
        _end_group(broken=error is not None)
        try:
            form_again()
        except BaseException as exc:
            _end_group(broken=True)
            raise RankError(_heal_advice(exc)) from (error or exc)


def script_formed_group() -> bool:
    """Inside `script_owns_group`: whether the script has called `init_process_group` yet."""
    return _script_formed


def before_cell(collective: bool) -> None:
    """Before each `%%distributed` cell (control's pre_run_cell hook): form the group again if a cell
    destroyed it. IPython swallows a hook's exception, so a failure is raised by the cell itself."""
    global _cell, _collective
    _cell += 1
    _collective = collective
    dist = sys.modules.get("torch.distributed")
    if _store is None or _parked or dist is None or dist.is_initialized():
        return
    if not collective:
        print(SUBSET_HINT, file=sys.stderr, flush=True)
        return
    try:
        _end_group(broken=True)
        form_again()
    except KeyboardInterrupt as exc:
        cell_raise.raise_in_next_cell(exc)
    except Exception as exc:
        _end_group(broken=True)
        error = RankError(_heal_advice(exc))
        error.__cause__ = exc
        cell_raise.raise_in_next_cell(error)
    else:
        print(REFORMED_NOTE, flush=True)
