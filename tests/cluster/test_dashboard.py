"""The `mpnb.dashboard` comm, driven the way JupyterLab drives it: a real kernel, real comm messages.

One kernel (with one 2-engine CPU cluster started in it) for the module; a
second, cluster-less kernel checks that each kernel reports its own cluster.
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from jupyter_client.manager import start_new_kernel

TARGET = "mpnb.dashboard"


class KernelProbe:
    """A kernel client that keeps every iopub message, so several waits can look at the same stream."""

    def __init__(self) -> None:
        self.km, self.kc = start_new_kernel(kernel_name="python3", startup_timeout=60)
        self.iopub: list[dict[str, Any]] = []

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)

    def _pump(self, timeout: float) -> bool:
        try:
            msg = self.kc.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            return False
        self.iopub.append(msg)
        return True

    def wait_for(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float, start: int = 0
    ) -> dict[str, Any]:
        """The first iopub message (from index `start`) that satisfies `pred`, reading more as needed."""
        deadline = time.monotonic() + timeout
        i = start
        while True:
            while i < len(self.iopub):
                if pred(self.iopub[i]):
                    return self.iopub[i]
                i += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching iopub message within {timeout} s")
            self._pump(min(left, 0.5))

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._pump(max(0.01, deadline - time.monotonic()))

    def send_execute(self, code: str, cell_id: str | None = None) -> str:
        content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": False, "stop_on_error": True}
        msg = self.kc.session.msg("execute_request", content)
        if cell_id is not None:
            msg["metadata"]["cellId"] = cell_id  # what JupyterLab sends
        self.kc.shell_channel.send(msg)
        return msg["header"]["msg_id"]

    def execute(self, code: str, timeout: float = 120) -> list[dict[str, Any]]:
        """Run `code`, wait for idle, fail on an error; returns the messages it produced."""
        start = len(self.iopub)
        msg_id = self.send_execute(code)
        self.wait_for(
            lambda m: m["parent_header"].get("msg_id") == msg_id
            and m["msg_type"] == "status" and m["content"]["execution_state"] == "idle",
            timeout, start,
        )
        produced = [m for m in self.iopub[start:] if m["parent_header"].get("msg_id") == msg_id]
        errors = [m["content"] for m in produced if m["msg_type"] == "error"]
        assert not errors, f"{code!r} raised {errors[0]['ename']}: {errors[0]['evalue']}"
        return produced

    def open_comm(self, subshell_id: str | None = None) -> str:
        comm_id = uuid.uuid4().hex
        msg = self.kc.session.msg("comm_open", {"comm_id": comm_id, "target_name": TARGET, "data": {}})
        if subshell_id is not None:
            msg["header"]["subshell_id"] = subshell_id
        self.kc.shell_channel.send(msg)
        return comm_id

    def send_comm(self, comm_id: str, data: dict[str, Any]) -> None:
        self.kc.shell_channel.send(self.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data}))

    def comm_data(self, comm_id: str, start: int = 0) -> list[dict[str, Any]]:
        return [m["content"]["data"] for m in self.iopub[start:]
                if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == comm_id]

    def wait_comm(self, comm_id: str, pred: Callable[[dict[str, Any]], bool], timeout: float,
                  start: int = 0) -> dict[str, Any]:
        msg = self.wait_for(
            lambda m: m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == comm_id
            and pred(m["content"]["data"]),
            timeout, start,
        )
        return msg["content"]["data"]

    def create_subshell(self) -> str:
        msg = self.kc.session.msg("create_subshell_request", {})
        self.kc.control_channel.send(msg)
        reply = self.kc.get_control_msg(timeout=10)
        assert reply["content"]["status"] == "ok", reply["content"]
        return reply["content"]["subshell_id"]


def is_state(data: dict[str, Any]) -> bool:
    return data.get("type") == "state"


@pytest.fixture(scope="module")
def probe() -> Iterator[KernelProbe]:
    p = KernelProbe()
    try:
        yield p
    finally:
        try:  # the kernel started the cluster: stop it before the kernel goes
            p.execute("import mpnb\nmpnb.stop()", timeout=60)
        finally:
            p.shutdown()


def test_comm_is_closed_until_mpnb_is_loaded(probe: KernelProbe) -> None:
    start = len(probe.iopub)
    comm_id = probe.open_comm()
    closed = probe.wait_for(
        lambda m: m["msg_type"] == "comm_close" and m["content"]["comm_id"] == comm_id, 20, start
    )
    assert closed["content"]["comm_id"] == comm_id
    assert probe.comm_data(comm_id) == []


def test_load_ext_announces_itself_and_answers_opens_and_refresh(probe: KernelProbe) -> None:
    start = len(probe.iopub)
    produced = probe.execute("%load_ext mpnb")
    opened = [m for m in produced if m["msg_type"] == "comm_open"]
    assert len(opened) == 1, "the kernel opens one comm toward frontends already connected"
    assert opened[0]["content"]["target_name"] == TARGET
    announced = opened[0]["content"]["data"]
    assert announced == {"type": "state", "cluster": None, "strategy": "", "cell": None, "estimate": {},
                         "checkpoints": []}

    comm_id = probe.open_comm()
    state = probe.wait_comm(comm_id, is_state, 20, start)
    assert state["cluster"] is None
    mark = len(probe.iopub)
    probe.send_comm(comm_id, {"type": "refresh"})
    assert probe.wait_comm(comm_id, is_state, 20, mark)["cluster"] is None


def test_cluster_start_cell_state_samples_and_stop(probe: KernelProbe) -> None:
    probe.execute("%load_ext mpnb")
    comm_id = probe.open_comm()
    probe.wait_comm(comm_id, is_state, 20)

    mark = len(probe.iopub)
    probe.execute("%mpnb start -n 2", timeout=180)
    state = probe.wait_comm(comm_id, lambda d: is_state(d) and d["cluster"] is not None, 20, mark)
    cluster = state["cluster"]
    assert cluster["world_size"] == 2
    assert cluster["backend"] == "gloo"
    assert [r["rank"] for r in cluster["ranks"]] == [0, 1]
    assert all(r["alive"] for r in cluster["ranks"])
    assert all(r["device"] == "cpu" and r["host"] and r["pid"] for r in cluster["ranks"])
    assert state["strategy"].startswith("DDP · fp32")

    # A distributed cell: its state goes running -> done, per rank, tagged with the Jupyter cell id.
    mark = len(probe.iopub)
    cell = "%%distributed --no-monitor\nimport time\ntime.sleep(1.5)\nrank"
    msg_id = probe.send_execute(cell, cell_id="cell-abc")
    running = probe.wait_comm(
        comm_id, lambda d: is_state(d) and (d["cell"] or {}).get("status") == "running", 60, mark
    )
    assert running["cell"]["notebook_cell_id"] == "cell-abc"
    assert set(running["cell"]["ranks"]) == {"0", "1"}
    assert any(r["busy"] for r in running["cluster"]["ranks"])
    done = probe.wait_comm(
        comm_id, lambda d: is_state(d) and (d["cell"] or {}).get("status") == "done", 60, mark
    )
    assert done["cell"]["ranks"] == {"0": "done", "1": "done"}
    assert done["cell"]["id"] == running["cell"]["id"]
    probe.wait_for(
        lambda m: m["parent_header"].get("msg_id") == msg_id and m["msg_type"] == "status"
        and m["content"]["execution_state"] == "idle", 60, mark,
    )

    # The sidebar's "log" link: the end of a rank's own engine log, only from paths the session knows.
    probe.execute("%%distributed --no-monitor\nfrom mpnb.cluster import logs\n"
                  "logs.write(f'log-probe rank {rank}')")
    mark = len(probe.iopub)
    probe.send_comm(comm_id, {"type": "log", "id": "q1", "rank": 1, "path": "/etc/passwd"})
    reply = probe.wait_comm(comm_id, lambda d: d.get("type") == "log" and d.get("id") == "q1", 20, mark)
    assert reply["path"] == cluster["ranks"][1]["log"] and reply["path"].endswith(".log"), reply
    assert reply["text"].splitlines()[-1] == "log-probe rank 1" and "root:" not in reply["text"], reply
    assert "log-probe rank 0" not in reply["text"] and reply["error"] == ""
    probe.send_comm(comm_id, {"type": "log", "id": "q2", "rank": 7})
    missing = probe.wait_comm(comm_id, lambda d: d.get("type") == "log" and d.get("id") == "q2", 20, mark)
    assert missing["text"] == "" and "Rank 7" in missing["error"]

    # Samples added to the session's store reach the comm, batched to at most ~4 messages a second.
    mark = len(probe.iopub)
    t0 = time.monotonic()
    probe.execute(
        "import time, mpnb\n"
        "store = mpnb.session().memory\n"
        "for i in range(100):\n"
        "    store.add([{'rank': r, 't': time.time(), 'busy': False, 'device_kind': 'cpu', 'used': 1000 + i,"
        " 'reserved': 1000, 'peak': 2000, 'capacity': 10**9, 'device_used': None, 'oom_count': 0,"
        " 'parameters': 7, 'gradients': 0, 'optimizer': 0, 'other': 993 + i, 'probe': i} for r in (0, 1)])\n"
        "    time.sleep(0.02)\n"
    )
    probe.drain(1.0)
    elapsed = time.monotonic() - t0
    batches = [d for d in probe.comm_data(comm_id, mark) if d.get("type") == "samples"]
    probed = [s for d in batches for s in d["samples"] if "probe" in s]
    assert sorted((s["rank"], s["probe"]) for s in probed) == [(r, i) for r in (0, 1) for i in range(100)]
    assert 1 < len(batches) <= SENDS_LIMIT * elapsed + 1, f"{len(batches)} messages in {elapsed:.1f} s"

    # Each kernel shows its own cluster: a second kernel with mpnb loaded has none.
    other = KernelProbe()
    try:
        other.execute("%load_ext mpnb")
        other_comm = other.open_comm()
        assert other.wait_comm(other_comm, is_state, 20)["cluster"] is None
    finally:
        other.shutdown()

    mark = len(probe.iopub)
    probe.execute("%mpnb stop", timeout=60)
    assert probe.wait_comm(comm_id, is_state, 20, mark)["cluster"] is None


SENDS_LIMIT = 4.5  # messages a second (the dashboard sends at most 4, plus timing slack)


def test_state_arrives_while_a_long_cell_holds_the_main_shell(probe: KernelProbe) -> None:
    """A reloaded page opens its comm on a subshell (JupyterLab 4.6 does) and is answered at once."""
    probe.execute("%load_ext mpnb")
    subshell = probe.create_subshell()
    mark = len(probe.iopub)
    busy = probe.send_execute("import time\ntime.sleep(6)")
    probe.wait_for(lambda m: m["parent_header"].get("msg_id") == busy and m["msg_type"] == "execute_input",
                   20, mark)
    t0 = time.monotonic()
    comm_id = probe.open_comm(subshell_id=subshell)
    state = probe.wait_comm(comm_id, is_state, 20, mark)
    answered = time.monotonic() - t0
    assert state["cluster"] is None
    assert answered < 3.0, f"state took {answered:.1f} s: the open waited for the busy main shell"
    probe.wait_for(lambda m: m["parent_header"].get("msg_id") == busy and m["msg_type"] == "status"
                   and m["content"]["execution_state"] == "idle", 30, mark)


def test_unload_ext_closes_the_comms(probe: KernelProbe) -> None:
    probe.execute("%load_ext mpnb")
    comm_id = probe.open_comm()
    probe.wait_comm(comm_id, is_state, 20)
    mark = len(probe.iopub)
    probe.execute("%unload_ext mpnb")
    probe.wait_for(lambda m: m["msg_type"] == "comm_close" and m["content"]["comm_id"] == comm_id, 20, mark)
    try:  # and the target is gone: a new open is refused
        mark = len(probe.iopub)
        other = probe.open_comm()
        probe.wait_for(lambda m: m["msg_type"] == "comm_close" and m["content"]["comm_id"] == other, 20, mark)
        assert probe.comm_data(other, mark) == []
    finally:
        probe.execute("%load_ext mpnb")  # leave the kernel as the other tests expect
