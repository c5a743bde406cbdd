"""What stopping prints, in a real kernel: `%mpnb stop`, `%mpnb restart`, the stop button on a cell that
calls mpnb.should_stop(), and kernel shutdown each print one line; ipyparallel's engine logs go to a
private file, and reach the notebook only trimmed, when an engine really failed (issue 13)."""

from __future__ import annotations

import queue
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from jupyter_client.manager import KernelManager

from mpnb.execution.output import strip_ansi
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(420)

# What ipyparallel used to echo into the notebook on every stop and restart.
ENGINE_LOG_WORDS = ("Traceback", "CRITICAL", "Handling apply_request", "exit_code", "received signal")


@dataclass
class Reply:
    status: str  # the execute_reply's: "error" makes the frontend stop "Run All"
    text: str  # every stream and error output, without colours
    errors: list[dict]  # the error outputs the notebook shows

    @property
    def lines(self) -> list[str]:
        return [line for line in self.text.splitlines() if line.strip()]


class Kernel:
    def __init__(self, stderr_path: Path) -> None:
        self.stderr = stderr_path.open("w")
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(stderr=self.stderr)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, interrupt_on: str | None = None, timeout: float = 180) -> Reply:
        """Run `code`; with `interrupt_on`, press the stop button once that text was printed."""
        msg_id = self.kc.execute(code)
        texts: list[str] = []
        errors: list[dict] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{code!r} did not finish in {timeout} s: {''.join(texts)}") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                texts.append(content["text"])
                if interrupt_on and interrupt_on in content["text"]:
                    self.km.interrupt_kernel()
                    interrupt_on = None
            elif kind == "error":
                errors.append(content)
                texts.append("\n".join(content["traceback"]) + "\n")
            elif kind == "status" and content["execution_state"] == "idle":
                break
        reply = self.kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=30)
        return Reply(reply["content"]["status"], strip_ansi("".join(texts)), errors)

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)
        self.stderr.close()


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> Iterator[Kernel]:
    k = Kernel(tmp_path_factory.mktemp("kernel") / "stderr.txt")
    try:
        assert k.run("%load_ext mpnb").status == "ok"
        yield k
    finally:
        if k.km.is_alive():
            k.run("%mpnb stop")
            k.shutdown()


def assert_one_line(reply: Reply, pattern: str) -> None:
    assert reply.status == "ok", reply.text
    assert len(reply.lines) == 1 and re.fullmatch(pattern, reply.lines[0]), reply.text


def test_stop_restart_and_a_cooperative_stop_print_one_line_each(kernel):
    assert_one_line(kernel.run("%mpnb start -n 2 --timeout 30"), r"mpnb: 2 ranks ready in .*")

    loop = (
        "%%distributed --no-monitor\nimport time\n"
        "for step in range(1_000_000):\n"
        "    time.sleep(0.01)\n"
        "    if mpnb.should_stop():\n        break\n"
        "    if step == 0:\n        print('looping', flush=True)\n"
    )
    stopped = kernel.run(loop, interrupt_on="looping")
    assert stopped.status == "error", stopped.text  # so "Run All" stops at this cell
    assert stopped.errors == [], stopped.errors  # no traceback, not even a one-line error
    said = [line for line in stopped.lines if "looping" not in line]
    assert len(said) == 1, stopped.text
    assert re.fullmatch(r"\[ranks 0,1\] mpnb: stopped at should_stop\(\) call \d+", said[0])

    assert_one_line(kernel.run("%mpnb restart"), r"mpnb: 2 ranks ready in .*")
    assert kernel.run("%%distributed\nprint('after restart', rank)").status == "ok"
    log_path = kernel.run("from mpnb.cluster import ipp_log\nprint(ipp_log.path())").lines[-1]

    assert_one_line(kernel.run("%mpnb stop"), r"mpnb: cluster stopped\.")
    full_log = Path(log_path).read_text()
    assert "Handling apply_request" in full_log and "engine set stopped" in full_log  # kept, not shown


def test_an_engine_that_died_before_the_stop_is_explained_in_a_few_lines(kernel):
    assert kernel.run("%mpnb start -n 2 --timeout 30").status == "ok"
    died = kernel.run("%%distributed --no-monitor --rank 1\nimport os\nos._exit(3)")
    assert died.status == "error" and "rank 1" in died.text

    stop = kernel.run("%mpnb stop")
    assert stop.status == "ok", stop.text
    assert stop.lines[0] == "mpnb: cluster stopped."
    died_line = r"mpnb: rank 1 \(pid \d+\) had already exited before the stop: exit code 3\."
    assert re.fullmatch(died_line, stop.lines[1]), stop.text
    assert stop.lines[-1].startswith("mpnb: the engines' full output is in ")
    assert len(stop.lines) <= 3 + 6, stop.text  # at most TRIMMED_LINES of the engine's own output
    assert not any(word in stop.text for word in ENGINE_LOG_WORDS), stop.text


def test_kernel_shutdown_stops_the_cluster_with_one_line(kernel):
    assert kernel.run("%mpnb start -n 2 --timeout 30").status == "ok"
    pids = kernel.run("%%distributed\nimport os\nprint(os.getpid())")
    engine_pids = [int(line.split()[-1]) for line in pids.lines]
    kernel.shutdown()

    text = Path(kernel.stderr.name).read_text()
    ours = [line for line in text.splitlines() if "mpnb" in line or "luster" in line]
    assert ours == ["mpnb: stopping the cluster (the kernel is shutting down)."], text
    assert not any(word in text for word in ENGINE_LOG_WORDS), text
    assert len(engine_pids) == 2
    assert wait_for(lambda: not any(psutil.pid_exists(p) for p in engine_pids), timeout=15)
