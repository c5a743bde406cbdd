"""The one live cluster: start, connect, restart, stop, and the `Session` that holds it.

A `Session` owns an ipyparallel `Client` (and the `Cluster` when mpnb started
it), the rank table and the active `Config`. Ranks are assigned from engine
metadata (host, GPU, pid), never from engine ids, which change on restart.
Everything that can be checked in the kernel is checked before any process
starts, and a start that fails part-way stops whatever it started.

Kernel side: never imports torch.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpnb.errors import ClusterError, ConfigError, NoClusterError

if TYPE_CHECKING:
    import ipyparallel as ipp

    from mpnb.planning.config import Config

log = logging.getLogger("mpnb")

DEFAULT_CPU_ENGINES = 2
DEFAULT_PG_TIMEOUT_S = 60.0
BACKENDS = ("gloo", "nccl")
QUEUE_TTL_S = 1.0  # how long rank_status() reuses the controller's queue counts

Listener = Callable[["Session"], Any]


@dataclass(frozen=True)
class RankInfo:
    rank: int
    engine_id: int
    host: str
    pid: int
    device: str  # the torch device on the engine: "cpu" or "cuda:0" (bound to `gpu`)
    local_rank: int
    gpu: int | None = None  # physical GPU index on `host`, None for CPU ranks
    nannies: tuple[int, ...] = ()  # pids of the engine's ipyparallel nanny (relays signals to it)

    @property
    def device_label(self) -> str:
        return "cpu" if self.gpu is None else f"GPU {self.gpu}"


@dataclass
class _Plan:
    """What a world needs, decided before any engine work: validated user choices."""

    backend: str | None  # None: pick from the engines (nccl if every rank has a GPU)
    timeout_s: float
    port: int | None
    devices: list[int] | None  # local start: physical GPUs, one per engine, in rank order
    cpu_only: bool = False  # local start without GPUs: never bind one, even if an engine sees some


# ----------------------------------------------------------------------------- session


class Session:
    """The live cluster as the notebook sees it. Get it with `mpnb.session()`."""

    def __init__(
        self,
        client: ipp.Client,
        cluster: ipp.Cluster | None,
        plan: _Plan,
        config: Config,
        source: str,
    ) -> None:
        self.client = client
        self.cluster = cluster  # None when connected to a cluster mpnb did not start
        self.ranks: list[RankInfo] = []
        self.backend = plan.backend or "gloo"
        self.config = config
        self.source = source  # "start" or "connect --profile ..." (for messages)
        self.started_at = time.time()
        self.closed = False
        # The cell now (or last) running: {"id", "status", "ranks": {"0": status}} (dashboard contract).
        self.cell: dict[str, Any] | None = None
        # What changed last: start|stop|restart|config|cell (listeners read it; they get only the session).
        self.last_event = "start"
        # After a crash or a release: {"need": "heal"|"restart", "reason", ...} (mpnb.recovery), else None.
        self.health: dict[str, Any] | None = None
        self.full_world_size = 0  # the size before `%mpnb heal` shrank the world; restart brings it back
        self._plan = plan
        self._listeners: list[Listener] = []
        self._memory: Any = None
        self._queues: dict[int, Any] = {}
        self._queues_at = float("-inf")

    # -- ranks and views
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def timeout(self) -> float:
        return self._plan.timeout_s

    def engine_id(self, rank: int) -> int:
        if not 0 <= rank < len(self.ranks):
            raise ClusterError(
                f"There is no rank {rank}: this cluster has ranks 0-{self.world_size - 1}. "
                "Pick ranks from that range."
            )
        return self.ranks[rank].engine_id

    def rank_of_engine(self, engine_id: int) -> int | None:
        for info in self.ranks:
            if info.engine_id == engine_id:
                return info.rank
        return None

    def view(self, ranks: Sequence[int] | None = None) -> ipp.DirectView:
        """A DirectView over `ranks` (default all) in rank order."""
        self._check_open()
        chosen = range(self.world_size) if ranks is None else ranks
        view = self.client.direct_view([self.engine_id(r) for r in chosen])
        view.block = False
        return view

    def rank_status(self, fresh: bool = False) -> list[dict[str, Any]]:
        """One row per rank: rank, host, pid, device, alive, busy. Never asks a (possibly busy) engine.

        busy: running the current `%%distributed` cell, or with work queued at the controller. The
        controller's queue counts are a round trip, so they are cached for QUEUE_TTL_S unless `fresh`:
        listeners call this on every cell state change and must not slow a cell down.
        """
        alive_ids = set(self.client.ids)
        queues = self._queue_status(fresh)
        running = {int(r) for r, s in (self.cell or {}).get("ranks", {}).items() if s == "running"}
        rows = []
        for info in self.ranks:
            q = queues.get(info.engine_id, {})
            queued = bool(q.get("queue", 0) or q.get("tasks", 0)) if isinstance(q, dict) else False
            rows.append(
                {
                    "rank": info.rank,
                    "host": info.host,
                    "pid": info.pid,
                    "device": info.device_label,
                    "alive": info.engine_id in alive_ids,
                    "busy": info.rank in running or queued,
                }
            )
        return rows

    def _queue_status(self, fresh: bool) -> dict[int, Any]:
        now = time.monotonic()
        if fresh or now - self._queues_at > QUEUE_TTL_S:
            try:
                queues = self.client.queue_status()
            except Exception:  # controller gone: no queue information
                queues = {}
            self._queues = queues if isinstance(queues, dict) else {}
            self._queues_at = now
        return self._queues

    # -- config
    def set_config(self, cfg: Config) -> None:
        """Validate `cfg` for this world, keep it, and push it to `mpnb.engine.state` on every rank."""
        self._check_open()
        validate = getattr(cfg, "validate", None)
        if validate is not None:
            validate(self.world_size, self.device_kind)
        self.view().apply_sync(_set_engine_config, cfg.to_dict())
        self.config = cfg
        self._notify("config")

    @property
    def device_kind(self) -> str:
        return "cuda" if self.ranks and all(r.gpu is not None for r in self.ranks) else "cpu"

    # -- listeners
    def on_change(self, callback: Listener) -> Callable[[], None]:
        """Call `callback(session)` on start/stop/restart/config/cell changes; returns an unsubscribe."""
        self._listeners.append(callback)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(callback)

        return unsubscribe

    def set_cell_state(self, cell: dict[str, Any] | None) -> None:
        """Record the running cell's per-rank status (execution calls this) and tell listeners."""
        self.cell = cell
        self._notify("cell")

    def _notify(self, event: str) -> None:
        self.last_event = event
        for callback in [*self._listeners, *_global_listeners]:
            try:
                callback(self)
            except Exception:  # a broken listener must not break the cluster
                log.exception("mpnb on_change listener failed")

    # -- memory (the memory monitor's store; imported lazily so this module stays small)
    @property
    def memory(self) -> Any:
        if self._memory is None:
            from mpnb.monitoring.chart import MemoryStore

            self._memory = MemoryStore()
        return self._memory

    # -- lifecycle
    def _check_open(self) -> None:
        if self.closed:
            raise NoClusterError("This mpnb session was stopped. Start a new one with `%mpnb start`.")

    def summary(self, seconds: float | None = None) -> str:
        """The one line printed after start/connect/restart."""
        hosts = {r.host for r in self.ranks}
        devices = _compress_labels([r.device_label for r in self.ranks])
        where = f" on {len(hosts)} hosts" if len(hosts) > 1 else ""
        took = f" in {seconds:.1f} s" if seconds is not None else ""
        return (
            f"mpnb: {self.world_size} ranks{where} ready{took} · devices: {devices} · "
            f"backend {self.backend} · process group timeout {self.timeout:g} s"
        )

    def __repr__(self) -> str:
        state = "stopped" if self.closed else f"{self.world_size} ranks, {self.backend}"
        return f"<mpnb.Session {state}>"


def _compress_labels(labels: list[str]) -> str:
    """['cpu', 'cpu'] -> 'cpu x2'; ['GPU 0', 'GPU 1'] -> 'GPU 0, GPU 1'."""
    if labels and all(label == labels[0] for label in labels):
        return f"{labels[0]} x{len(labels)}" if len(labels) > 1 else labels[0]
    return ", ".join(labels)


def _set_engine_config(data: dict[str, Any]) -> None:
    from mpnb.engine import state

    state.set_config(data)


# ----------------------------------------------------------------------------- module state

_current: Session | None = None
_global_listeners: list[Listener] = []
_lock = threading.RLock()


def on_change(callback: Listener) -> Callable[[], None]:
    """Listen to every session, present and future (the dashboard registers here at load time)."""
    _global_listeners.append(callback)

    def unsubscribe() -> None:
        with contextlib.suppress(ValueError):
            _global_listeners.remove(callback)

    return unsubscribe


def session() -> Session:
    """The live session, or `NoClusterError` saying what to run."""
    if _current is None or _current.closed:
        raise NoClusterError()
    return _current


def current() -> Session | None:
    """The live session or None (for code that must not raise, e.g. the dashboard)."""
    return _current if _current is not None and not _current.closed else None


# ----------------------------------------------------------------------------- validation


def _check_no_session() -> None:
    if current() is not None:
        s = current()
        raise ClusterError(
            f"An mpnb cluster is already running ({s.world_size} ranks, {s.backend}). "
            "Use it, run `%mpnb restart` for fresh engines, or `%mpnb stop` before starting another."
        )


def _check_timeout(timeout: Any) -> float:
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(
            f"--timeout must be a positive number of seconds, not {timeout!r}. "
            f"Example: `%mpnb start --timeout 60` (the default is {DEFAULT_PG_TIMEOUT_S:g})."
        )
    return value


def _check_backend(backend: str | None) -> str | None:
    if backend is None:
        return None
    if backend not in BACKENDS:
        raise ConfigError(f"Unknown backend {backend!r}. Use --backend gloo (CPU or GPU) or nccl (GPU).")
    return backend


def _check_port(port: Any) -> int | None:
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
            s.bind(("", value))
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


def _plan_local(
    n: int | None, devices: str | Sequence[int] | None, backend: str | None, timeout: Any, port: Any
) -> tuple[int, _Plan]:
    """Check every user choice for a local start; return the engine count and the plan."""
    from mpnb.cluster import devices as device_probe

    timeout_s = _check_timeout(timeout)
    backend = _check_backend(backend)
    wanted = parse_devices(devices)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(
            f"-n must be a whole number of engines, at least 1, not {n!r}. Example: `%mpnb start -n 2`."
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
    return count, _Plan(
        backend=backend, timeout_s=timeout_s, port=_check_port(port), devices=gpus, cpu_only=gpus is None
    )


# ----------------------------------------------------------------------------- forming a world


def _wait_all(results: list[Any], timeout: float, what: str) -> list[Any]:
    """Wait for per-engine AsyncResults; raise at the first failure instead of waiting for the rest."""
    deadline = time.monotonic() + timeout
    pending = list(range(len(results)))
    while pending:
        for i in list(pending):
            ar = results[i]
            if ar.ready():
                pending.remove(i)
                if not ar.successful():
                    try:
                        ar.get()
                    except Exception as exc:
                        raise ClusterError(
                            f"{what} failed on engine {ar.engine_id}: {_short_error(exc)}"
                        ) from exc
        if pending:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{what} did not finish within {timeout:g} s on engines "
                    f"{[results[i].engine_id for i in pending]}."
                )
            results[pending[0]].wait(0.01)
    return [ar.get() for ar in results]


def _short_error(exc: BaseException) -> str:
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    return f"{ename}: {evalue}"


def _controller_ip(client: ipp.Client) -> str | None:
    url = getattr(client, "_config", {}).get("registration", "") or ""
    host = url.rpartition("//")[2].rpartition(":")[0]
    return host or None


def _assign_ranks(infos: dict[int, dict[str, Any]], plan: _Plan) -> list[dict[str, Any]]:
    """Order engines by (host, GPU, pid) and number them; local ranks count within each host."""
    order = sorted(
        infos,
        key=lambda eid: (
            infos[eid]["host"],
            infos[eid]["gpus"][0] if len(infos[eid]["gpus"]) == 1 else -1,
            infos[eid]["pid"],
        ),
    )
    per_host: dict[str, list[int]] = {}
    for eid in order:
        per_host.setdefault(infos[eid]["host"], []).append(eid)

    rows = []
    for rank, eid in enumerate(order):
        info = infos[eid]
        same_host = per_host[info["host"]]
        local_rank = same_host.index(eid)
        if plan.devices is not None:
            gpu: int | None = plan.devices[rank]
        elif plan.cpu_only:
            gpu = None
        elif len(info["gpus"]) == 1:
            gpu = info["gpus"][0]  # the launcher already gave this engine one GPU
        elif len(info["gpus"]) >= len(same_host):
            gpu = info["gpus"][local_rank]
        elif info["gpus"]:
            raise ClusterError(
                f"Host {info['host']} runs {len(same_host)} engines but sees only {len(info['gpus'])} GPUs. "
                "Start one engine per GPU there, or use `--backend gloo`."
            )
        else:
            gpu = None
        rows.append(
            {
                "rank": rank,
                "engine_id": eid,
                "info": info,
                "local_rank": local_rank,
                "local_world_size": len(same_host),
                "gpu": gpu,
            }
        )
    return rows


def _form_world(
    client: ipp.Client, engine_ids: list[int], plan: _Plan, config: Config
) -> tuple[list[RankInfo], str]:
    """Rank the engines, then run `bootstrap.setup` on all of them at once."""
    from mpnb.engine import bootstrap

    if not engine_ids:
        raise ClusterError("The cluster has no engines. Start some (e.g. `ipcluster start -n 2`) and retry.")
    controller_ip = _controller_ip(client)
    info_results = [client[eid].apply_async(bootstrap.engine_info, controller_ip) for eid in engine_ids]
    infos = dict(zip(engine_ids, _wait_all(info_results, 60.0, "Reading engine information"), strict=True))

    rows = _assign_ranks(infos, plan)
    gpus_used = [r["gpu"] for r in rows]
    backend = plan.backend or ("nccl" if all(g is not None for g in gpus_used) else "gloo")
    if backend == "nccl" and any(g is None for g in gpus_used):
        raise ClusterError(
            "The nccl backend needs a GPU on every rank; some ranks have none. Use `--backend gloo`."
        )
    plan.backend = backend

    hosts = {r["info"]["host"] for r in rows}
    rank0 = rows[0]["info"]
    master_addr = "127.0.0.1" if len(hosts) == 1 else rank0["ip"]
    master_port = plan.port or rank0["free_port"]

    setup_results = [
        client[r["engine_id"]].apply_async(
            bootstrap.setup,
            rank=r["rank"],
            world_size=len(rows),
            local_rank=r["local_rank"],
            local_world_size=r["local_world_size"],
            master_addr=master_addr,
            master_port=master_port,
            backend=backend,
            gpu=r["gpu"],
            timeout_s=plan.timeout_s,
            config=config.to_dict(),
        )
        for r in rows
    ]
    done = _wait_all(setup_results, plan.timeout_s + 60.0, "Setting up torch.distributed")
    ranks = [
        RankInfo(
            rank=r["rank"],
            engine_id=r["engine_id"],
            host=r["info"]["host"],
            pid=r["info"]["pid"],
            device=d["device"],
            local_rank=r["local_rank"],
            gpu=r["gpu"],
            nannies=tuple(r["info"].get("nannies", ())),
        )
        for r, d in zip(rows, done, strict=True)
    ]
    return ranks, backend


# ----------------------------------------------------------------------------- lifecycle


def start(
    n: int | None = None,
    *,
    devices: str | Sequence[int] | None = None,
    backend: str | None = None,
    timeout: float = DEFAULT_PG_TIMEOUT_S,
    port: int | None = None,
    config: Config | None = None,
    verbose: bool = True,
) -> Session:
    """Start a local cluster: one engine per visible GPU (or `devices`), else `n` CPU engines (default 2).

    Every engine gets rank env vars, its device and a process group with a
    `timeout`-second timeout. Prints one line (ranks, devices, backend, seconds).
    """
    global _current
    import ipyparallel as ipp

    from mpnb.planning.config import Config

    with _lock:
        _check_no_session()
        count, plan = _plan_local(n, devices, backend, timeout, port)
        cfg = config if config is not None else Config()
        t0 = time.perf_counter()
        cluster = ipp.Cluster(n=count, delay=0, log_level=logging.WARNING)
        try:
            cluster.start_cluster_sync()
            client = cluster.connect_client_sync()
            # interactive=False: no progress bar printed into the notebook while engines register
            client.wait_for_engines(count, timeout=cluster.engine_timeout, interactive=False)
            sess = Session(client, cluster, plan, cfg, source="start")
            sess.ranks, sess.backend = _form_world(client, list(client.ids), plan, cfg)
        except BaseException as exc:
            _stop_cluster_quietly(cluster)
            if isinstance(exc, KeyboardInterrupt):
                raise
            reason = str(exc) if isinstance(exc, ClusterError) else _short_error(exc)
            raise ClusterError(
                f"{reason}\nThe start was rolled back: the controller and engines it launched are stopped."
            ) from exc
        _current = sess
    return _go_live(sess, "start", t0, verbose)


def _profile_args(profile: str) -> dict[str, str]:
    expanded = os.path.expanduser(profile)
    if os.sep in profile or os.path.isdir(expanded):
        return {"profile_dir": os.path.abspath(expanded)}
    return {"profile": profile}


def _known_cluster_ids(profile_kwargs: dict[str, str]) -> list[str]:
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


def connect(
    profile: str = "default",
    cluster_id: str | None = None,
    *,
    backend: str | None = None,
    timeout: float = DEFAULT_PG_TIMEOUT_S,
    engines_timeout: float = 60.0,
    config: Config | None = None,
    verbose: bool = True,
) -> Session:
    """Attach to a cluster started outside the notebook (`ipcluster start --profile P`).

    `profile` is a profile name or a profile directory. Ranks are grouped by host
    so LOCAL_RANK is right across machines; the process group spans all engines.
    `%mpnb stop` later disconnects but leaves that cluster running.
    """
    global _current
    import ipyparallel as ipp

    from mpnb.planning.config import Config

    with _lock:
        _check_no_session()
        plan = _Plan(
            backend=_check_backend(backend), timeout_s=_check_timeout(timeout), port=None, devices=None
        )
        profile_kwargs = _profile_args(profile)
        cfg = config if config is not None else Config()
        t0 = time.perf_counter()
        try:
            client = ipp.Client(cluster_id=cluster_id or "", timeout=10, **profile_kwargs)
        except (OSError, ValueError) as exc:
            known = _known_cluster_ids(profile_kwargs)
            listing = (
                f"Clusters in that profile: {', '.join(known)}."
                if known
                else "That profile has no running cluster."
            )
            raise ClusterError(
                f"No ipyparallel cluster with id {cluster_id or repr('')} in profile {profile!r} ({exc}). "
                f"{listing} Start one with `ipcluster start -n N --profile {profile}` or fix --cluster-id."
            ) from None
        try:
            if not _wait_for_launched_engines(client, profile_kwargs, cluster_id or "", engines_timeout):
                raise ClusterError(
                    f"The cluster in profile {profile!r} has no engines after {engines_timeout:g} s. "
                    "Start engines (`ipengine --profile ...`) and retry."
                )
            sess = Session(client, None, plan, cfg, source=f"connect --profile {profile}")
            sess.ranks, sess.backend = _form_world(client, sorted(client.ids), plan, cfg)
        except BaseException:
            client.close()
            raise
        _current = sess
    return _go_live(sess, "start", t0, verbose)


# Engines started by hand (`ipengine`) are not in the cluster file; once some have registered,
# the count must hold this long before we take it as the whole cluster.
_ENGINE_COUNT_SETTLE_S = 3.0


def _wait_for_launched_engines(
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
        expected = _expected_engines(profile_kwargs, cluster_id)
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


def _expected_engines(profile_kwargs: dict[str, str], cluster_id: str) -> int:
    """Engines the cluster file says were launched (0 if unknown), so we wait for all of them."""
    import ipyparallel as ipp

    try:
        cluster = ipp.Cluster.from_file(cluster_id=cluster_id, **profile_kwargs)
    except Exception:
        return 0
    return sum(getattr(es, "n", 0) or 0 for es in cluster.engines.values())


def restart(verbose: bool = True) -> Session:
    """Fresh engines and a fresh process group, same world size, same session object."""
    sess = session()
    if sess.cluster is None:
        raise ClusterError(
            "mpnb did not start this cluster (it was connected with `%mpnb connect`), so it cannot "
            "restart its engines. Restart them with ipcluster, then `%mpnb stop` and `%mpnb connect` again."
        )
    with _lock:
        t0 = time.perf_counter()
        n = max(sess.world_size, sess.full_world_size)
        old_ids = set(sess.client.ids)
        sess.cell = None
        sess.health = None
        try:
            _prepare_engines_exit(sess)
            _reap_nannies_later(sess)
            sess.cluster.restart_engines_sync()
            _wait_new_engines(sess.client, old_ids, n, timeout=120.0)
            new_ids = sorted(set(sess.client.ids) - old_ids)
            sess.ranks, sess.backend = _form_world(sess.client, new_ids, sess._plan, sess.config)
        except BaseException as exc:
            _close(sess)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise ClusterError(
                f"Restart failed, so the cluster was stopped: {_short_error(exc)}. "
                "Run `%mpnb start` for a new one."
            ) from exc
    return _go_live(sess, "restart", t0, verbose)


def _wait_new_engines(client: ipp.Client, old_ids: set[int], n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        ids = set(client.ids)
        if len(ids - old_ids) >= n and not (ids & old_ids):
            return
        if time.monotonic() > deadline:
            raise ClusterError(
                f"Only {len(ids - old_ids)} of {n} restarted engines registered within {timeout:g} s."
            )
        time.sleep(0.05)


def stop() -> None:
    """Stop the cluster mpnb started (or disconnect from a connected one). No-op without a session."""
    sess = current()
    if sess is None:
        return
    _close(sess)


def _go_live(sess: Session, event: str, t0: float, verbose: bool) -> Session:
    """Last steps of start, connect and restart: monitor on, one summary line, listeners told."""
    _start_monitor(sess)
    if verbose:
        print(sess.summary(time.perf_counter() - t0))
    sess._notify(event)
    return sess


def _start_monitor(sess: Session) -> None:
    """Memory samples from every rank (mpnb.monitor_channel); a failure empties charts, not the cluster."""
    try:
        from mpnb.monitoring import channel as monitor_channel

        monitor_channel.attach(sess)
    except Exception:
        log.exception("mpnb: the memory monitor could not start; memory charts will stay empty")


def _stop_monitor(sess: Session) -> None:
    with contextlib.suppress(Exception):
        from mpnb.monitoring import channel as monitor_channel

        monitor_channel.detach(sess, timeout=2.0)


def _close(sess: Session) -> None:
    global _current
    with _lock:
        _stop_monitor(sess)  # samplers and the kernel end stop before the engines do
        _prepare_engines_exit(sess)
        if sess.cluster is not None:
            _reap_nannies_later(sess)
            with contextlib.suppress(Exception):
                sess.client.shutdown(hub=False, block=False)  # engines exit now; the stop below reaps them
            _stop_cluster_quietly(sess.cluster)
        with contextlib.suppress(Exception):
            sess.client.close()
        sess.closed = True
        if _current is sess:
            _current = None
    sess._notify("stop")


def _prepare_engines_exit(sess: Session) -> None:
    """Engines leave the process group and freeze their GC, so they exit at once.

    With a live gloo group they ignore SIGTERM and are killed only after ipyparallel's 5 s grace.
    """
    from mpnb.engine import bootstrap

    with contextlib.suppress(Exception):
        sess.client[list(sess.client.ids)].apply_async(bootstrap.prepare_exit).wait(3)


def _reap_nannies_later(sess: Session) -> None:
    """Start the detached nanny reaper for this session's engines (see mpnb/cluster/reaper.py)."""
    pairs = [f"{r.pid}:{nanny}" for r in sess.ranks for nanny in r.nannies]
    if sess.cluster is None or not pairs:
        return  # a connected cluster's engines, and their nannies, are not ours
    script = Path(__file__).with_name("reaper.py")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        starter = subprocess.Popen(
            [sys.executable, str(script), *pairs],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        starter.wait(10)  # it forks the watcher off and exits at once


def _reap_at_exit() -> None:
    """The kernel is exiting (ipyparallel stops the engines of a live cluster): reap their nannies."""
    if _current is not None and not _current.closed:
        _reap_nannies_later(_current)


atexit.register(_reap_at_exit)


def _stop_cluster_quietly(cluster: ipp.Cluster) -> None:
    try:
        cluster.stop_cluster_sync()
    except Exception:
        log.exception("mpnb: stopping the cluster failed")
