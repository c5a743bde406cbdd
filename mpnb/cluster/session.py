"""The one live cluster as the notebook sees it: `Session`, its `RankInfo` rows, and module-level access.

A `Session` owns an ipyparallel `Client` (and the `Cluster` when mpnb started
it), the rank table and the active `Config`. `mpnb.cluster.lifecycle` creates,
restarts and closes sessions; this module only holds them, so anything that
reads the live session (magics, dashboard, panel) need not import the lifecycle.

Kernel side: never imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from mpnb.errors import ClusterError, NoClusterError

if TYPE_CHECKING:
    import ipyparallel as ipp

    from mpnb.cluster.launch import WorldPlan
    from mpnb.monitoring.channel import MonitorChannel
    from mpnb.planning.config import Config

log = logging.getLogger("mpnb")

QUEUE_TTL_S = 1.0  # how long rank_status() reuses the controller's queue counts
WARM_UP_TIMEOUT_S = 60.0  # DeepSpeed's import and op load take ~4 s; the warm-up never builds an op

Listener = Callable[["Session"], Any]
Need = Literal["wait", "heal", "restart"]


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
    nanny_started: tuple[float, ...] = ()  # reaper.start_time of each of `nannies`, same order
    started: int | None = None  # the engine's start time (reaper.start_ticks): names it with `pid`
    stacks: str = ""  # the engine's stack-dump file (its user's private directory on `host`)
    log: str = ""  # the engine's log of library output (mpnb.cluster.logs), in the same directory
    address: str = ""  # the engine's address towards the controller (`mpnb.cluster.host_reach` probes it)
    formed_at: float = field(default_factory=time.monotonic)  # when it became this rank (kernel clock)

    @property
    def device_label(self) -> str:
        return "cpu" if self.gpu is None else f"GPU {self.gpu}"


@dataclass(frozen=True)
class Health:
    """What the session needs next, and why.

    need: "wait" (ranks still busy in the last cell), "heal" (the group was torn
    down, every engine alive) or "restart" (an engine died). busy: ranks that may
    still be blocked in the last cell until the process-group timeout.
    """

    need: Need
    reason: str
    busy: list[int] = field(default_factory=list)
    at: float = field(default_factory=time.time)


@dataclass
class SpareSet:
    """Engines kept warm beside the ranks for the next restart (`mpnb.cluster.spares`)."""

    set_id: str  # the ipyparallel engine set
    count: int
    before: frozenset[int]  # engine ids registered before it was launched: not spares


# ----------------------------------------------------------------------------- session


class Session:
    """The live cluster as the notebook sees it. Get it with `mpnb.session()`."""

    def __init__(
        self,
        client: ipp.Client,
        cluster: ipp.Cluster | None,
        plan: WorldPlan,
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
        # What changed last: start|stop|restart|config|cell|comparison (listeners read it; they get
        # only the session).
        self.last_event = "start"
        # What a crash or a release left to do (`mpnb.cluster.recovery` keeps it), else None.
        self.health: Health | None = None
        self.full_world_size = 0  # the size before `%mpnb heal` shrank the world; restart brings it back
        self.plan = plan  # the validated start arguments; heal and restart form worlds from it
        self.monitor_channel: MonitorChannel | None = None  # the memory side channel's kernel end
        self.warm = False  # every rank's background DeepSpeed warm-up is known to be done
        self.engine_set: str | None = None  # the ipyparallel engine set of the ranks (clusters mpnb started)
        self.spares: SpareSet | None = None  # engines kept warm for the next restart
        self.spare_watch: object | None = None  # the token of the thread that may launch them
        self.active_at = time.monotonic()  # when a cell last started or ended (spares start when idle)
        self.comparison: Any = None  # the last `mpnb.compare` result (the config panel shows it)
        self.comparing = False  # True while `mpnb.compare` switches configs: not the user's changes
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
        return self.plan.timeout_s

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

    def rank_status(self, fresh: bool = False, cut_off: Iterable[int] = ()) -> list[dict[str, Any]]:
        """One row per rank: rank, host, pid, device, alive, busy, log. Never asks a (possibly busy) engine.

        busy: running the current `%%distributed` cell, or with work queued at the controller. The
        controller's queue counts are a round trip, so they are cached for QUEUE_TTL_S unless `fresh`:
        listeners call this on every cell state change and must not slow a cell down.
        `cut_off`: ranks on a host gone from the network, still registered with the controller for
        its heartbeat tolerance (`mpnb.cluster.host_reach`): shown as not alive.
        """
        alive_ids = set(self.client.ids) - {self.ranks[r].engine_id for r in cut_off}
        queues = self._queue_status(fresh)
        running = {int(r) for r, s in (self.cell or {}).get("ranks", {}).items() if s == "running"}
        counted = [i.engine_id for i in self.ranks
                   if i.rank not in running and _counts_work(queues, i.engine_id)]
        still_queued = set(self._unanswered(counted))
        rows = []
        for info in self.ranks:
            queued = info.engine_id in still_queued
            rows.append(
                {
                    "rank": info.rank,
                    "host": info.host,
                    "pid": info.pid,
                    "device": info.device_label,
                    "alive": info.engine_id in alive_ids,
                    "busy": info.rank in running or queued,
                    "log": info.log,  # the sidebar links it
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

    def with_queued_work(self, engine_ids: list[int]) -> list[int]:
        """Those of `engine_ids` with a request queued at the controller that this client has no reply to.

        The controller learns that a request ended a moment after this client has the reply,
        so right after a blocking call its counts still show the finished request.
        """
        if not engine_ids:
            return []
        try:  # counts first: the msg_id lists come with every request the engine ever completed
            counts = self.client.queue_status(targets=engine_ids)
        except Exception:  # controller gone: no queue information
            return []
        return self._unanswered([e for e in engine_ids if _counts_work(counts, e)])

    def _unanswered(self, counted: list[int]) -> list[int]:
        """Those of `counted` (engines whose queue counts show work) with a msg_id this client has no
        reply to."""
        if not counted:
            return []
        try:
            detail: Any = self.client.queue_status(targets=counted, verbose=True)
        except Exception:  # controller gone: no queue information
            return []
        results = self.client.results
        return [e for e in counted if isinstance(detail.get(e), dict)
                and any(m not in results for m in [*detail[e].get("queue", []), *detail[e].get("tasks", [])])]

    def wait_until_warm(self) -> None:
        """Until every rank's background warm-up (`mpnb.engine.ds_ops`, begun by setup) has ended.

        A cell waits for it on its own, but it ends at a different moment on each rank: the first
        cell's ranks would start apart, and their identical lines would not meet in grouped output.
        The start does not wait for it, so a person typing the first cell overlaps it."""
        if self.warm:
            return
        from mpnb.engine import ds_ops

        with contextlib.suppress(Exception):  # a warm-up that fails or hangs is the ZeRO prepare's to report
            self.view().apply_async(ds_ops.wait).get(timeout=WARM_UP_TIMEOUT_S)
        self.warm = True

    # -- config
    def set_config(self, cfg: Config) -> None:
        """Validate `cfg` for this world, keep it, and push it to `mpnb.engine.state` on every rank."""
        self._check_open()
        cfg.validate(self.world_size, self.device_kind)
        self.view().apply_sync(_set_engine_config, cfg.to_dict())
        self.config = cfg
        self.notify("config")

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
        self.active_at = time.monotonic()
        self.notify("cell")

    def notify(self, event: str) -> None:
        """Set `last_event` and call this session's listeners, then those of `on_change` (module level)."""
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
            from mpnb.monitoring.store import MemoryStore

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


def set_current(sess: Session) -> None:
    """Make `sess` the live session (the lifecycle calls this once a world is formed)."""
    global _current
    _current = sess


def release_current(sess: Session) -> None:
    """Forget `sess` as the live session, if it still is one (the lifecycle calls this on close)."""
    global _current
    if _current is sess:
        _current = None


def _counts_work(queues: dict[int, Any], engine_id: int) -> bool:
    q = queues.get(engine_id, {})
    return isinstance(q, dict) and bool(q.get("queue", 0) or q.get("tasks", 0))
