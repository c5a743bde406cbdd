"""`mpnb.run` of a torchrun script against `torchrun` itself: training-loop time and a run's one-off cost.

The script (written to a temp dir) trains a tiny MLP with DDP on synthetic data for 200 steps and
times its own training loop on rank 0: `time.perf_counter()` between a barrier before the loop and
a barrier after it; rank 0 writes that time to the file named by `--report`.

- torchrun: `python -m torch.distributed.run --nproc_per_node 2 script.py` in a subprocess,
  wall time from launch to exit (starts 2 Pythons, imports torch, forms a gloo group, trains, exits);
- mpnb: `mpnb.run(script, args=...)` on a warm 2-engine cluster started once, after one warm-up
  run, wall time of the call (parks mpnb's group, the script forms its own, trains, mpnb's group back).

Runs alternate (torchrun, mpnb, mpnb, torchrun, ...) so both see the same load on a shared machine.
Printed: each pair's ratio of training-loop times mpnb/torchrun and their median (target <= 1.05),
the one-off cost of a run (wall time minus loop time) of each, and mpnb's fixed cost per run: the wall
time of `mpnb.run` on an empty script (cell dispatch, parking mpnb's group and forming it again).

Usage: python benchmarks/script_run.py [--repeats 3] [--steps 200]
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

SCRIPT = '''
"""200 DDP steps of a tiny MLP on synthetic data; rank 0 writes the loop's seconds to --report."""
import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--report", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(args.steps, 64, 64, generator=g), torch.randn(args.steps, 64, 1, generator=g)

dist.barrier()
t0 = time.perf_counter()
for step in range(args.steps):
    loss = nn.functional.mse_loss(model(x[step]), y[step])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
dist.barrier()
loop = time.perf_counter() - t0
if rank == 0:
    with open(args.report, "w") as f:
        f.write(f"{loop}\\n")
    print(f"loop {loop:.3f} s, final loss {loss.item():.4f}")
dist.destroy_process_group()
'''


def run_torchrun(script: Path, report: Path, steps: int) -> tuple[float, float]:
    """(wall, loop) seconds of one torchrun launch of `script`."""
    launch = torchrun(script, ["--steps", str(steps), "--report", str(report)], stderr_too=True)
    if not launch.completed:
        raise RuntimeError(f"torchrun failed ({launch.returncode}):\n{launch.out}")
    return launch.wall, float(report.read_text())


def run_empty(script: Path) -> float:
    """Wall seconds of `mpnb.run` of a script that does nothing: what every run costs."""
    from IPython.utils.capture import capture_output

    import mpnb

    t0 = time.perf_counter()
    with capture_output():
        mpnb.run(str(script))
    return time.perf_counter() - t0


def run_mpnb(script: Path, report: Path, steps: int) -> tuple[float, float]:
    """(wall, loop) seconds of one `mpnb.run` of `script` on the live cluster, its output captured."""
    from IPython.utils.capture import capture_output

    import mpnb

    t0 = time.perf_counter()
    with capture_output():
        mpnb.run(str(script), args=["--steps", str(steps), "--report", str(report)])
    wall = time.perf_counter() - t0
    return wall, float(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (torchrun, mpnb)")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    import mpnb

    runs: dict[str, list[tuple[float, float]]] = {"torchrun": [], "mpnb": []}
    empty: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        script, report = Path(tmp) / "ddp_mlp.py", Path(tmp) / "loop.txt"
        script.write_text(SCRIPT)
        (Path(tmp) / "empty.py").write_text("pass\n")
        t0 = time.perf_counter()
        mpnb.start(n=2, verbose=False)
        started = time.perf_counter() - t0
        try:
            warm = run_mpnb(script, report, args.steps)  # first run: imports, first group formed
            for i in range(args.repeats):
                order = ("torchrun", "mpnb") if i % 2 == 0 else ("mpnb", "torchrun")
                for name in order:
                    fn = run_torchrun if name == "torchrun" else run_mpnb
                    runs[name].append(fn(script, report, args.steps))
                empty.append(run_empty(Path(tmp) / "empty.py"))
        finally:
            mpnb.stop()
    report_results(runs, warm, started, args.steps)
    print(f"  mpnb.run of an empty script (fixed cost per run): median {statistics.median(empty):.2f} s "
          f"{[f'{x:.2f}' for x in empty]}")


def report_results(runs: dict[str, list[tuple[float, float]]], warm: tuple[float, float],
                   started: float, steps: int) -> None:
    pairs = list(zip(runs["mpnb"], runs["torchrun"], strict=True))
    ratios = [m[1] / t[1] for m, t in pairs]
    ratio = statistics.median(ratios)
    print(f"{steps}-step DDP script (tiny MLP) on 2 CPU ranks, {len(pairs)} interleaved pairs:")
    print(f"  {'':<10} {'loop s (median)':>16} {'wall s (median)':>16} {'one-off s (median)':>19}")
    for name, rs in runs.items():
        loop = statistics.median(r[1] for r in rs)
        wall = statistics.median(r[0] for r in rs)
        once = statistics.median(r[0] - r[1] for r in rs)
        print(f"  {name:<10} {loop:16.3f} {wall:16.3f} {once:19.3f}")
    print(f"  training loop mpnb/torchrun per pair {[f'{r:.3f}' for r in ratios]}, median {ratio:.3f} "
          f"(target <= 1.05: {'OK' if ratio <= 1.05 else 'MISSED'})")
    once_m = statistics.median(r[0] - r[1] for r in runs["mpnb"])
    once_t = statistics.median(r[0] - r[1] for r in runs["torchrun"])
    print(f"  one-off cost of a run (wall - loop): mpnb {once_m:.2f} s vs torchrun {once_t:.2f} s "
          f"(ratio {once_m / once_t:.2f})")
    print(f"  once per notebook: cluster start {started:.1f} s, "
          f"first mpnb run's one-off {warm[0] - warm[1]:.2f} s")


if __name__ == "__main__":
    main()
