"""Stopping without noise, the parts that need no cluster: what an engine's output is trimmed to,
which exits count as failures, and a stopped cell shown as one line or none (issue 13)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from mpnb.cluster import ipp_log
from mpnb.execution.report import CellStopped
from tests.helpers import run

ENGINE_OUTPUT = """\
2026-12-03 13:27:32.941 [IPEngine] Loading connection info from $IPP_CONNECTION_INFO
2026-12-03 13:27:32.941 [IPEngine] WARNING | Not using CurveZMQ security
2026-12-03 13:27:38.407 [IPEngine.0] Handling apply_request: 6d72d9f1_17961_1
/usr/bin/ld: cannot find -laio: No such file or directory
collect2: error: ld returned 1 exit status
2026-12-03 13:27:46.669 [IPEngine.0] CRITICAL | received signal 15, stopping
2026-12-03 13:27:46.700 [IPEngine.0] ERROR | Failed to send heartbeat
2026-12-03 13:27:46.904 [KernelNanny.0] Parent 18021 exited with status None.
"""


def test_trim_keeps_what_explains_an_exit_and_drops_ipyparallels_routine_lines():
    kept = ipp_log.trim(ENGINE_OUTPUT)
    assert kept == [
        "/usr/bin/ld: cannot find -laio: No such file or directory",
        "collect2: error: ld returned 1 exit status",
        "2026-12-03 13:27:46.700 [IPEngine.0] ERROR | Failed to send heartbeat",
    ]
    assert ipp_log.trim(ENGINE_OUTPUT, lines=1) == kept[-1:]


def test_exit_codes_in_words():
    assert ipp_log.describe(3) == "exit code 3"
    assert ipp_log.describe(-signal.SIGKILL) == "killed by SIGKILL"
    assert ipp_log.describe(None) == "an unknown exit status"


def _engine_set(alive: dict[str, bool]):
    """An ipyparallel engine set as mpnb reads it: launchers (their processes), then exits and outputs."""
    def launcher(ident: str):
        process = SimpleNamespace(is_running=lambda: alive[ident], status=lambda: "running")
        return SimpleNamespace(pid=100 + int(ident), process=process)

    return SimpleNamespace(
        stop_data={"engines": {}},
        launchers={ident: launcher(ident) for ident in alive},
        outputs={},
    )


def test_only_real_failures_are_reported_with_their_ranks_and_the_log():
    # engine 0 stopped as asked (exit 1: ipengine's SIGTERM handler); 1 had died; 2 crashed while stopping
    es = _engine_set({"0": True, "1": False, "2": True})
    watched = ipp_log.EngineExits.before_stop(SimpleNamespace(engines={"set": es}))
    es.outputs = {"0": ENGINE_OUTPUT, "1": "Segmentation fault\n", "2": "double free detected\n"}
    es.stop_data = {
        "engines": {
            "0": {"exit_code": 1, "pid": 100},
            "1": {"exit_code": -signal.SIGKILL, "pid": 101},
            "2": {"exit_code": -signal.SIGABRT, "pid": 102},
        }
    }
    ranks = [SimpleNamespace(pid=100 + r, rank=r) for r in range(3)]
    lines = watched.problems(ranks, "stop")
    assert lines == [
        "mpnb: rank 1 (pid 101) had already exited before the stop: killed by SIGKILL.",
        "    Segmentation fault",
        "mpnb: rank 2 (pid 102) exited during the stop: killed by SIGABRT.",
        "    double free detected",
        f"mpnb: the engines' full output is in {ipp_log.path()}",
    ]


def test_a_clean_stop_reports_nothing():
    es = _engine_set({"0": True, "1": True})
    watched = ipp_log.EngineExits.before_stop(SimpleNamespace(engines={"set": es}))
    es.outputs = {"0": ENGINE_OUTPUT, "1": ENGINE_OUTPUT}
    es.stop_data = {
        "engines": {"0": {"exit_code": 1, "pid": 100}, "1": {"exit_code": -signal.SIGTERM, "pid": 101}}
    }
    assert watched.problems([], "restart") == []


def test_a_stopped_cell_fails_as_an_interrupt_without_a_traceback(ipython):
    ipython.user_ns["CellStopped"] = CellStopped
    res, out = run(ipython, "raise CellStopped([0, 1], said=True)")
    assert isinstance(res.error_in_exec, KeyboardInterrupt) and not res.success
    assert out.strip() == ""  # the ranks' "stopped at should_stop() call N" line said it all

    res, out = run(ipython, "raise CellStopped([0, 1], said=False)")
    assert isinstance(res.error_in_exec, KeyboardInterrupt) and not res.success
    assert out.strip() == "KeyboardInterrupt: mpnb stopped ranks 0,1"


def test_a_failed_cell_is_kept_in_history_as_shown_not_formatted_again_from_mpnbs_frames(ipython):
    """IPython keeps each failed cell's traceback in its history, formatting it again from the
    frames unless the error renders itself: that took 0.8 s on a session's first failure."""
    from mpnb.execution.report import CellFailedError, RankFailure

    error = CellFailedError([RankFailure([0], "ValueError", "bad batch", ["  Cell In[3], line 2"])], [0, 1])
    ipython.user_ns["error"] = error
    stopped = ["\x1b[1;31mKeyboardInterrupt\x1b[0m: mpnb stopped ranks 0,1"]
    for code, shown in (("raise error", error.render()), ("raise CellStopped([0, 1], said=False)", stopped)):
        res, _ = run(ipython, code)
        assert ipython.history_manager.exceptions[res.execution_count]["traceback"] == shown
