"""Memory chart, per-cell static image and report, driven through a real Jupyter kernel.

The kernel starts its own 2-engine CPU cluster (the one cluster of this module), so the
widget's comm messages and the cell's display updates are the ones a browser would get.
"""

from __future__ import annotations

import base64
import io
import itertools
import json
import textwrap
from datetime import datetime
from typing import Any

import pytest
from jupyter_client.manager import start_new_kernel

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


class Kernel:
    def __init__(self) -> None:
        self.manager, self.client = start_new_kernel(kernel_name="python3")

    def run(self, code: str, timeout: float = 120.0) -> list[dict[str, Any]]:
        """Execute `code`; return its iopub messages; raise with the traceback if it failed."""
        msg_id = self.client.execute(textwrap.dedent(code))
        messages = []
        while True:
            msg = self.client.get_iopub_msg(timeout=timeout)
            # comm messages sent from background threads may carry another (or no) parent
            if msg["parent_header"].get("msg_id") != msg_id and not msg["msg_type"].startswith("comm_"):
                continue
            messages.append(msg)
            if msg["msg_type"] == "error":
                raise AssertionError("\n".join(msg["content"]["traceback"]))
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return messages

    def value(self, expression: str) -> Any:
        """The JSON value of `expression`, evaluated in the kernel."""
        out = self.run(f"print(json.dumps({expression}))")
        text = "".join(m["content"]["text"] for m in out if m["msg_type"] == "stream")
        return json.loads(text)

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    try:
        k.run(
            """
            import json, time
            import mpnb
            from mpnb.monitoring.chart import cell_chart
            s = mpnb.start(n=2, timeout=30, verbose=False)
            assert s.monitor_channel.running
            get_ipython().run_line_magic("load_ext", "mpnb")
            """
        )
        yield k
    finally:
        try:
            k.run("mpnb.stop()", timeout=60)
        finally:
            k.shutdown()


def _custom_msgs(messages: list[dict], comm_id: str) -> list[dict]:
    return [
        m["content"]["data"]["content"]
        for m in messages
        if m["msg_type"] == "comm_msg"
        and m["content"]["comm_id"] == comm_id
        and m["content"]["data"].get("method") == "custom"
    ]


def _sent_at(messages: list[dict], comm_id: str) -> list[float]:
    return [
        datetime.fromisoformat(str(m["header"]["date"])).timestamp()
        for m in messages
        if m["msg_type"] == "comm_msg"
        and m["content"]["comm_id"] == comm_id
        and m["content"]["data"].get("method") == "custom"
    ]


def test_cell_chart_streams_live_then_leaves_a_png(kernel):
    from PIL import Image

    out = kernel.run(
        """
        chart = cell_chart(s)
        code = "import time\\nif rank == 1:\\n    x = bytearray(300 * 2**20)\\ntime.sleep(2)"
        running = s.view().execute(code)
        while not running.ready():  # as a cell's event loop does
            chart.tick()
            time.sleep(0.05)
        chart.close()
        """
    )
    # its place is taken at once, the live widget shows there from LIVE_AFTER_S on, the PNG at the end
    placeholder = [m for m in out if m["msg_type"] == "display_data"]
    assert len(placeholder) == 1 and placeholder[0]["content"]["data"] == {"text/plain": ""}
    display_id = placeholder[0]["content"]["transient"]["display_id"]
    updates = [m for m in out if m["msg_type"] == "update_display_data"]
    assert [u["content"]["transient"]["display_id"] for u in updates] == [display_id, display_id]
    model_id = updates[0]["content"]["data"][WIDGET_MIME]["model_id"]

    opens = [m for m in out if m["msg_type"] == "comm_open" and m["content"]["comm_id"] == model_id]
    state = opens[0]["content"]["data"]["state"]
    assert state["_view_name"] == "MemoryChartView" and state["_model_module"] == "mpnb"
    assert state["ranks"] == [0, 1]

    batches = [c for c in _custom_msgs(out, model_id) if c["type"] == "samples"]
    samples = [s for b in batches for s in b["samples"]]
    for rank in (0, 1):
        assert sum(1 for s in samples if s["rank"] == rank and s["busy"]) >= 12
    assert all(isinstance(s["comm_sent"], int) for s in samples)  # CPU ranks count their bytes sent
    # batched: at most ~10 messages a second to the browser, however many ranks send
    sent = sorted(_sent_at(out, model_id))
    assert len(sent) == len(batches) and min(b - a for a, b in itertools.pairwise(sent)) >= 0.08

    data = updates[1]["content"]["data"]
    assert WIDGET_MIME not in data and "rank 0: peak" in data["text/plain"]
    image = Image.open(io.BytesIO(base64.b64decode(data["image/png"])))
    assert image.format == "PNG" and image.width >= 300 and image.height >= 150
    assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 10  # not blank
    assert any(m["msg_type"] == "comm_close" and m["content"]["comm_id"] == model_id for m in out)
    assert kernel.value("'torch' in __import__('sys').modules") is False  # kernel side stays torch-free


def test_memory_report_has_peaks_by_category(kernel):
    report = {
        int(k): v
        for k, v in kernel.value("{r: row for r, row in mpnb.memory_report().to_dict().items()}").items()
    }
    assert sorted(report) == [0, 1]
    for row in report.values():
        assert set(row) >= {"parameters", "gradients", "optimizer", "activations", "other", "used", "peak"}
        assert row["peak"] >= row["used"] > 0 and row["other"] == 0  # CPU: RSS is a line, not "other"
    # rank 1 held 300 MiB more during the last cell; the ranks' own RSS differs by tens of MiB
    # (rank 0 above rank 1 by 17 MiB here, by 54 MiB on a CI machine), so the margin leaves 100 MiB for it
    assert report[1]["used"] >= report[0]["used"] + 200 * 2**20
    # the report's "used" is the peak of the samples; idle samples keep arriving, so read the samples
    # before and after the report and compare when no new peak came in between
    reads = kernel.value(
        "[(m(), {r: row['used'] for r, row in mpnb.memory_report().to_dict().items()}, m()) for m in "
        "[lambda: {r: max(x['used'] for x in s.memory.samples(r)) for r in (0, 1)}] for _ in range(3)]"
    )
    settled = [(before, used) for before, used, after in reads if before == after]
    assert settled, reads
    before, used = settled[0]
    assert {int(k): v for k, v in before.items()} == {int(k): v for k, v in used.items()}

    out = kernel.run("r = mpnb.memory_report(); print(type(r.data).__name__, list(r.data.index)); r")
    text = "".join(m["content"]["text"] for m in out if m["msg_type"] == "stream")
    assert text.strip() == "DataFrame [0, 1]"
    html = next(m for m in out if m["msg_type"] == "execute_result")["content"]["data"]["text/html"]
    assert html.count("<tr>") == 3 and "optimizer" in html and "MiB" in html


def test_memory_plot_sends_history_then_live_batches(kernel):
    kept = kernel.value("len(s.memory.samples())")  # this module's cells so far: > 20 busy samples
    out = kernel.run("plot = mpnb.memory_plot(); plot")
    result = next(m for m in out if m["msg_type"] == "execute_result")
    model_id = result["content"]["data"][WIDGET_MIME]["model_id"]
    history = _custom_msgs(out, model_id)
    # the history goes out at once, in one batch, from the background batcher
    if not history:
        out = kernel.run("time.sleep(0.3)")
        history = _custom_msgs(out, model_id)
    assert kept > 20 and history and history[0]["type"] == "samples" and len(history[0]["samples"]) >= kept
    out = kernel.run("time.sleep(2.5)")
    live = [s for b in _custom_msgs(out, model_id) for s in b["samples"]]
    assert {s["rank"] for s in live} == {0, 1} and 3 <= len(live) <= 10  # idle: 1 Hz per rank
    kernel.run("plot.close()")


def test_distributed_cell_shows_the_chart_unless_no_monitor(kernel):
    out = kernel.run("%%distributed\nimport time\ntime.sleep(1)")
    shown = [m for m in out if m["msg_type"] == "display_data"]
    assert len(shown) == 1
    display_id = shown[0]["content"]["transient"]["display_id"]
    updates = [m for m in out if m["msg_type"] == "update_display_data"]
    assert [u["content"]["transient"]["display_id"] for u in updates] == [display_id, display_id]
    assert WIDGET_MIME in updates[0]["content"]["data"]  # live while it ran
    assert "image/png" in updates[1]["content"]["data"]

    # a quick cell opens no widget and keeps only the one-line summary: no matplotlib render either
    out = kernel.run("%%distributed\npass")
    assert not any(m["msg_type"] == "comm_open" for m in out)
    updates = [m for m in out if m["msg_type"] == "update_display_data"]
    assert len(updates) == 1 and "image/png" not in updates[0]["content"]["data"]
    assert updates[0]["content"]["data"]["text/plain"].startswith("mpnb memory")

    out = kernel.run("%%distributed --no-monitor\nimport time\ntime.sleep(0.3)")
    charts = [
        m
        for m in out
        if m["msg_type"] in ("display_data", "update_display_data")
        and {WIDGET_MIME, "image/png"} & set(m["content"]["data"])
    ]
    assert charts == []


def test_a_cell_that_all_reduces_4_mib_shows_4_mib_sent_by_each_rank(kernel):
    # the sleeps put a sample before and after the all-reduce (10 Hz while busy)
    code = "import time\ntime.sleep(0.3)\ndist.all_reduce(torch.ones(1 << 20))\ntime.sleep(0.3)"
    started = kernel.value("time.time()")
    out = kernel.run(f"%%distributed\n{code}")
    sent = {int(rank): n for rank, n in kernel.value(f"s.memory.sent(since={started})").items()}
    # gloo's ring all-reduce on 2 ranks sends each rank's half twice: the tensor's 4 MiB, plus headers
    assert set(sent) == {0, 1} and all(4 << 20 <= n <= (4 << 20) * 1.01 for n in sent.values()), sent
    summary = [m for m in out if m["msg_type"] == "update_display_data"][-1]["content"]["data"]["text/plain"]
    assert summary.count("sent 4.0 MiB") == 2, summary
