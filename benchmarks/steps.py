"""Step time of the same training loop in notebook engines vs a torchrun script (warm processes).

For each strategy, the tiny GPT (mpnb.models) trains STEPS steps of AdamW on
2 ranks:
- notebook: a real IPython shell with `%load_ext mpnb`, `mpnb.start(n=2)`
  (memory monitor on), one `%%distributed` cell that prepares and warms up,
  then a timed `%%distributed` cell of STEPS steps (timed from the kernel, so
  cell dispatch, output collection and the monitor's sampling are included);
- baseline: the same code as a script under `torchrun --nproc-per-node 2`,
  timing STEPS steps between barriers after the same warm-up.

Rounds alternate notebook and torchrun so both see the same machine load; the
ratio per strategy is median(notebook) / median(torchrun) step time, and the
geometric mean over strategies is the number to watch (target <= 1.05).

Usage: python benchmarks/steps.py [--steps 20] [--rounds 3] [--strategies ddp,fsdp,...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "mpnb" / "torch_extensions"))

CONFIGS = {
    "ddp": {"strategy": "ddp", "micro_batch_size": 4},
    "fsdp": {"strategy": "fsdp", "micro_batch_size": 4},
    "zero1": {"strategy": "zero", "zero_stage": 1, "micro_batch_size": 4},
    "zero2": {"strategy": "zero", "zero_stage": 2, "micro_batch_size": 4},
    "zero3": {"strategy": "zero", "zero_stage": 3, "micro_batch_size": 4},
    "pipeline": {"strategy": "pipeline", "pipeline_stages": 2, "microbatches": 2, "micro_batch_size": 8,
                 "pipeline_schedule": "1f1b"},
    "tensor": {"strategy": "tensor", "tensor_parallel": 2, "micro_batch_size": 8},
}
WARMUP = 3

# the loop itself, shared word for word by both sides
SETUP = """
import time, torch, mpnb
from mpnb.models import synthetic_batches, tiny_gpt
_net = tiny_gpt(0)
_trainer = mpnb.prepare(_net, torch.optim.AdamW(_net.parameters(), lr=1e-3), config={config!r})
_batches = list(synthetic_batches(batch_size=8, steps={steps}, seed=0))
for _b in _batches[:{warmup}]:
    _trainer.step(_b)
"""
LOOP = """
for _b in _batches:
    _loss = _trainer.step(_b)
"""

TORCHRUN_SCRIPT = """
import json, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
configs = json.loads(sys.argv[1]); steps = int(sys.argv[2])
out = {{}}
for name, config in configs.items():
    exec({setup!r}.format(config=config, steps=steps, warmup={warmup}))
    dist.barrier(); t0 = time.perf_counter()
    exec({loop!r})
    dist.barrier(); out[name] = (time.perf_counter() - t0) / steps
    del _trainer, _net
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def torchrun_round(names: list[str], steps: int) -> dict[str, float]:
    script = TORCHRUN_SCRIPT.format(setup=SETUP, loop=LOOP, warmup=WARMUP)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", f.name,
             json.dumps({n: CONFIGS[n] for n in names}), str(steps)],
            capture_output=True, text=True, timeout=1200,
        )
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def shell():
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "mpnb")
    return ip


def run_cell(ip, body: str) -> float:
    from IPython.utils.capture import capture_output

    t0 = time.perf_counter()
    with capture_output():
        ip.run_cell_magic("distributed", "--quiet", body)
    return time.perf_counter() - t0


def notebook_round(ip, names: list[str], steps: int) -> dict[str, float]:
    out = {}
    for name in names:
        run_cell(ip, SETUP.format(config=CONFIGS[name], steps=steps, warmup=WARMUP))
        out[name] = run_cell(ip, LOOP) / steps
        run_cell(ip, "del _trainer, _net")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategies", default=",".join(CONFIGS))
    args = parser.parse_args()
    names = args.strategies.split(",")

    import mpnb

    ip = shell()
    mpnb.start(n=2, verbose=False)  # starts the memory monitor too
    try:
        notebook: dict[str, list[float]] = {n: [] for n in names}
        script: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n, t in notebook_round(ip, names, args.steps).items():
                notebook[n].append(t)
            for n, t in torchrun_round(names, args.steps).items():
                script[n].append(t)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        mpnb.stop()

    print(f"step time, tiny GPT ({args.steps} steps x {args.rounds} rounds, 2 CPU ranks, AdamW)")
    print(f"{'strategy':<10} {'%%distributed':>14} {'torchrun':>10} {'ratio':>7}")
    ratios = []
    for n in names:
        nb, tr = statistics.median(notebook[n]), statistics.median(script[n])
        ratios.append(nb / tr)
        print(f"{n:<10} {nb * 1e3:>11.1f} ms {tr * 1e3:>7.1f} ms {nb / tr:>7.3f}")
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"geometric mean ratio {geo:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
