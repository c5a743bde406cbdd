"""Stop, crash, hang, recovery and output floods on a real 2-engine CPU cluster (gloo, 10 s group timeout).

Each case asserts the time bound, what the notebook is told (rank, cause) and that the next cell runs.
The tests share one cluster and run in file order: the rank-death test restarts it at its end.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import threading
import time

import pytest
from IPython.utils.capture import capture_output

from mpnb.errors import ConfigError, RankError
from mpnb.execution.output import strip_ansi
from mpnb.execution.render import PROGRESS_INTERVAL_S
from tests.helpers import own_cluster

pytestmark = pytest.mark.timeout(300)

PG_TIMEOUT_S = 10


def run(ip, source: str):
    """Run one cell; return (result, stdout+stderr as shown, rich outputs, seconds)."""
    t0 = time.monotonic()
    with capture_output() as cap:
        result = ip.run_cell(source, store_history=True)
    return result, strip_ansi(cap.stdout + cap.stderr), cap.outputs, time.monotonic() - t0


def interrupt_main_after(*delays: float) -> list[float]:
    """Raise KeyboardInterrupt in the kernel thread after each delay, as the stop button does.

    Returns a list that gets the monotonic time of each interrupt."""
    main = threading.main_thread().ident
    sent: list[float] = []

    def fire() -> None:
        for d in delays:
            time.sleep(d)
            sent.append(time.monotonic())
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(main), ctypes.py_object(KeyboardInterrupt)
            )

    threading.Thread(target=fire, daemon=True).start()
    return sent


@pytest.fixture(scope="module")
def sess():
    with own_cluster(timeout=PG_TIMEOUT_S) as s:
        yield s


@pytest.fixture(scope="module")
def ip(ipython, sess):
    return ipython


def assert_next_cell_works(ip, expected_world: int = 2) -> None:
    res, out, _, _ = run(
        ip, "%%distributed --no-monitor\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', int(t.item()))\n"
    )
    assert res.success, out
    assert f"sum {expected_world}" in out


def test_a_deprecation_warning_from_torch_distributed_shows_once_per_rank(ip, sess):
    # DeepSpeed makes such calls every step (ZeRO-3: 4 warnings a step): a plain cell shows none (they go
    # to the engine's log, mpnb.engine.quiet); a --verbose cell shows each once per engine, not per call
    code = (
        "import warnings\n"
        "out = torch.zeros(2)\n"
        "for _ in range(3):\n"
        "    with warnings.catch_warnings():  # as libraries do: it resets the registry 'default' uses\n"
        "        pass\n"
        "    dist.all_gather_into_tensor(out, torch.ones(1))\n"
    )
    plain = run(ip, "%%distributed --no-monitor\n" + code)[1]
    assert "FutureWarning" not in plain, plain
    outs = [run(ip, "%%distributed --no-monitor --verbose\n" + code)[1] for _ in range(2)]
    assert outs[0].count("FutureWarning") == 1 and "all_gather_into_tensor` is deprecated" in outs[0], outs[0]
    assert "FutureWarning" not in outs[1], outs[1]


def test_bad_timeout_values_are_clear_errors(ip):
    cases = [
        ("0", "--timeout must be a positive number"),
        ("-2", "positive number"),
        ("abc", "--timeout"),
        ("inf", "positive number"),
    ]
    for value, expected in cases:
        res, out, _, _ = run(ip, f"%%distributed --timeout {value}\nprint('must not run')\n")
        assert isinstance(res.error_in_exec, ConfigError), (value, out)
        assert expected in out and "must not run" not in out


def test_plain_python_cell_stops_within_2s(ip, sess):
    sent = interrupt_main_after(1.0)
    res, out, _, _ = run(ip, "%%distributed --no-monitor\nimport time\nwhile True:\n    time.sleep(0.01)\n")
    assert isinstance(res.error_in_exec, KeyboardInterrupt), out
    assert time.monotonic() - sent[0] < 2.0
    assert sess.cell["status"] == "stopped"
    assert_next_cell_works(ip)


RANK_1_FAILS_WHILE_RANK_0_WAITS = (
    "%%distributed --no-monitor\n"
    "import time\n"
    "t = torch.ones(1)\n"
    "if rank == 1:\n"
    "    time.sleep(0.5)\n"
    "    raise ValueError('bad batch on rank 1')\n"
    "dist.all_reduce(t)\n"
)


def test_one_rank_fails_while_the_other_waits_in_all_reduce(ip, sess):
    run(ip, "%%distributed\nsurvives_heal = 40 + rank\n")
    res, out, _, seconds = run(ip, RANK_1_FAILS_WHILE_RANK_0_WAITS)
    assert type(res.error_in_exec).__name__ == "CellFailedError", out
    assert seconds < 10, f"the cell took {seconds:.1f} s"
    assert "rank 1 failed first: ValueError: bad batch on rank 1" in out
    assert out.index("[rank 1] ValueError") < out.index("[rank 0]"), out  # the cause first
    assert "----> 7 dist.all_reduce(t)" in out  # where rank 0 waited, at its notebook line
    assert re.search(r"rank 0 was in Cell In\[\d+\], line 7 -> .*in all_reduce", out), out
    assert "%mpnb heal" in out
    # the next cell says what is needed instead of hanging on the torn-down group
    res, out, _, _ = run(ip, "%%distributed\nprint('x')\n")
    assert isinstance(res.error_in_exec, RankError) and "%mpnb heal" in out
    res, out, _, seconds = run(ip, "%mpnb heal")
    assert res.success and "process group rebuilt on 2 ranks" in out and seconds < 10
    assert_next_cell_works(ip)
    res, out, _, _ = run(ip, "%%distributed\nprint(survives_heal)\n")
    assert "[rank 0] 40" in out and "[rank 1] 41" in out


def test_one_rank_fails_while_a_live_ddp_model_holds_the_group(ip, sess):
    """DDP keeps the gloo group alive after destroy_process_group; the release must still free rank 0."""
    setup = (
        "%%distributed --no-monitor\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "held = DDP(torch.nn.Linear(8, 8))\n"
        "held(torch.randn(2, 8)).sum().backward()\n"
    )
    assert run(ip, setup)[0].success
    res, out, _, seconds = run(ip, RANK_1_FAILS_WHILE_RANK_0_WAITS)
    assert type(res.error_in_exec).__name__ == "CellFailedError", out
    assert seconds < 5, f"the cell took {seconds:.1f} s (group timeout {PG_TIMEOUT_S} s)"
    assert "rank 1 failed first: ValueError: bad batch on rank 1" in out
    assert "Connection closed by peer" in out  # rank 0 was freed by the release, not by its timeout
    res, out, _, _ = run(ip, "%mpnb heal")
    assert res.success and "mpnb.prepare" in out, out
    assert_next_cell_works(ip)
    # the process that shut its connections down is whole: its DDP module still computes locally
    res, out, _, _ = run(ip, "%%distributed\nprint(tuple(held.module(torch.ones(1, 8)).shape))\ndel held\n")
    assert res.success and out.strip() == "[ranks 0,1] (1, 8)", out


def test_hang_with_timeout_shows_each_rank_stack(ip, sess):
    code = "%%distributed --timeout 3 --no-monitor\nt = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)"
    # rank 1 skips the collective and finishes; rank 0 waits for it
    res, out, _, seconds = run(ip, code)
    assert isinstance(res.error_in_exec, RankError), out
    assert 3 <= seconds < 9, f"{seconds:.1f} s"
    assert "--timeout 3 s" in out
    stack = out.split("[rank 0]\n", 1)[1]
    assert "Cell In[" in stack and "line 4" in stack and "torch/distributed" in stack, out
    assert "%mpnb heal" in out
    run(ip, "%mpnb heal")
    assert_next_cell_works(ip)


def test_watchdog_notices_a_skipped_collective_without_timeout(ip, sess):
    code = "%%distributed --no-monitor\nt = torch.ones(1)\nif rank == 1:\n    dist.barrier()\n"
    res, out, _, seconds = run(ip, code)
    assert not res.success
    assert seconds < PG_TIMEOUT_S, f"{seconds:.1f} s: the watchdog should beat the group timeout"
    assert "Hang: rank 1 waited" in out and "rank 0 finished the cell" in out
    assert "barrier" in out.split("Where the ranks were", 1)[1]
    run(ip, "%mpnb heal")
    assert_next_cell_works(ip)


def test_rank_killed_mid_cell_is_reported_and_recovered(ip, sess):
    run(ip, "%%distributed\nbefore_death = 'kept on ' + str(rank)\n")
    victim = sess.ranks[1]
    killed: list[float] = []

    def kill_later() -> None:
        time.sleep(1.5)
        killed.append(time.monotonic())
        os.kill(victim.pid, signal.SIGKILL)

    threading.Thread(target=kill_later, daemon=True).start()
    code = (
        "%%distributed --no-monitor\nimport time\nt = torch.ones(1)\n"
        "for i in range(600):\n    dist.all_reduce(t)\n    time.sleep(0.05)\n"
    )
    res, out, _, _ = run(ip, code)
    t_end = time.monotonic()
    assert killed and t_end - killed[0] < 5.0, f"reported {t_end - killed[0]:.1f} s after the kill"
    assert f"rank 1 (pid {victim.pid} on {victim.host}) killed by SIGKILL (exit code -9)" in out, out
    assert sess.cell["ranks"]["0"] in ("failed", "stopped") and sess.cell["ranks"]["1"] == "failed"
    assert "%mpnb restart" in out and "%mpnb heal" in out
    res, out, _, _ = run(ip, "%%distributed\nprint('x')\n")
    assert isinstance(res.error_in_exec, RankError) and "%mpnb restart" in out
    # heal: the survivor goes on alone, its namespace kept
    res, out, _, _ = run(ip, "%mpnb heal")
    assert res.success and "rebuilt on 1 rank (1 lost rank left out)" in out, out
    assert sess.world_size == 1
    res, out, _, _ = run(ip, "%%distributed\nprint(before_death, world_size)\n")
    assert res.success and out.strip() == "kept on 0 1", out
    assert_next_cell_works(ip, expected_world=1)
    # restart: a full fresh world again
    res, out, _, _ = run(ip, "%mpnb restart")
    assert res.success and sess.world_size == 2, out
    assert_next_cell_works(ip)


def test_output_flood_is_capped_and_the_engine_not_blocked(ip, sess):
    code = (
        "%%distributed --no-monitor\nimport time\nt0 = time.perf_counter()\n"
        "if rank == 0:\n    for i in range(100_000):\n        print('flood line', i)\n"
        "print_seconds = time.perf_counter() - t0\n"
    )
    res, out, _, seconds = run(ip, code)
    assert res.success, out[-2000:]
    assert seconds < 30, f"{seconds:.1f} s"
    lines = out.splitlines()
    assert len(lines) < 1100, len(lines)
    assert "mpnb: 99,000 more lines not shown" in out and "the last 10:" in out
    flood = [line for line in lines if "flood line" in line]
    assert flood[-1] == "[rank 0] flood line 99999" and "[rank 0] flood line 999" in flood, out[-800:]
    assert len(flood) == 1000 + 10  # the first lines, then the last ones after the note
    printed = sess.view([0]).pull("print_seconds", block=True)[0]
    assert printed < 10, f"the engine spent {printed:.1f} s printing: output blocked it"
    assert_next_cell_works(ip)


def test_tight_tqdm_loop_on_every_rank(ip, sess):
    code = (
        "%%distributed --no-monitor\nfrom tqdm import tqdm\n"
        "for _ in tqdm(range(5_000), mininterval=0, ncols=70):\n    pass\n"
    )
    res, out, outputs, seconds = run(ip, code)
    assert res.success, out[-2000:]
    assert seconds < 90, f"{seconds:.1f} s"
    assert "\r" not in out
    for r in (0, 1):  # thousands of redraws end as one line per rank, not thousands of lines
        bars = [line for line in out.splitlines() if line.startswith(f"[rank {r}]") and "/5000" in line]
        assert len(bars) == 1, bars
    updates = [o for o in outputs if "/5000" in o.data.get("text/plain", "")]
    # the shared progress display is redrawn at most once per interval, not once per tqdm update
    assert 0 < len(updates) <= seconds / PROGRESS_INTERVAL_S + 3, (len(updates), seconds)
    assert_next_cell_works(ip)


def test_stop_button_stops_every_rank_at_the_same_step_20_times(ip, sess):
    run(ip, "%%distributed\nkept = 'namespace ' + str(rank)\n")
    setup = (
        "%%distributed --no-monitor\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "model = DDP(torch.nn.Linear(8, 8))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
    )
    assert run(ip, setup)[0].success
    loop = (
        "%%distributed --no-monitor\n"
        "import time\n"
        "for step in range(1_000_000):\n"
        "    loss = model(torch.randn(4, 8)).pow(2).mean()\n"
        "    loss.backward()\n"
        "    opt.step(); opt.zero_grad()\n"
        "    time.sleep(0.002 * (1 + 3 * rank))  # ranks run at different speeds\n"
        "    if mpnb.should_stop():\n"
        "        break\n"
        "stopped_at = step\n"
    )
    delays = [0.3 + 0.05 * (i % 7) for i in range(20)]
    for i, delay in enumerate(delays):
        sent = interrupt_main_after(delay)
        res, out, _, _ = run(ip, loop)
        t_end = time.monotonic()
        assert sent, "the interrupt was never sent"
        assert isinstance(res.error_in_exec, KeyboardInterrupt), (i, out)
        assert t_end - sent[0] < 2.0, f"trial {i}: took {t_end - sent[0]:.2f} s to stop"
        assert sess.cell["status"] == "stopped" and set(sess.cell["ranks"].values()) == {"stopped"}, sess.cell
        steps = sess.view().pull("stopped_at", block=True)
        assert steps[0] == steps[1], f"trial {i}: ranks stopped at steps {steps}"
        assert re.search(r"\[ranks 0,1\] mpnb: stopped at should_stop\(\) call \d+", out), out
        if i % 5 == 4:  # the group still works (a desynchronised DDP would hang here)
            assert run(ip, loop.replace("range(1_000_000)", "range(3)"))[0].success
    assert_next_cell_works(ip)
    res, out, _, _ = run(ip, "%%distributed\nprint(kept)\n")
    assert "[rank 0] namespace 0" in out and "[rank 1] namespace 1" in out


def test_second_interrupt_forces_a_hard_stop(ip, sess):
    code = (
        "%%distributed --no-monitor\nimport time\n"
        "for step in range(100):\n    time.sleep(20)  # a long step: the cooperative flag waits for its end\n"
        "    if mpnb.should_stop():\n        break\n"
    )
    # should_stop must have been called once for the first SIGINT to be cooperative: make step 0 short
    code = code.replace("time.sleep(20)", "time.sleep(20 if step else 0.01)")
    sent = interrupt_main_after(0.8, 0.7)
    res, out, _, _ = run(ip, code)
    t_end = time.monotonic()
    assert len(sent) == 2 and isinstance(res.error_in_exec, KeyboardInterrupt)
    assert t_end - sent[1] < 2.0, f"{t_end - sent[1]:.2f} s after the second interrupt"
    assert "second interrupt forced a hard stop" in out
    assert sess.cell["status"] == "stopped"
    assert_next_cell_works(ip)
