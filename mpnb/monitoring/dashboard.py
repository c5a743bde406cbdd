"""Kernel end of the `mpnb.dashboard` comm: what the JupyterLab sidebar and status bar show.

The extension opens the comm when it connects to a kernel (and after a page
reload); we answer at once with a `state` message and then push updates:
`state` on every session change (start, stop, restart, config, cell state, a
checkpoint saved: its `checkpoints` list, newest last; a host that dropped off the
network or came back: its ranks' `alive`) and `samples` with the
session's memory samples, batched to at most `SENDS_PER_SECOND` messages. A
`log` request gets the end of one rank's engine log (`log_reply`). When
`%load_ext mpnb` runs after the page connected, we open a comm toward the
frontend ourselves, so the sidebar wakes up without a reload. Protocol: docs/internals.md ("Dashboard comm").

Threads: `on_change` listeners run on the kernel thread; memory batches arrive
on the monitor's receiver thread; comm opens may arrive on a kernel subshell
thread while a long cell runs. The ipyparallel client is not thread-safe, so
the rank table is only read from the controller on the kernel thread and
cached for the others. Kernel side: no torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from mpnb.cluster.host_reach import DropWatch
from mpnb.monitoring.protocol import Sample, estimate_json

log = logging.getLogger("mpnb")

TARGET = "mpnb.dashboard"
SENDS_PER_SECOND = 4.0
# On (re)connect the frontend gets this many past samples in all, thinned evenly over the history.
BACKLOG_SAMPLES = 2000
# Comms of reloaded pages are never closed by their frontend; keep only the newest ones.
MAX_COMMS = 16
# Lines of an engine log the sidebar's "log" link shows (a request may ask for more, up to the max).
LOG_LINES = 200
MAX_LOG_LINES = 5000


class Dashboard:
    """The comms of one kernel and the session they describe."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._comms: list[Any] = []
        self._ranks_cache: list[dict[str, Any]] = []
        self._followed: Any = None  # the session whose memory we forward
        self._unfollow: Callable[[], None] | None = None
        self._notebook_cell_ids: dict[str, str] = {}  # execution's cell id -> Jupyter cell id
        self._last_notebook_cell: str | None = None
        self._pending: list[Sample] = []
        self._estimate_sent: dict[str, int] = {}  # the estimate line the last state message carried
        self._checkpoints_sent = -1  # the store's checkpoints_version the last state message carried
        self._dropped = DropWatch()  # ranks on a host gone from the network: shown as down
        self._cond = threading.Condition()
        self._closed = False
        self._flusher = threading.Thread(target=self._flush_loop, name="mpnb-dashboard", daemon=True)
        self._flusher.start()
        from mpnb.cluster import session as cluster

        self._unlisten = cluster.on_change(self._on_session_change)
        sess = cluster.current()
        if sess is not None:
            self._on_session_change(sess)

    # ------------------------------------------------------------------ comms

    def open_from_frontend(self, comm: Any, _open_msg: Any = None) -> None:
        """The comm target: a frontend connected (or reloaded)."""
        self._add_comm(comm)
        self._send_to(comm, self.state())
        self._send_backlog(comm)

    def announce(self) -> None:
        """Open a comm toward frontends that connected before mpnb was loaded."""
        import comm as comm_module

        try:
            comm = comm_module.create_comm(target_name=TARGET, data=self.state())
        except Exception:
            log.debug("mpnb dashboard: no frontend to announce to", exc_info=True)
            return
        self._add_comm(comm)

    def _add_comm(self, comm: Any) -> None:
        comm.on_msg(self._on_frontend_msg)
        comm.on_close(lambda _msg, c=comm: self._drop_comm(c))
        with self._lock:
            self._comms.append(comm)
            stale = self._comms[:-MAX_COMMS]
            del self._comms[:-MAX_COMMS]
        for old in stale:
            with contextlib.suppress(Exception):
                old.close()

    def _drop_comm(self, comm: Any) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._comms.remove(comm)

    def _on_frontend_msg(self, msg: dict[str, Any]) -> None:
        data = msg.get("content", {}).get("data", {}) if isinstance(msg, dict) else {}
        if not isinstance(data, dict) or data.get("type") not in ("refresh", "log"):
            return
        comm_id = msg.get("content", {}).get("comm_id")
        with self._lock:
            targets = [c for c in self._comms if getattr(c, "comm_id", None) == comm_id] or self._comms
        reply = self.state() if data["type"] == "refresh" else log_reply(data)
        for comm in targets:
            self._send_to(comm, reply)

    def comms(self) -> list[Any]:
        with self._lock:
            return list(self._comms)

    def _broadcast(self, message: dict[str, Any]) -> None:
        for comm in self.comms():
            self._send_to(comm, message)

    def _send_to(self, comm: Any, message: dict[str, Any]) -> None:
        try:
            comm.send(message)
        except Exception:  # a closed or broken comm must not break the session
            log.debug("mpnb dashboard: dropping a comm that failed to send", exc_info=True)
            self._drop_comm(comm)

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        """The `state` message for the current session (cached rank table off the kernel thread)."""
        from mpnb.cluster import session as cluster

        sess = cluster.current()
        if sess is None:
            return {"type": "state", "cluster": None, "strategy": "", "cell": None, "estimate": {},
                    "checkpoints": []}
        ranks = self._rank_rows(sess)
        cell = self._cell(sess)
        running = {int(r) for r, s in (cell or {}).get("ranks", {}).items() if s == "running"}
        latest = _latest_busy(sess)
        for row in ranks:
            row["busy"] = bool(row.get("busy")) or row["rank"] in running or latest.get(row["rank"], False)
        self._estimate_sent = estimate_json(getattr(sess.memory, "estimate", None))
        self._checkpoints_sent = sess.memory.checkpoints_version
        return {
            "type": "state",
            "cluster": {"ranks": ranks, "backend": sess.backend, "world_size": sess.world_size},
            "strategy": _strategy_line(sess),
            "cell": cell,
            "estimate": self._estimate_sent,
            "checkpoints": sess.memory.checkpoints(),
        }

    def _rank_rows(self, sess: Any) -> list[dict[str, Any]]:
        if threading.current_thread() is threading.main_thread():
            try:
                rows = sess.rank_status()
            except Exception:
                log.debug("mpnb dashboard: rank status failed", exc_info=True)
                rows = None
            if rows is not None:
                with self._lock:
                    self._ranks_cache = [dict(r) for r in rows]
        with self._lock:
            cached = [dict(r) for r in self._ranks_cache]
        if len(cached) != len(sess.ranks):  # never read from the controller yet: describe without it
            cached = [
                {"rank": r.rank, "host": r.host, "pid": r.pid, "device": r.device_label, "alive": True,
                 "log": r.log}
                for r in sess.ranks
            ]
        for row in cached:  # the controller still lists them for its heartbeat tolerance (30 s)
            row["alive"] = row["alive"] and row["rank"] not in self._dropped.ranks
        return cached

    def _cell(self, sess: Any) -> dict[str, Any] | None:
        """The session's cell state as published (id, status, ranks, and `label` for a `%mpnb run`
        script: its file name), plus the Jupyter id of the notebook cell that ran it when known."""
        cell = getattr(sess, "cell", None)
        if not cell:
            return None
        out = dict(cell)
        out["ranks"] = dict(cell.get("ranks", {}))
        if not isinstance(out.get("label"), str) or not out["label"]:
            out.pop("label", None)
        with self._lock:
            notebook_cell = self._notebook_cell_ids.get(str(cell.get("id")))
        if notebook_cell:
            out["notebook_cell_id"] = notebook_cell
        return out

    def _tag_cell(self, sess: Any) -> None:
        """On a cell state change: tie a new execution to the notebook cell running now.

        Only here, on the kernel thread while that cell runs, is the running cell the one that
        published it; a state first read later (a frontend connecting) stays untagged.
        """
        cell = getattr(sess, "cell", None)
        if not cell:
            return
        exec_id = str(cell.get("id"))
        with self._lock:
            if exec_id not in self._notebook_cell_ids and self._last_notebook_cell:
                self._notebook_cell_ids[exec_id] = self._last_notebook_cell

    def pre_run_cell(self, info: Any) -> None:
        """Remember the Jupyter id of the cell the kernel runs now, so the frontend can mark that cell.

        Any cell, not only `%%distributed` ones: `%mpnb run script.py` and `mpnb.run(...)` run a
        script from a plain cell. A cell without an id forgets the previous one (whose badge it
        would take). Cells of a subshell (another thread) run beside the kernel's cell: ignored.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        cell_id = getattr(info, "cell_id", None)
        with self._lock:
            self._last_notebook_cell = str(cell_id) if cell_id else None

    # ------------------------------------------------------------------ session and samples

    def _on_session_change(self, sess: Any) -> None:
        event = getattr(sess, "last_event", "")
        if sess.closed or event == "stop":
            self._follow(None)
        elif self._followed is not sess:
            self._follow(sess)
        if event in ("start", "restart"):
            self._dropped = DropWatch()
            with self._lock:
                self._notebook_cell_ids.clear()
        elif event == "cell":
            self._tag_cell(sess)
        self._broadcast(self.state())

    def _follow(self, sess: Any) -> None:
        with self._lock:
            if self._unfollow is not None:
                self._unfollow()
                self._unfollow = None
            self._followed = sess
            if sess is not None:
                self._unfollow = sess.memory.subscribe(self._on_samples)

    def _on_samples(self, batch: list[Sample]) -> None:
        with self._cond:
            self._pending.extend(batch)
            self._cond.notify()

    def _flush_loop(self) -> None:
        interval = 1.0 / SENDS_PER_SECOND
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch, self._pending = self._pending, []
            self._broadcast({"type": "samples", "samples": batch})
            sess = self._followed
            if sess is not None and (estimate_json(sess.memory.estimate) != self._estimate_sent
                                     or sess.memory.checkpoints_version != self._checkpoints_sent
                                     or self._dropped.changed(sess)):
                # a new estimate line (mpnb.prepare), a save finished, a host dropped off or came back
                self._broadcast(self.state())
            time.sleep(interval)

    def _send_backlog(self, comm: Any) -> None:
        sess = self._followed
        if sess is None:
            return
        samples = sess.memory.samples()
        if len(samples) > BACKLOG_SAMPLES:
            step = len(samples) / BACKLOG_SAMPLES
            samples = [samples[int(i * step)] for i in range(BACKLOG_SAMPLES)] + [samples[-1]]
        if samples:
            self._send_to(comm, {"type": "samples", "samples": samples})

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self._unlisten()
        self._follow(None)
        with self._cond:
            self._closed = True
            self._cond.notify()
        for comm in self.comms():
            with contextlib.suppress(Exception):
                comm.close()
        with self._lock:
            self._comms.clear()


def log_reply(request: dict[str, Any]) -> dict[str, Any]:
    """The answer to `{"type": "log", "rank": N}`: the end of that rank's engine log.

    Only the path the session recorded for the rank is read (never one the frontend names), and
    `logs.tail` reads only our own private files.
    """
    from mpnb.cluster import logs
    from mpnb.cluster import session as cluster

    rank = request.get("rank")
    lines = request.get("lines")
    lines = min(int(lines), MAX_LOG_LINES) if isinstance(lines, int) and lines > 0 else LOG_LINES
    reply: dict[str, Any] = {"type": "log", "id": request.get("id"), "rank": rank, "path": "", "text": "",
                             "error": ""}
    sess = cluster.current()
    info = None if sess is None else next((r for r in sess.ranks if r.rank == rank), None)
    if sess is None:
        reply["error"] = "No cluster is running in this kernel."
    elif info is None or not info.log:
        reply["error"] = f"Rank {rank} has no engine log in this session."
    else:
        reply["path"] = info.log
        reply["text"] = logs.tail(info.log, lines)
    return reply


def _strategy_line(sess: Any) -> str:
    return sess.config.summary(sess.world_size)


def _latest_busy(sess: Any) -> dict[int, bool]:
    try:
        latest = sess.memory.latest()
    except Exception:
        return {}
    recent = time.time() - 5.0  # a stale sample says nothing about now
    return {int(r): bool(s.get("busy")) for r, s in latest.items() if float(s.get("t", 0)) >= recent}


# ---------------------------------------------------------------------- registration

_dashboard: Dashboard | None = None
_registered_shell: Any = None


def register(ipython: Any) -> Dashboard:
    """`%load_ext mpnb`: serve the comm target, follow the session, and wake up connected frontends."""
    global _dashboard, _registered_shell
    import comm as comm_module

    if _dashboard is None:
        _dashboard = Dashboard()
    dashboard = _dashboard
    manager = comm_module.get_comm_manager()
    if manager is not None:
        manager.register_target(TARGET, dashboard.open_from_frontend)
    if ipython is not None and _registered_shell is not ipython:
        ipython.events.register("pre_run_cell", dashboard.pre_run_cell)
        _registered_shell = ipython
    dashboard.announce()
    return dashboard


def unregister(ipython: Any) -> None:
    """`%unload_ext mpnb`: close every comm (frontends show "not loaded") and stop listening."""
    global _dashboard, _registered_shell
    import comm as comm_module

    dashboard, _dashboard = _dashboard, None
    if dashboard is None:
        return
    with contextlib.suppress(Exception):
        comm_module.get_comm_manager().unregister_target(TARGET, dashboard.open_from_frontend)
    if ipython is not None and _registered_shell is ipython:
        with contextlib.suppress(ValueError):
            ipython.events.unregister("pre_run_cell", dashboard.pre_run_cell)
        _registered_shell = None
    dashboard.close()


def current() -> Dashboard | None:
    """The kernel's dashboard, if `%load_ext mpnb` ran."""
    return _dashboard
