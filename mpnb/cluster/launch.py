"""Everything decided before a world forms: checked start arguments, the plan for local engines,
and finding the engines of a cluster started outside the notebook.

Every user choice is checked here, in the kernel, before any process starts, so a
mistake costs nothing to fix and the message can name the option.

Kernel side: never imports torch.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mpnb.errors import ClusterError, ConfigError

DEFAULT_CPU_ENGINES = 2
DEFAULT_PG_TIMEOUT_S = 60.0
BACKENDS = ("gloo", "nccl")
# Engines one start may launch: a few per core (oversubscribed CPU ranks are fine for testing), at
# least MIN_ENGINE_LIMIT; each is a Python process with torch, so more would exhaust memory.
ENGINES_PER_CORE = 4
MIN_ENGINE_LIMIT = 64


@dataclass
class WorldPlan:
    """What a world needs, decided before any engine work: validated user choices."""

    backend: str | None  # None: pick from the engines (nccl if every rank has a GPU)
    timeout_s: float
    port: int | None
    devices: list[int] | None  # local start: physical GPUs, one per engine, in rank order
    cpu_only: bool = False  # local start without GPUs: never bind one, even if an engine sees some
    spares: bool = False  # keep a warm spare engine set for restarts (`mpnb.cluster.spares`)


# ----------------------------------------------------------------------------- start arguments


def check_timeout(
    timeout: Any, example: str = f"`%mpnb start --timeout 60` (the default is {DEFAULT_PG_TIMEOUT_S:g})"
) -> float:
    """A number of seconds, from a number or the text a person typed; every `--timeout` goes through here.

    0, negative, NaN and infinite values are refused: each would turn a bound into none at all, or
    into an instant failure. `example` shows the fix for the option being checked."""
    try:
        value = float(timeout) if not isinstance(timeout, bool) else float("nan")
    except (TypeError, ValueError, OverflowError):
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(
            f"--timeout must be a positive number of seconds, not {timeout!r}. Example: {example}."
        )
    return value


def check_backend(backend: str | None) -> str | None:
    if backend is None:
        return None
    if backend not in BACKENDS:
        raise ConfigError(f"Unknown backend {backend!r}. Use --backend gloo (CPU or GPU) or nccl (GPU).")
    return backend


def check_port(port: Any) -> int | None:
    if port is None:
        return None
    try:
        value = int(port)
    except (TypeError, ValueError):
        value = -1
    if not 1 <= value <= 65535:
        raise ConfigError(f"--port must be a TCP port between 1 and 65535, not {port!r}.")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", value))  # a local world's store listens there, and only there
        except OSError:
            raise ClusterError(
                f"Port {value} is already in use on this machine, so rank 0 cannot host the process "
                "group there. Leave --port out to pick a free port, or choose another one."
            ) from None
    return value


def parse_devices(devices: str | Sequence[int] | None) -> list[int] | None:
    if devices is None:
        return None
    if isinstance(devices, str):
        items = [d.strip() for d in devices.split(",") if d.strip()]
        try:
            parsed = [int(d) for d in items]
        except ValueError:
            raise ConfigError(
                f"--devices takes GPU indices separated by commas, like `--devices 0,1`, not {devices!r}."
            ) from None
    else:
        parsed = [int(d) for d in devices]
    if not parsed:
        raise ConfigError("--devices is empty. Give GPU indices like `--devices 0,1`, or leave it out.")
    if len(set(parsed)) != len(parsed):
        raise ConfigError(f"--devices lists a GPU twice ({devices!r}). Give each GPU once: one rank per GPU.")
    return parsed


def plan_local(
    n: int | None,
    devices: str | Sequence[int] | None,
    backend: str | None,
    timeout: Any,
    port: Any,
    spares: bool = True,
) -> tuple[int, WorldPlan]:
    """Check every user choice for a local start; return the engine count and the plan."""
    from mpnb.cluster import devices as device_probe

    timeout_s = check_timeout(timeout)
    backend = check_backend(backend)
    wanted = parse_devices(devices)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(
            f"-n must be a whole number of engines, at least 1, not {n!r}. Example: `%mpnb start -n 2`."
        )
    most = max(MIN_ENGINE_LIMIT, ENGINES_PER_CORE * (os.cpu_count() or 1))
    if n is not None and n > most:  # a typo (-n 2000) would start thousands of engine processes
        raise ConfigError(
            f"-n {n} would start {n:,} engine processes; this machine ({os.cpu_count()} CPU cores) "
            f"takes at most {most}. Use a smaller -n, e.g. `%mpnb start -n 2`."
        )

    visible = [g.index for g in device_probe.visible_gpus()]
    if wanted is not None:
        missing = [d for d in wanted if d not in visible]
        if missing:
            seen = ", ".join(map(str, visible)) if visible else "none (this machine has no visible GPU)"
            fix = "Pick from the visible ones" if visible else "Leave --devices out to start CPU engines"
            raise ConfigError(
                f"GPU {', '.join(map(str, missing))} is not visible to this kernel. "
                f"Visible GPUs: {seen}. {fix}."
            )
        if n is not None and n != len(wanted):
            raise ConfigError(
                f"-n {n} does not match --devices {','.join(map(str, wanted))} ({len(wanted)} GPUs): "
                "mpnb starts one engine per GPU. Give only one of them."
            )
        gpus: list[int] | None = wanted
    elif visible and backend != "gloo":
        if n is not None and n > len(visible):
            raise ConfigError(
                f"-n {n} asks for more engines than there are visible GPUs ({len(visible)}). "
                f"Use -n {len(visible)} or fewer, or `--backend gloo` for CPU engines."
            )
        gpus = visible[: n or len(visible)]
    else:
        gpus = None

    if gpus is None and backend == "nccl":
        raise ConfigError("The nccl backend needs GPUs and none are in use here. Use `--backend gloo`.")
    count = len(gpus) if gpus is not None else (n or DEFAULT_CPU_ENGINES)
    return count, WorldPlan(
        backend=backend,
        timeout_s=timeout_s,
        port=check_port(port),
        devices=gpus,
        cpu_only=gpus is None,
        spares=bool(spares),
    )


# ----------------------------------------------------------------------------- a local cluster

# The controller counts an engine as registered only on its first heartbeat, and pings every 3 s
# by default: about 5 s of an 8 s start. 100 ms pings with 300 misses allowed keep the time to
# declare an engine dead at ipyparallel's default (3 s x 10 misses = 30 s).
HEARTBEAT_MS = 100
HEARTBEAT_MISSES = 300
CONTROLLER_ARGS = [
    f"--HeartMonitor.period={HEARTBEAT_MS}",
    f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}",
]


def local_cluster(count: int, plan: WorldPlan, log: Any) -> Any:
    """An unstarted `ipp.Cluster` of `count` engines that registers fast and imports torch meanwhile.

    Engines start with the controller (`send_engines_connection_env=False`: they wait for its
    connection file instead of being launched after it), run `mpnb.engine.boot`, and CPU engines
    import torch on a thread while they register. shutdown_atexit=False: ipyparallel's exit hook
    prints into the kernel's stderr; the lifecycle stops the cluster at exit instead.
    """
    import sys

    import ipyparallel as ipp
    from traitlets.config import Config

    config = Config()
    config.LocalEngineSetLauncher.engine_cmd = [sys.executable, "-m", "mpnb.engine.boot"]
    if plan.cpu_only:  # a GPU engine imports torch only after it was bound to its GPU
        config.LocalEngineSetLauncher.environment = {"MPNB_PRELOAD": "torch", "OMP_NUM_THREADS": "1"}
    return ipp.Cluster(
        n=count,
        delay=0,
        config=config,
        controller_args=CONTROLLER_ARGS,
        send_engines_connection_env=False,
        log=log,
        shutdown_atexit=False,
    )


# ----------------------------------------------------------------------------- an outside cluster


def profile_args(profile: str) -> dict[str, str]:
    """ipyparallel's keyword for `profile`: a path names a profile directory, anything else a profile."""
    expanded = os.path.expanduser(profile)
    if os.sep in profile or os.path.isdir(expanded):
        return {"profile_dir": os.path.abspath(expanded)}
    return {"profile": profile}


def known_cluster_ids(profile_kwargs: dict[str, str]) -> list[str]:
    """Ids of the clusters with a connection file in the profile, to list when the one asked for is not."""
    import ipyparallel as ipp

    try:
        profile_dir = ipp.Cluster(**profile_kwargs).profile_dir
    except Exception:
        return []
    ids = []
    for path in glob.glob(os.path.join(profile_dir, "security", "ipcontroller-*client.json")):
        name = os.path.basename(path)[len("ipcontroller-") : -len("client.json")]
        ids.append(name.rstrip("-") or "''")
    return sorted(ids)


# Engines started by hand (`ipengine`) are not in the cluster file; once some have registered,
# the count must hold this long before we take it as the whole cluster.
_ENGINE_COUNT_SETTLE_S = 3.0


def wait_for_launched_engines(
    client: Any, profile_kwargs: dict[str, str], cluster_id: str, timeout: float
) -> bool:
    """Wait until every engine the cluster file lists has registered; False if none came at all.

    The file is read again on every poll: `ipcluster start` writes it once when the controller is
    up and again only after it launched the engines (one second later by default), so a single read
    right after the connection file appears sees no engines and would form a world too small.
    """
    deadline = time.monotonic() + timeout
    seen, settled_since = -1, time.monotonic()
    while True:
        now = time.monotonic()
        registered = len(client.ids)
        expected = expected_engines(profile_kwargs, cluster_id)
        if expected and registered >= expected:
            return True
        if not expected and registered:
            if registered != seen:
                seen, settled_since = registered, now
            elif now - settled_since >= _ENGINE_COUNT_SETTLE_S:
                return True
        if now >= deadline:
            return registered > 0
        time.sleep(0.2)


def expected_engines(profile_kwargs: dict[str, str], cluster_id: str) -> int:
    """Engines the cluster file says were launched (0 if unknown), so we wait for all of them.

    Read as JSON, not with `Cluster.from_file`: that rebuilds the launchers, and a rebuilt SSH
    launcher starts a thread per engine that logs in to its host every few seconds for good.
    """
    import ipyparallel as ipp

    try:
        with open(ipp.Cluster(cluster_id=cluster_id, **profile_kwargs).cluster_file) as f:
            sets = json.load(f)["engines"]["sets"].values()
        return sum(int(engine_set.get("n") or 0) for engine_set in sets)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0

