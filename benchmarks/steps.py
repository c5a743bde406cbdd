"""Step time of the same training loop in notebook engines vs a torchrun script, both warm.

For each strategy, a tiny model trains with AdamW on 2 ranks (`--model gpt`: mpnb's tiny GPT on
synthetic batches; `--model llama`: notebook 09's transformers Llama on dict batches of The Devil's
Dictionary, with its own loss), in two worlds that live side by side for the whole run:
- notebook: a real IPython shell with `%load_ext mpnb`, `mpnb.start(n=2)` (memory monitor on at
  its defaults), one `%%distributed` cell that prepares and warms up, then timed `%%distributed`
  cells of STEPS steps;
- baseline: the same code in a script under `torchrun --nproc-per-node 2`, kept alive and driven
  block by block through a command directory, so it is as warm as the engines.

Blocks alternate (notebook, torchrun, torchrun, notebook, ...) and each pair gives one ratio, so a
burst of load on this shared 2-core machine falls on both sides of a pair. Two ratios per strategy:
- engine loop: the loop between two barriers on rank 0, timed exactly like the torchrun side
  (the per-step cost of running inside an engine: monitor thread, engine threads);
- whole cell: the kernel's wall time for the cell divided by STEPS (adds the one-off cost of
  dispatching the cell and collecting its output, which shrinks as cells get longer).
The median over pairs per strategy, and the geometric mean over strategies, are printed;
the target is <= 1.05 for the engine loop.

Usage: python benchmarks/steps.py [--model gpt|llama] [--steps 20] [--pairs 8] [--strategies ddp,fsdp,...]
                                 [--no-monitor]
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
    "pipeline": {
        "strategy": "pipeline",
        "pipeline_stages": 2,
        "microbatches": 2,
        "micro_batch_size": 8,
        "pipeline_schedule": "1f1b",
    },
    "tensor": {"strategy": "tensor", "tensor_parallel": 2, "micro_batch_size": 8},
}
WARMUP = 3

# model -> the code that builds `_net` and its `_batches` (global batches of 8 rows)
MODELS = {
    "gpt": """
from mpnb.models import synthetic_batches, tiny_gpt
_net = tiny_gpt(0)
_batches = list(synthetic_batches(batch_size=8, steps={steps}, seed=0))
""",
    # notebook 09's model and data: dicts with input_ids, attention_mask, labels; the model's own loss
    "llama": """
import transformers
from mpnb.text_data import byte_batches, encode, read_text
torch.manual_seed(0)
_net = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False))
_batches = list(byte_batches(encode(read_text()), batch_size=8, seq_len=64, steps={steps}, seed=0))
""",
}

# the training code, shared word for word by both sides
SETUP = """
import time, torch, mpnb
{model}
_trainer = mpnb.prepare(_net, torch.optim.AdamW(_net.parameters(), lr=1e-3), config={config!r})
for _b in _batches[:{warmup}]:
    _trainer.step(_b)
"""
TIMED_LOOP = """
dist.barrier(); _t0 = time.perf_counter()
for _b in _batches:
    _loss = _trainer.step(_b)
dist.barrier(); _dt = time.perf_counter() - _t0
"""
TEARDOWN = "del _trainer, _net, _batches"

# The torchrun side: rank 0 waits for numbered command files and broadcasts each to rank 1;
# a waiting rank 1 sleeps in gloo's recv, so the idle world costs the notebook side nothing.
TORCHRUN_WORKER = """
import json, os, sys, time
import torch.distributed as dist
from datetime import timedelta
dist.init_process_group("gloo", timeout=timedelta(hours=1))
commands = sys.argv[1]
seq = 0
while True:
    seq += 1
    box = [None]
    if dist.get_rank() == 0:
        path = os.path.join(commands, f"{seq}.json")
        while not os.path.exists(path):
            time.sleep(0.01)
        with open(path) as f:
            box[0] = json.load(f)
    dist.broadcast_object_list(box, src=0)
    command = box[0]
    if command["do"] == "quit":
        break
    exec(command["code"])
    if dist.get_rank() == 0:
        result = {"dt": globals().get("_dt")} if command["do"] == "time" else {}
        with open(os.path.join(commands, f"{seq}.done.tmp"), "w") as f:
            json.dump(result, f)
        os.rename(os.path.join(commands, f"{seq}.done.tmp"), os.path.join(commands, f"{seq}.done"))
dist.destroy_process_group()
"""


class TorchrunWorld:
    """Two warm torchrun workers that run code blocks on request."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="mpnb-steps-")
        self._script = Path(self._dir) / "worker.py"
        self._script.write_text(TORCHRUN_WORKER)
        self._seq = 0
        # a file, not a pipe: DeepSpeed's logging would fill an unread pipe and block the workers
        self._log = open(Path(self._dir) / "torchrun.log", "w+")  # noqa: SIM115 (closed in close())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             str(self._script), self._dir],
            stdout=self._log, stderr=subprocess.STDOUT,
        )

    def _send(self, do: str, code: str) -> None:
        """The next numbered command, written whole before rank 0 can see it."""
        self._seq += 1
        path = Path(self._dir) / f"{self._seq}.json"
        path.with_suffix(".tmp").write_text(json.dumps({"do": do, "code": code}))
        path.with_suffix(".tmp").rename(path)

    def run(self, code: str, do: str = "run", timeout: float = 600) -> dict:
        self._send(do, code)
        done = Path(self._dir) / f"{self._seq}.done"
        deadline = time.monotonic() + timeout
        while not done.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._log.seek(0)
                raise RuntimeError(f"torchrun side failed:\n{self._log.read()[-4000:]}")
            time.sleep(0.005)
        return json.loads(done.read_text())

    def close(self) -> None:
        self._send("quit", "")
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._log.close()


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


def measure(
    ip, world: TorchrunWorld, model: str, name: str, steps: int, pairs: int
) -> dict[str, list[float]]:
    """Per block pair: torchrun, engine-loop and whole-cell seconds per step."""
    import mpnb

    build = MODELS[model].format(steps=steps)
    setup = SETUP.format(model=build, config=CONFIGS[name], warmup=WARMUP)
    run_cell(ip, setup)
    world.run(setup)
    out: dict[str, list[float]] = {"torchrun": [], "loop": [], "cell": []}
    for pair in range(pairs):
        for side in ("notebook", "torchrun") if pair % 2 == 0 else ("torchrun", "notebook"):
            if side == "notebook":
                out["cell"].append(run_cell(ip, TIMED_LOOP) / steps)
                out["loop"].append(mpnb.session().view([0]).pull("_dt", block=True)[0] / steps)
            else:
                out["torchrun"].append(world.run(TIMED_LOOP, do="time")["dt"] / steps)
    run_cell(ip, TEARDOWN)
    world.run(TEARDOWN)
    return out


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=list(MODELS), default="gpt", help="the model to train")
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--pairs", type=int, default=8, help="notebook/torchrun block pairs per strategy")
    parser.add_argument("--strategies", default=",".join(CONFIGS))
    parser.add_argument(
        "--no-monitor", action="store_true", help="stop the memory sampler (isolates its cost)"
    )
    args = parser.parse_args()
    names = args.strategies.split(",")

    import mpnb

    ip = shell()
    mpnb.start(n=2, verbose=False)  # starts the memory monitor too
    if args.no_monitor:
        mpnb.session().view().execute("from mpnb.engine import monitor; monitor.stop()", block=True)
    world = TorchrunWorld()
    results = {}
    try:
        for name in names:
            results[name] = measure(ip, world, args.model, name, args.steps, args.pairs)
            print(f"{name} done", file=sys.stderr, flush=True)
    finally:
        world.close()
        mpnb.stop()

    monitor = "off" if args.no_monitor else "on"
    title = {"gpt": "tiny GPT", "llama": "tiny Llama (transformers, dict batches)"}[args.model]
    print(f"step time, {title}, 2 CPU ranks, AdamW, monitor {monitor}: {args.pairs} block pairs "
          f"of {args.steps} steps per strategy; medians over pairs")
    header = ("strategy", "torchrun", "engine loop", "ratio", "whole cell", "ratio")
    print("{:<10} {:>9} {:>12} {:>6} {:>11} {:>6}".format(*header))
    loop_ratios, cell_ratios = [], []
    for name, r in results.items():
        loop = statistics.median(a / b for a, b in zip(r["loop"], r["torchrun"], strict=True))
        cell = statistics.median(a / b for a, b in zip(r["cell"], r["torchrun"], strict=True))
        loop_ratios.append(loop)
        cell_ratios.append(cell)
        tr, lp, nb = (statistics.median(r[k]) * 1e3 for k in ("torchrun", "loop", "cell"))
        print(f"{name:<10} {tr:>6.1f} ms {lp:>9.1f} ms {loop:>6.3f} {nb:>8.1f} ms {cell:>6.3f}")
    print(f"geometric mean ratio: engine loop {geomean(loop_ratios):.3f} (target <= 1.05), "
          f"whole cell {geomean(cell_ratios):.3f}")


if __name__ == "__main__":
    main()
