"""The first training cell on fresh engines: ZeRO-1/2/3 against DDP, in the same run.

Each measurement starts a fresh 2-engine CPU cluster (`mpnb.start`, timed: start readiness),
waits `--pause` seconds (a learner reads the next cell; mpnb warms DeepSpeed up meanwhile),
then runs one `%%distributed` cell in a real IPython shell: build the tiny GPT and AdamW,
`mpnb.prepare` under the strategy, take STEPS steps. The cell's wall time on the kernel is the
"first cell" time; its output is checked for lines a learner should not see (compiler, linker,
warnings). Strategies alternate order between rounds, so load on this shared machine falls on
all of them; medians over rounds are printed, with each ZeRO stage's difference and ratio to DDP.
Target: a first ZeRO cell <= 3 s longer than DDP's, and no noisy lines.

Needs DeepSpeed's CPU ops built (`make install` does it). Run under the cluster lock here:
    flock /tmp/mpnb-cluster.lock .venv/bin/python benchmarks/first_zero_cell.py [--rounds 2] [--pause 5]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "mpnb" / "torch_extensions"))

CONFIGS = {
    "ddp": {"strategy": "ddp", "micro_batch_size": 4},
    "zero1": {"strategy": "zero", "zero_stage": 1, "micro_batch_size": 4},
    "zero2": {"strategy": "zero", "zero_stage": 2, "micro_batch_size": 4},
    "zero3": {"strategy": "zero", "zero_stage": 3, "micro_batch_size": 4},
}
STEPS = 3
CELL = """
from mpnb.models import tiny_gpt, synthetic_batches
model = tiny_gpt(seed=0)
trainer = mpnb.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config={config!r})
for batch in synthetic_batches(batch_size=4 * world_size, steps={steps}, seed=0):
    loss = trainer.step(batch)
print(f"loss {{float(loss):.3f}}")
"""
# what a learner should never see in a cell unless asked: compilers, linkers, library warnings
NOISE = re.compile(r"ld:|collect2|warning|error|ninja|g\+\+|built successfully", re.IGNORECASE)


def shell():
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "mpnb")
    return ip


def first_cell(ip, name: str, pause: float) -> dict[str, object]:
    """Start fresh engines, wait `pause` s, run the first training cell; stop the engines."""
    from IPython.utils.capture import capture_output

    import mpnb

    t0 = time.perf_counter()
    mpnb.start(n=2, verbose=False)
    started = time.perf_counter() - t0
    try:
        time.sleep(pause)
        t0 = time.perf_counter()
        with capture_output() as cap:
            ip.run_cell_magic("distributed", "", CELL.format(config=CONFIGS[name], steps=STEPS))
        cell = time.perf_counter() - t0
    finally:
        mpnb.stop()
    text = cap.stdout + cap.stderr
    return {"start": started, "cell": cell, "noise": [ln for ln in text.splitlines() if NOISE.search(ln)],
            "output": text}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="fresh clusters per strategy")
    parser.add_argument("--pause", type=float, default=5.0, help="seconds between start and the first cell")
    parser.add_argument("--strategies", default=",".join(CONFIGS))
    parser.add_argument("--show-output", action="store_true", help="print each first cell's output")
    args = parser.parse_args()
    names = args.strategies.split(",")
    if "ddp" not in names:
        names.insert(0, "ddp")

    ip = shell()
    runs: dict[str, list[dict[str, object]]] = {n: [] for n in names}
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            run = first_cell(ip, name, args.pause)
            runs[name].append(run)
            print(f"round {round_ + 1} {name}: start {run['start']:.1f} s, first cell {run['cell']:.1f} s, "
                  f"{len(run['noise'])} noisy lines", file=sys.stderr, flush=True)
            if args.show_output:
                print(run["output"], file=sys.stderr)

    print(f"first training cell on fresh engines (tiny GPT, AdamW, {STEPS} steps, 2 CPU ranks), "
          f"pause {args.pause:g} s after start; medians over {args.rounds} rounds")
    print("{:<8} {:>9} {:>11} {:>10} {:>7} {:>6}".format("strategy", "start", "first cell", "vs ddp", "ratio",
                                                        "noise"))
    ddp = statistics.median(r["cell"] for r in runs["ddp"])  # type: ignore[misc]
    worst = 0.0
    for name, rs in runs.items():
        start = statistics.median(r["start"] for r in rs)  # type: ignore[misc]
        cell = statistics.median(r["cell"] for r in rs)  # type: ignore[misc]
        noise = max(len(r["noise"]) for r in rs)  # type: ignore[arg-type]
        if name != "ddp":
            worst = max(worst, cell - ddp)
        print(f"{name:<8} {start:>7.1f} s {cell:>9.1f} s {cell - ddp:>+8.1f} s {cell / ddp:>7.2f} {noise:>6}")
    for name, rs in runs.items():
        for line in sorted({ln for r in rs for ln in r["noise"]})[:5]:  # type: ignore[attr-defined]
            print(f"  {name} noise: {line}")
    print(f"worst ZeRO - DDP: {worst:+.1f} s (target <= +3.0 s)")


if __name__ == "__main__":
    main()
