"""How much mpnb adds to running a cell and to starting a cluster, against baselines measured here.

1. Dispatch: median round trip of an empty `%%distributed` cell against raw ipyparallel
   `view.execute("pass", block=True)` on the same engines (which, like %%distributed, waits until
   each engine's output is complete), both run as cells in the same real IPython shell, as a
   notebook runs them, interleaved so both see the same machine load. Targets: <= 1.3 with the
   memory chart (the default), <= 1.15 with --no-monitor. Also
   shown: the raw call outside a cell, the reply-only round trip (`.get()`, output may still be in
   flight), and the default cell with the live memory chart.
2. Start: `%mpnb start -n 2` until ready (engines up, torch imported, gloo group formed) against
   `torchrun --nproc_per_node 2` running a script that imports torch and forms a gloo group.

3. Start phases: the same steps as `%mpnb start` (mpnb.cluster.launch.local_cluster, ranks.form_world),
   timed one by one: controller and engines launched, engines registered, torch imported on the
   engines (the preload thread's own time, overlapping registration), process group, monitor.
4. Restart: `%mpnb restart` against `%mpnb start` (same run).
5. A hang: a `%%distributed --timeout 6` cell where rank 0 waits in an all_reduce that rank 1 never
   joins; target: the cell ends within timeout + 2 s, and `%mpnb heal` makes the cluster usable.
6. Output: a rank's `print(..., flush=True)` to the notebook (target <= 20 ms), and how often a
   tqdm bar updating at 50 Hz is redrawn (target >= 10 Hz) at what cost to its cell.

Usage: python benchmarks/dispatch.py [--rounds 200] [--starts 3]
       [--part all|dispatch|output|start|phases|restart|hang]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from torchrun_launch import torchrun

os.environ.setdefault("OMP_NUM_THREADS", "1")

BASELINE = "raw view.execute('pass', block=True) in a cell"

TORCHRUN_SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:
    print("READY", time.time(), flush=True)
dist.destroy_process_group()
"""


def shell():
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "mpnb")
    return ip


def run_quiet(ip, source: str) -> None:
    from IPython.utils.capture import capture_output

    with capture_output():
        result = ip.run_cell(source)
    if not result.success:
        raise RuntimeError(f"cell failed: {source!r}: {result.error_in_exec}")


def bench_dispatch(ip, rounds: int) -> dict[str, float]:
    import mpnb

    view = mpnb.session().view()
    view.block = False
    ip.user_ns["view"] = view
    cells = {
        # the same call as a notebook cell in the same shell: what a user of plain ipyparallel runs
        BASELINE: lambda: run_quiet(ip, "view.execute('pass', block=True)"),
        # ipyparallel's own blocking round trip: waits for the reply and for all output (idle status)
        "raw view.execute('pass', block=True) (no cell)": lambda: view.execute("pass", block=True),
        # stricter: the reply only (output may still be in flight; what %%distributed cannot do)
        "raw view.execute('pass').get() (reply only)": lambda: view.execute("pass").get(),
        "%%distributed --no-monitor": lambda: run_quiet(ip, "%%distributed --no-monitor\npass"),
    }
    times: dict[str, list[float]] = {name: [] for name in cells}
    chart: list[float] = []
    for _ in range(10):  # warm up every path
        for fn in cells.values():
            fn()
    for i in range(rounds):
        for name, fn in cells.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        if i % 10 == 0:  # the memory chart renders a figure per cell: sample it less often
            t0 = time.perf_counter()
            run_quiet(ip, "%%distributed\npass")
            chart.append(time.perf_counter() - t0)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    medians[f"%%distributed (default: memory chart on, {len(chart)} cells)"] = statistics.median(chart)
    return medians


def bench_mpnb_start(ip) -> float:
    import mpnb

    t0 = time.perf_counter()
    run_quiet(ip, "%mpnb start -n 2")
    took = time.perf_counter() - t0
    mpnb.stop()
    return took


def bench_torchrun() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ready.py"
        script.write_text(TORCHRUN_SCRIPT)
        launch = torchrun(script)
        ready = float(next(line.split()[1] for line in launch.out.splitlines() if line.startswith("READY")))
        return ready - launch.started


def bench_phases() -> dict[str, float]:
    """The steps of `lifecycle.start`, timed one by one (seconds since the start)."""
    import mpnb
    from mpnb.cluster import ipp_log, launch, ranks
    from mpnb.engine import boot
    from mpnb.monitoring import channel

    marks: dict[str, float] = {}
    t0 = time.perf_counter()
    count, plan = launch.plan_local(2, None, None, 60.0, None)
    cluster = launch.local_cluster(count, plan, ipp_log.logger())
    cluster.start_cluster_sync()
    marks["controller up, engines launched"] = time.perf_counter() - t0
    client = cluster.connect_client_sync()
    client.wait_for_engines(count, timeout=60, interactive=False)
    marks["engines registered"] = time.perf_counter() - t0
    sess = mpnb.cluster.session.Session(client, cluster, plan, mpnb.Config(), source="start")
    sess.ranks, sess.backend = ranks.form_world(client, list(client.ids), plan, sess.config)
    marks["process group formed"] = time.perf_counter() - t0
    channel.attach(sess)
    marks["monitor running (ready)"] = time.perf_counter() - t0
    took = client[:].apply_sync(boot.wait_for_torch)
    marks["  torch import on each engine (overlaps registration)"] = max(t or 0.0 for t in took)
    mpnb.cluster.session.set_current(sess)
    mpnb.stop()
    return marks


def bench_restart(ip, spares: bool) -> tuple[float, float]:
    """(start, restart) seconds in the same run; with `spares`, the restart comes once they are warm."""
    import mpnb
    from mpnb.cluster import spares as spare_engines

    t0 = time.perf_counter()
    run_quiet(ip, "%mpnb start -n 2" + ("" if spares else " --no-spares"))
    start = time.perf_counter() - t0
    run_quiet(ip, "%%distributed\npass")
    if spares:
        wait_until(lambda: spare_engines.ready(mpnb.session()), 120)
    t0 = time.perf_counter()
    run_quiet(ip, "%mpnb restart")
    restart = time.perf_counter() - t0
    mpnb.stop()
    return start, restart


def wait_until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true within {timeout:g} s")
        time.sleep(0.2)


def bench_idle_cpu(ip, seconds: float = 10.0) -> dict[str, float]:
    """Share of one core each kind of process uses while the session idles, spares warm."""
    import psutil

    import mpnb
    from mpnb.cluster import spares as spare_engines

    run_quiet(ip, "%mpnb start -n 2")
    try:
        sess = mpnb.session()
        wait_until(lambda: spare_engines.ready(sess), 120)
        time.sleep(2.0)  # the ranks' own warm-up is over too
        spare_pids = sess.client[spare_engines.engine_ids(sess)].apply_sync(os.getpid)
        controller = psutil.Process(sess.cluster.controller.process.pid)
        groups = {
            "2 spare engines": [psutil.Process(p) for p in spare_pids],
            "2 rank engines (monitor sampling)": [psutil.Process(r.pid) for r in sess.ranks],
            # the hub and the scheduler processes it starts
            "controller (100 ms heartbeats)": [controller, *controller.children(recursive=True)],
        }

        def cpu(procs: list) -> float:
            return sum(sum(p.cpu_times()[:2]) for p in procs)

        first = {name: cpu(procs) for name, procs in groups.items()}
        time.sleep(seconds)
        return {name: (cpu(procs) - first[name]) / seconds for name, procs in groups.items()}
    finally:
        mpnb.stop()


HANG_CELL = """%%distributed --timeout 6
if rank == 0:
    dist.all_reduce(torch.ones(1))
"""


def bench_hang(ip) -> tuple[float, bool]:
    """Seconds until the hung cell ends, and whether a collective works after `%mpnb heal`."""
    from IPython.utils.capture import capture_output

    import mpnb

    run_quiet(ip, "%mpnb start -n 2")
    try:
        run_quiet(ip, "%%distributed\npass")
        t0 = time.perf_counter()
        with capture_output():
            ip.run_cell(HANG_CELL)
        took = time.perf_counter() - t0
        run_quiet(ip, "%mpnb heal")
        run_quiet(ip, "%%distributed\nt = torch.ones(1); dist.all_reduce(t); assert t.item() == 2")
        return took, True
    finally:
        mpnb.stop()


FIRST_OUTPUT_CELL = """%%distributed --no-monitor
import time
print(f"T {time.time()!r}", flush=True)
time.sleep(0.3)
"""


def bench_first_output(ip, rounds: int) -> list[float]:
    """Seconds from each rank's `print(..., flush=True)` to its line reaching the notebook's stdout.

    Engine and kernel share this machine's clock: the line carries the rank's time.time(), and a
    stand-in for the kernel's stdout notes when each line is written to it."""
    import contextlib
    import io
    import re

    class Stamped(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.lags: list[float] = []

        def write(self, text: str) -> int:
            now = time.time()
            self.lags += [now - float(t) for t in re.findall(r"T ([0-9.]+)", text)]
            return super().write(text)

    lags: list[float] = []
    for _ in range(rounds):
        out = Stamped()
        with contextlib.redirect_stdout(out):
            ip.run_cell(FIRST_OUTPUT_CELL)
        lags += out.lags
    return lags


PROGRESS_CELL = """%%distributed --no-monitor
import time
from tqdm import tqdm
for _ in {loop}:
    time.sleep(0.01)
"""


def bench_progress(ip, steps: int = 200) -> tuple[float, float]:
    """(redraws per second of a tqdm bar updating at 50 Hz, cell time with it / without it)."""
    import IPython.display

    redraws: list[float] = []
    publish = IPython.display.publish_display_data  # what mpnb's renderer redraws progress lines with

    def counting(data, metadata=None, *args, transient=None, **kwargs):
        if str((transient or {}).get("display_id", "")).startswith("mpnb-progress"):
            redraws.append(time.monotonic())
        return publish(data, metadata, *args, transient=transient, **kwargs)

    times = {}
    IPython.display.publish_display_data = counting
    try:
        for name, loop in (("plain", f"range({steps})"), ("tqdm", f"tqdm(range({steps}), mininterval=0.02)")):
            t0 = time.perf_counter()
            run_quiet(ip, PROGRESS_CELL.format(loop=loop))
            times[name] = time.perf_counter() - t0
    finally:
        IPython.display.publish_display_data = publish
    span = redraws[-1] - redraws[0] if len(redraws) > 1 else float("inf")
    return (len(redraws) - 1) / span, times["tqdm"] / times["plain"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument(
        "--part", choices=("all", "dispatch", "output", "start", "phases", "restart", "hang"), default="all"
    )
    args = parser.parse_args()
    ip = shell()
    if args.part in ("all", "dispatch"):
        report_dispatch(ip, args.rounds)
    if args.part in ("all", "output"):
        report_first_output(ip)
    if args.part in ("all", "start"):
        report_start(ip, args.starts)
    if args.part in ("all", "phases"):
        report_phases()
    if args.part in ("all", "restart"):
        report_restart(ip, args.starts)
    if args.part in ("all", "hang"):
        report_hang(ip)


def report_dispatch(ip, rounds: int) -> None:
    import mpnb

    run_quiet(ip, "%mpnb start -n 2")
    try:
        medians = bench_dispatch(ip, rounds)
    finally:
        mpnb.stop()
    base = medians[BASELINE]
    print(f"dispatch, median of {rounds} round trips on 2 CPU engines:")
    for name, value in medians.items():
        print(f"  {name:<52} {value * 1e3:8.2f} ms   ratio {value / base:5.2f}")
    chart = next(value for name, value in medians.items() if name.startswith("%%distributed (default"))
    for name, value, target in (
        ("%%distributed (default, memory chart)", chart, 1.3),
        ("%%distributed --no-monitor", medians["%%distributed --no-monitor"], 1.15),
    ):
        print(f"  target: {name} <= {target}x raw -> {'OK' if value / base <= target else 'MISSED'}")


def report_start(ip, rounds: int) -> None:
    starts, torchruns = [], []
    for _ in range(rounds):  # alternate so both see the same load
        starts.append(bench_mpnb_start(ip))
        torchruns.append(bench_torchrun())
    s, t = statistics.median(starts), statistics.median(torchruns)
    print(f"start to ready, median of {rounds}:")
    print(f"  %mpnb start -n 2 (ipyparallel + torch + gloo)   {s:6.2f} s   {[f'{x:.2f}' for x in starts]}")
    print(f"  torchrun 2 procs (torch + gloo)                 {t:6.2f} s   {[f'{x:.2f}' for x in torchruns]}")
    print(f"  ratio mpnb/torchrun {s / t:5.2f}")



def report_first_output(ip, rounds: int = 20) -> None:
    import mpnb

    run_quiet(ip, "%mpnb start -n 2")
    try:
        run_quiet(ip, "%%distributed\npass")
        lags = bench_first_output(ip, rounds)
        rate, cost = bench_progress(ip)
    finally:
        mpnb.stop()
    median = statistics.median(lags)
    print(f"first output, rank's print(flush=True) to the notebook, {len(lags)} lines:")
    print(f"  median {median * 1e3:6.1f} ms   max {max(lags) * 1e3:6.1f} ms   "
          f"(target <= 20 ms: {'OK' if median <= 0.020 else 'MISSED'})")
    print(f"tqdm bar updating at 50 Hz: redrawn {rate:.1f} times a second (target >= 10: "
          f"{'OK' if rate >= 10 else 'MISSED'}); its 2 s cell took {cost:.3f}x the same loop without it")


def report_phases() -> None:
    marks = bench_phases()
    print("start phases (seconds since the start, 2 CPU engines):")
    for name, value in marks.items():
        print(f"  {name:<52} {value:6.2f} s")


def report_restart(ip, rounds: int) -> None:
    warm = [bench_restart(ip, spares=True) for _ in range(rounds)]
    cold = [bench_restart(ip, spares=False) for _ in range(rounds)]
    s = statistics.median(p[0] for p in warm + cold)
    print(f"restart, median of {rounds} (start: {s:.2f} s):")
    for name, pairs in (("on warm spares", warm), ("--no-spares", cold)):
        r = statistics.median(p[1] for p in pairs)
        runs = [f"{p[1]:.2f}" for p in pairs]
        ok = "" if name == "--no-spares" else f"   target <= 1 s: {'OK' if r <= 1.0 else 'MISSED'}"
        print(f"  %mpnb restart {name:<16} {r:6.2f} s   {runs}{ok}")
    print("idle CPU, share of one core while the session idles (spares warm):")
    for name, share in bench_idle_cpu(ip).items():
        print(f"  {name:<40} {share * 100:6.2f} %")


def report_hang(ip) -> None:
    took, healed = bench_hang(ip)
    print("a hang (rank 0 in an all_reduce rank 1 never joins, --timeout 6):")
    print(f"  cell ended after {took:5.2f} s (target <= 8 s: {'OK' if took <= 8.0 else 'MISSED'}); "
          f"collective after %mpnb heal: {'works' if healed else 'FAILED'}")


if __name__ == "__main__":
    main()
