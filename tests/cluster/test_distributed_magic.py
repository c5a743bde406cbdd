"""`%%distributed` as a user sees it: cells run through a real IPython shell on a real 2-engine cluster."""

from __future__ import annotations

import threading
import time

import pytest
from IPython.utils.capture import capture_output

from mpnb.errors import MpnbError
from mpnb.execution.output import strip_ansi

pytestmark = pytest.mark.timeout(300)


def run(ip, source: str):
    """Run one cell; return (result, stdout, stderr, rich outputs) as the notebook would show them."""
    with capture_output() as cap:
        result = ip.run_cell(source, store_history=True)
    return result, strip_ansi(cap.stdout), strip_ansi(cap.stderr), cap.outputs


@pytest.fixture(scope="module")
def ip(ipython, cluster):
    return ipython


def test_engine_namespace_env_and_process_group(ip):
    res, out, _, _ = run(
        ip,
        "%%distributed\n"
        "import os\n"
        "keys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT']\n"
        "print('env', [os.environ[k] for k in keys][:4], os.environ['OMP_NUM_THREADS'])\n"
        "print('pg', dist.is_initialized(), dist.get_rank() == rank, dist.get_world_size(), str(device))\n"
        "print('state', mpnb.engine.state.rank == rank, mpnb.engine.state.world_size)\n",
    )
    assert res.success, out
    assert "[rank 0] env ['0', '0', '2', '2'] 1" in out
    assert "[rank 1] env ['1', '1', '2', '2'] 1" in out
    assert "[ranks 0,1] pg True True 2 cpu" in out
    assert "[ranks 0,1] state True 2" in out


def test_all_reduce_and_grouped_output(ip):
    res, out, _, _ = run(
        ip,
        "%%distributed\nt = torch.tensor([float(rank + 1)])\ndist.all_reduce(t)\nfor i in range(3):\n"
        "    print(f'step {i} loss {t.item() / (i + 1):.3f}')\n",
    )
    assert res.success
    lines = out.strip().splitlines()
    # identical lines from both ranks appear once, labelled with both ranks
    assert lines == [
        "[ranks 0,1] step 0 loss 3.000",
        "[ranks 0,1] step 1 loss 1.500",
        "[ranks 0,1] step 2 loss 1.000",
    ]


def test_differing_lines_are_labelled_per_rank_and_common_lines_realign(ip):
    res, out, _, _ = run(
        ip,
        "%%distributed\nprint('start')\nif rank == 0:\n    print('only on rank 0')\n"
        "print('value', rank)\nprint('end')\n",
    )
    assert res.success
    assert out.strip().splitlines() == [
        "[ranks 0,1] start",
        "[rank 0] only on rank 0",
        "[rank 0] value 0",
        "[rank 1] value 1",
        "[ranks 0,1] end",
    ]


def test_output_all_and_rank0_modes(ip):
    _, out_all, _, _ = run(ip, "%%distributed --output all\nprint('same')\n")
    assert sorted(out_all.strip().splitlines()) == ["[rank 0] same", "[rank 1] same"]
    _, out_r0, _, _ = run(ip, "%%distributed --output rank0\nprint('from', rank)\n")
    assert out_r0.strip().splitlines() == ["from 0"]


def test_quiet_hides_output_but_not_errors(ip):
    res, out, _, outputs = run(ip, "%%distributed --quiet\nprint('noise')\nrank\n")
    assert res.success and "noise" not in out and "Out[" not in out and not outputs
    res, out, _, _ = run(ip, "%%distributed --quiet\nraise RuntimeError('loud')\n")
    assert not res.success and "RuntimeError: loud" in out


def test_ranks_selection_and_state_persists(ip):
    assert run(ip, "%%distributed\ncounter = 100 + rank\n")[0].success
    res, out, _, _ = run(ip, "%%distributed --rank 1\nprint(counter)\n")
    assert res.success and out.strip() == "101"  # one rank: no label
    res, out, _, _ = run(ip, "%%distributed --ranks 0,1\ncounter += 1\nprint(counter)\n")
    assert "[rank 0] 101" in out and "[rank 1] 102" in out


def test_last_expression_shown_like_ipython_collapsed_when_equal(ip):
    _, out, _, _ = run(ip, "%%distributed\nworld_size * 21\n")
    assert out.strip().endswith(": 42") and "rank" not in out.split("Out[")[1].split(":")[0]
    _, out, _, _ = run(ip, "%%distributed\nrank + 10\n")
    assert "[rank 0] 10" in out and "[rank 1] 11" in out
    assert ip.user_ns["_"].values[1]["text/plain"] == "11"


def test_error_once_per_distinct_traceback_pointing_at_user_line(ip):
    res, out, _, _ = run(ip, "%%distributed\nx = 1\ny = x / 0\n")
    assert not res.success  # Run All stops here
    assert res.error_in_exec is not None and type(res.error_in_exec).__name__ == "CellFailedError"
    # one block for both ranks (identical tracebacks), not one per rank
    assert out.count("[ranks 0,1] ZeroDivisionError: division by zero") == 1, out
    assert "[rank 0] ZeroDivisionError" not in out and "[rank 1] ZeroDivisionError" not in out
    assert out.count("Traceback (most recent call last)") == 1
    assert "----> 3 y = x / 0" in out  # line 3 of the notebook cell (line 1 is %%distributed)
    assert "CompositeError" not in out

    res, out, _, _ = run(ip, "%%distributed\nif rank == 1:\n    raise ValueError(f'bad value on {rank}')\n")
    assert not res.success
    assert "[rank 1] ValueError: bad value on 1" in out
    assert "----> 3     raise ValueError" in out
    assert "The cell failed on rank 1; rank 0 finished." in out
    # the engines survive and the next cell works
    assert run(ip, "%%distributed\nprint('alive')\n")[1].strip() == "[ranks 0,1] alive"


def test_rich_output_labelled_and_grouped(ip):
    res, out, _, outputs = run(
        ip,
        "%%distributed --no-monitor\nfrom IPython.display import HTML, display\n"
        "display(HTML('<b>same</b>'))\ndisplay(HTML(f'<i>rank {rank}</i>'))\n",
    )
    assert res.success
    htmls = [o.data.get("text/html") for o in outputs if "text/html" in o.data]
    assert htmls == ["<b>same</b>", "<i>rank 0</i>", "<i>rank 1</i>"]
    assert out.strip().splitlines() == ["[ranks 0,1]", "[rank 0]", "[rank 1]"]


def test_matplotlib_figure_from_ranks(ip):
    res, out, _, outputs = run(
        ip,
        "%%distributed --no-monitor\n%matplotlib inline\nimport matplotlib.pyplot as plt\n"
        "plt.plot([0, rank + 1]); plt.title(f'rank {rank}'); plt.show()\n",
    )
    assert res.success, out
    pngs = [o for o in outputs if "image/png" in o.data]
    assert len(pngs) == 2 and pngs[0].data["image/png"] != pngs[1].data["image/png"]
    assert "[rank 0]" in out and "[rank 1]" in out


def test_tqdm_progress_becomes_one_final_line_per_rank(ip):
    res, _, err, outputs = run(
        ip,
        "%%distributed --no-monitor\nfrom tqdm import tqdm\nimport time\n"
        "for _ in tqdm(range(20), mininterval=0, ncols=60):\n    time.sleep(0.01)\n",
    )
    assert res.success
    final = [line for line in err.splitlines() if "20/20" in line]
    assert len(final) == 2 and final[0].startswith("[rank 0]") and final[1].startswith("[rank 1]")
    assert "\r" not in err
    live = [o for o in outputs if o.data.get("text/plain", "").count("/20") >= 1]
    assert live, "progress should be shown live in an updating display"


def test_output_streams_while_the_cell_runs(ip):
    import sys

    seen: list[tuple[float, str]] = []

    class Spy:
        def write(self, text):
            seen.append((time.monotonic(), text))

        def flush(self):
            pass

    old = sys.stdout
    sys.stdout = Spy()
    try:
        t0 = time.monotonic()
        ip.run_cell("%%distributed\nimport time\nprint('before sleep')\ntime.sleep(2)\nprint('after')\n")
        t_end = time.monotonic()
    finally:
        sys.stdout = old
    first = next(t for t, text in seen if "before sleep" in text)
    assert first - t0 < 1.5 and t_end - first > 1.0


def test_cell_state_reaches_listeners(ip, cluster):
    states: list[dict] = []
    unsubscribe = cluster.on_change(lambda s: states.append(dict(s.cell)) if s.last_event == "cell" else None)
    try:
        run(ip, "%%distributed\nif rank == 0:\n    raise KeyError('x')\n")
    finally:
        unsubscribe()
    assert states[0]["status"] == "running" and states[0]["ranks"] == {"0": "running", "1": "running"}
    assert states[-1]["status"] == "failed" and states[-1]["ranks"] == {"0": "failed", "1": "done"}
    assert len({s["id"] for s in states}) == 1


def test_timeout_interrupts_a_cell(ip):
    t0 = time.monotonic()
    res, out, _, _ = run(ip, "%%distributed --timeout 1\nimport time\ntime.sleep(30)\n")
    assert not res.success and time.monotonic() - t0 < 8
    assert "--timeout 1 s" in out
    assert run(ip, "%%distributed\nprint('next')\n")[1].strip() == "[ranks 0,1] next"


def test_bad_cell_options_are_clear_errors(ip):
    for line, expected in [
        ("%%distributed --ranks 0,5", "Rank 5 does not exist"),
        ("%%distributed --ranks x", "--ranks takes rank numbers"),
        ("%%distributed --rank 0 --ranks 1", "either --ranks or --rank"),
        ("%%distributed --output fancy", "--output must be one of grouped, all, rank0"),
        ("%%distributed --timeout -3", "--timeout must be a positive number"),
        ("%%distributed --bogus", "unrecognized arguments: --bogus"),
        ("%%distributed --ranks 0-999999999", "Ranks 2-999999999 do not exist: this cluster has ranks 0-1"),
        ("%%distributed --ranks 3-1", "--ranks 3-1: a range goes low-high, e.g. 1-3"),
        ("%%distributed --timeout nan", "--timeout must be a positive number of seconds, not 'nan'"),
    ]:
        res, out, _, _ = run(ip, f"{line}\nprint('must not run')\n")
        assert not res.success, line
        assert expected in out, (line, out)
        assert "must not run" not in out
        assert isinstance(res.error_in_exec, MpnbError)


def test_interrupt_stops_all_ranks_and_keeps_namespace(ip, cluster):
    run(ip, "%%distributed\nkept = rank + 7\n")
    main = threading.main_thread().ident
    import ctypes

    def interrupt_later():
        time.sleep(1.5)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(KeyboardInterrupt))

    threading.Thread(target=interrupt_later, daemon=True).start()
    t0 = time.monotonic()
    res, _, _, _ = run(ip, "%%distributed\nimport time\nfor _ in range(600):\n    time.sleep(0.05)\n")
    assert not res.success and time.monotonic() - t0 < 6
    assert cluster.cell["status"] == "stopped"
    assert run(ip, "%%distributed\nprint(kept)\n")[1].strip().splitlines() == ["[rank 0] 7", "[rank 1] 8"]


def test_floods_of_bytes_and_displays_reach_the_notebook_capped_with_notes(ip):
    from mpnb.execution.output_cap import MAX_CHARS_PER_RANK, MAX_DISPLAYS_PER_RANK, MAX_LINE_CHARS

    code = (
        "%%distributed --no-monitor\n"
        "import sys\n"
        "if rank == 0:\n"
        "    mib = 'x' * 2**20\n"
        "    for i in range(200):  # 200 MiB without a newline\n"
        "        sys.stdout.write(mib)\n"
        "        if i % 10 == 9:  # ~10 MiB messages, as a slower loop would send them\n"
        "            sys.stdout.flush()\n"
        "    print()\n"
        "    for i in range(2000):\n"
        "        print(f'long {i} ' + 'y' * 100_000, flush=True)  # 2 000 messages\n"
        "print('normal', rank)\n"
    )
    t0 = time.monotonic()
    res, out, err, _ = run(ip, code)
    assert res.success, out[-2000:]
    assert len(out) + len(err) < MAX_CHARS_PER_RANK + 2 * 2**20, len(out)  # was 295 MiB
    lines = [line for line in out.splitlines() if line != "[rank 1] normal 1"]  # rank 1 prints at once
    assert len(lines) + 1 == len(out.splitlines())
    assert lines[0] == "[rank 0] " + "x" * MAX_LINE_CHARS + (
        f" [mpnb: {200 * 2**20 - MAX_LINE_CHARS:,} more characters of this line not shown]"
    )
    assert lines[1].startswith("[rank 0] long 0 yyy") and lines[1].endswith(
        "90,007 more characters of this line not shown]"
    )
    note = next(line for line in lines if "more lines (" in line)
    assert note.startswith("[rank 0] mpnb: ") and "the first 2.0 MiB of each rank's output are" in note
    assert lines[-1] == "[rank 0] normal 0"  # the end of the flood, after the note
    # ipyparallel re-copies all output so far into its own record per message unless mpnb drops it:
    # quadratic, 2 000 messages of 100 KB took over 2 minutes that way
    assert time.monotonic() - t0 < 40, f"{time.monotonic() - t0:.1f} s"

    res, out, _, outputs = run(
        ip,
        "%%distributed --no-monitor\nfrom IPython.display import display\nfor i in range(3000):\n"
        "    display({'text/plain': f'item {i}'}, raw=True)\nprint('after', rank)\n",
    )
    assert res.success, out[-2000:]
    items = [o.data["text/plain"] for o in outputs if o.data.get("text/plain", "").startswith("item ")]
    # each rank shows its first 200; where both ranks are in step they show as one group
    assert set(items) == {f"item {i}" for i in range(MAX_DISPLAYS_PER_RANK)}, len(items)
    assert MAX_DISPLAYS_PER_RANK <= len(items) <= 2 * MAX_DISPLAYS_PER_RANK
    note = f"mpnb: {3000 - MAX_DISPLAYS_PER_RANK:,} more displays ("
    assert f"[ranks 0,1] {note}" in out or (f"[rank 0] {note}" in out and f"[rank 1] {note}" in out), out[
        -2000:
    ]

    res, out, _, _ = run(ip, "%%distributed\nprint('plain', rank)\n")
    # distinct lines show in the order they came: after a flood, rank 1 may well be first
    assert sorted(out.strip().splitlines()) == ["[rank 0] plain 0", "[rank 1] plain 1"] and "mpnb:" not in out
