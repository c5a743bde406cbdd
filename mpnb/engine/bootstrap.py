"""Engine-side setup: environment, device binding and the process group.

The kernel calls `engine_info` on every engine (cheap, no torch) to learn where
each engine lives, assigns ranks from that, then calls `setup` on every engine
at once. `setup` binds the device *before* torch is imported (so that
CUDA_VISIBLE_DEVICES takes effect), initialises the default process group with
a short timeout, and fills the engine namespace and `mpnb.engine.state`.
Arguments are plain data only.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from typing import Any

from mpnb.engine import rendezvous


def _outbound_ip(towards: str | None) -> str:
    """The address other hosts reach this one on: the interface routing towards the controller."""
    if towards and towards not in ("127.0.0.1", "localhost", "0.0.0.0", "*"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((towards, 9))  # UDP connect sends nothing; it only picks a route
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def free_port(address: str = "127.0.0.1") -> int:
    """A port free on `address`, the one rank 0's store will listen on (never all interfaces)."""
    family = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


_chosen_ifnames: dict[str, str] = {}  # what mpnb set, which a later world may change (a user's choice stays)


def _choose_socket_interfaces(master_addr: str) -> None:
    """The interface gloo (and NCCL across hosts) listen and connect on, unless the user chose one.

    On one host: loopback for gloo (its default follows the host name, which may resolve to an
    outside address). On several: the interface that routes to rank 0 for both, since where the
    host name does not resolve gloo falls back to 127.0.0.1 and every peer refuses it; a loopback
    choice is replaced there. Gloo groups made beside an nccl world read GLOO_SOCKET_IFNAME too.
    """
    import psutil

    interfaces = psutil.net_if_addrs()
    loopback = sorted(name for name, addrs in interfaces.items()
                      if any(_is_loopback(_address(a)) for a in addrs if _is_inet(a)))
    if _is_loopback(master_addr):
        choices = {"GLOO_SOCKET_IFNAME": loopback[:1]}
    else:
        own = _outbound_ip(master_addr)
        routed = sorted(name for name, addrs in interfaces.items() if any(_address(a) == own for a in addrs))
        choices = {"GLOO_SOCKET_IFNAME": routed[:1], "NCCL_SOCKET_IFNAME": routed[:1]}
    for var, wanted in choices.items():
        current = os.environ.get(var)
        users = current is not None and current != _chosen_ifnames.get(var)
        if users and not (current in loopback and not _is_loopback(master_addr)):
            continue
        if wanted:
            os.environ[var] = _chosen_ifnames[var] = wanted[0]
        else:
            os.environ.pop(var, None)
            _chosen_ifnames.pop(var, None)


def _is_inet(addr: Any) -> bool:
    return addr.family in (socket.AF_INET, socket.AF_INET6)


def _address(addr: Any) -> str:
    return str(addr.address).split("%")[0]  # an IPv6 link-local address carries its scope


def _is_loopback(address: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def engine_info(controller_ip: str | None = None) -> dict[str, Any]:
    """Where this engine lives: host, pid, address, GPUs it can see. Does not import torch."""
    from mpnb.cluster import devices, logs
    from mpnb.cluster.reaper import start_ticks
    from mpnb.engine import control

    nannies = nannies_started()
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": start_ticks(os.getpid()),
        "ip": _outbound_ip(controller_ip),
        "gpus": [g.index for g in devices.visible_gpus()],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "torch_imported": "torch" in sys.modules,
        "free_port": free_port(),
        "nannies": [pid for pid, _ in nannies],
        "nanny_started": [started for _, started in nannies],
        "stacks": control.stack_path(),
        "log": logs.engine_log_path(),  # where this engine's library chatter goes (mpnb.engine.quiet)
    }


def setup(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    group_rank: int,
    group_world_size: int,
    master_addr: str,
    master_port: int,
    backend: str,
    gpu: int | None,
    timeout_s: float,
    config: dict[str, Any],
) -> dict[str, Any]:
    """Make this engine rank `rank`: env vars, device, process group, namespace.

    `gpu` is the physical GPU index to bind (None for CPU). Binding sets
    CUDA_VISIBLE_DEVICES to that one GPU, so the device is always `cuda:0` here.
    """
    env = {
        "RANK": rank,
        "LOCAL_RANK": local_rank,
        "WORLD_SIZE": world_size,
        "LOCAL_WORLD_SIZE": local_world_size,
        "GROUP_RANK": group_rank,  # the node rank, as torchrun names it
        "GROUP_WORLD_SIZE": group_world_size,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
    }
    os.environ.update({k: str(v) for k, v in env.items()})
    from mpnb.engine import ds_ops, quiet, traceback_warmup

    ds_ops.default_extensions_dir()

    quiet.install_warnings()  # before torch: its import-time warnings go to the engine's log too
    if gpu is None:
        # CPU ranks share cores; one OpenMP thread each avoids oversubscription.
        os.environ["OMP_NUM_THREADS"] = "1"
    elif "torch" not in sys.modules:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    from mpnb.engine import boot

    boot.wait_for_torch()  # a CPU engine mpnb launched imports torch while it registers

    import datetime

    import torch
    import torch.distributed as dist

    _freeze_imports()

    if gpu is None:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"GPU {gpu} was assigned to this rank but torch here cannot use CUDA "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False). "
                "Install a CUDA build of torch on the engines, or start CPU engines with `--backend gloo`."
            )
        # torch was imported before binding (connect to a used engine): index the physical GPU.
        index = 0 if os.environ.get("CUDA_VISIBLE_DEVICES") == str(gpu) else gpu
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)

    if dist.is_initialized():
        dist.destroy_process_group()
    _choose_socket_interfaces(master_addr)
    timeout = datetime.timedelta(seconds=timeout_s)
    from mpnb.engine import own_group, state
    from mpnb.engine.comm_bytes import CommCounter

    if state.comm_counter is None:
        state.comm_counter = CommCounter()
    store = rendezvous.store(rank, world_size, master_addr, master_port, timeout)  # loopback-bound
    own_group.real_init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    # what forming the group again needs (own_group: a cell destroyed it, or a script owned it)
    state.timeout_s = timeout_s
    own_group.install(store)  # a cell's own init_process_group uses this group

    import mpnb
    from mpnb.engine import control

    control.install()  # cooperative stop and stack dumps in %%distributed cells
    quiet.install()  # library chatter to the engine's log; `%%distributed --verbose` shows it
    ds_ops.warm_in_background()  # the first ZeRO cell then finds DeepSpeed imported and its ops loaded
    traceback_warmup.start_in_background()  # a rank's first error is then formatted as fast as later ones

    state.rank, state.world_size = rank, world_size
    state.local_rank, state.local_world_size = local_rank, local_world_size
    state.group_rank, state.group_world_size = group_rank, group_world_size
    state.device, state.backend = str(device), backend
    state.master_addr, state.master_port = master_addr, master_port
    state.set_config(config)

    shell = _shell()
    if shell is not None:
        shell.user_ns.update(
            rank=rank, world_size=world_size, device=device, torch=torch, dist=dist, mpnb=mpnb
        )
    return {"rank": rank, "device": str(device), "pid": os.getpid()}


_imports_frozen = False


def _freeze_imports() -> None:
    """Keep the garbage collector off the ~200k objects torch's import made (once per process).

    A full collection walks every tracked object: 0.3-0.5 s on a CPU rank, landing in whatever
    runs then (a training step, a checkpoint load). The first setup comes before any cell."""
    global _imports_frozen
    import gc

    if not _imports_frozen:
        gc.freeze()
        _imports_frozen = True


def teardown() -> None:
    """Leave the process group (before stop/disconnect), so a new one can be built later."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()
    own_group = sys.modules.get("mpnb.engine.own_group")
    if own_group is not None:
        own_group.forget()  # its kept store goes too


def prepare_exit() -> None:
    """Leave the process group, then spare the engine's exit a full garbage collection.

    After torch (and DeepSpeed) ran, the collection at interpreter exit took 5-9 s on a busy
    machine, so ipyparallel's 5 s TERM grace ran out; frozen objects are skipped by it.
    """
    import gc

    teardown()
    gc.freeze()


def nanny_pids() -> list[int]:
    """Child processes of this engine that are ipyparallel nannies (they relay signals to it)."""
    return [pid for pid, _ in nannies_started()]


def nanny_pairs() -> list[str]:
    """This engine's nannies as the nanny reaper's arguments (`mpnb/cluster/reaper.py`)."""
    from mpnb.cluster.reaper import pair

    return [pair(os.getpid(), pid, started) for pid, started in nannies_started()]


def nannies_started() -> list[tuple[int, float]]:
    """(pid, `reaper.start_time`) of each nanny child: the reaper skips a pid reused since."""
    import psutil

    from mpnb.cluster.reaper import is_nanny, start_time

    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if is_nanny(child):
                found.append((child.pid, start_time(child)))
    return found


def _shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()
