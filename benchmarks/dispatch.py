"""How much mpnb adds to running a cell and to starting a cluster, against baselines measured here.

1. Dispatch: median round trip of an empty `%%distributed` cell against raw ipyparallel
   `view.execute("pass", block=True)` on the same engines (which, like %%distributed, waits until
   each engine's output is complete), both run as cells in the same real IPython shell, as a
   notebook runs them, interleaved so both see the same machine load. Target ratio <= 1.3. Also
   shown: the raw call outside a cell, the reply-only round trip (`.get()`, output may still be in
   flight), and the default cell with the live memory chart.
2. Start: `%mpnb start -n 2` until ready (engines up, torch imported, gloo group formed) against
   `torchrun --nproc_per_node 2` running a script that imports torch and forms a gloo group.

Usage: python benchmarks/dispatch.py [--rounds 200] [--starts 3]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--part", choices=("all", "dispatch", "start"), default="all")
    args = parser.parse_args()
    ip = shell()
    if args.part in ("all", "dispatch"):
        report_dispatch(ip, args.rounds)
    if args.part in ("all", "start"):
        report_start(ip, args.starts)


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
    print(
        f"  target: %%distributed --no-monitor <= 1.3x raw -> "
        f"{'OK' if medians['%%distributed --no-monitor'] / base <= 1.3 else 'MISSED'}"
    )


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


if __name__ == "__main__":
    main()
