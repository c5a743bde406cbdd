"""all_reduce between two hosts: mpnb cells against torchrun started over the same SSH hosts.

Two hosts are simulated for real (network namespaces joined by a bridge, an sshd on each:
`tests/cluster/simulated_hosts.py`; needs root). Both sides run the same ranks per host (2, or
`--ranks-per-host`), gloo, one thread each:

- mpnb: `mpnb.start(ssh=...)` once (ipyparallel's SSH launcher), then each round is one
  `%%distributed` cell (`run_cell`) that times the all_reduces on every rank, once as a user gets
  it and once with the memory monitor detached ("mpnb, no monitor": its 10 Hz sampler is the one
  thing mpnb adds to a rank while a cell runs);
- torchrun: each round, `ssh HOST python -m torch.distributed.run --nnodes 2 --node_rank I
  --nproc_per_node N ...` on both hosts at once, running the same timing code as a script.

Each rank times ITERS all_reduces of a float32 tensor of each size between two barriers (after a
warm-up one); a round's time is the slowest rank's. Rounds alternate (torchrun, mpnb, mpnb,
torchrun, ...) so all see the same load. Printed per size: the median seconds per all_reduce of
each, and the median of the rounds' ratios to torchrun (target <= 1.05): the collective is the
same gloo code either way, so what this measures is whether mpnb's engines (their threads, the
memory sampler, the comm counter, keepalive on the group's connections) slow the network path down.

With 2 ranks per host, 4 ranks share this machine's 2 cores: any thread an engine runs besides the
collective (ipyparallel's heartbeat, the sampler) takes time from a rank. `--ranks-per-host 1` gives
each rank a core of its own, which is what a real cluster has.

Usage: python benchmarks/multinode.py [--rounds 5] [--sizes-mb 1,16,256] [--ranks-per-host 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mpnb
from mpnb.execution.cell_run import run_cell
from mpnb.execution.options import CellOptions
from mpnb.monitoring import channel
from tests.cluster.simulated_hosts import simulated_hosts, skip_reason

ITERS = {1: 50, 16: 10, 256: 3}  # all_reduces timed per size (MB), after one warm-up

MEASURE = '''
import time
import torch
import torch.distributed as dist


def measure(sizes_mb, iters):
    """Seconds per all_reduce on this rank, per size in MB."""
    torch.set_num_threads(1)
    out = {}
    for mb in sizes_mb:
        t = torch.ones(mb * (1 << 20) // 4)
        dist.all_reduce(t)  # warm-up: gloo's buffers for this size
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters[mb]):
            dist.all_reduce(t)
        dist.barrier()
        out[mb] = (time.perf_counter() - t0) / iters[mb]
        del t
    return out
'''

SCRIPT = MEASURE + '''
import json, sys
dist.init_process_group("gloo")
sizes, report = json.loads(sys.argv[1]), sys.argv[3]
mine = measure(sizes, {int(k): v for k, v in json.loads(sys.argv[2]).items()})
every = [None] * dist.get_world_size()
dist.all_gather_object(every, mine)
if dist.get_rank() == 0:
    with open(report, "w") as f:
        json.dump({mb: max(r[mb] for r in every) for mb in sizes}, f)
dist.destroy_process_group()
'''


def torchrun_round(hosts, sizes: list[int], workdir: Path, per_host: int) -> dict[int, float]:
    script, report = workdir / "allreduce.py", workdir / "report.json"
    script.write_text(SCRIPT)
    report.unlink(missing_ok=True)
    addresses = list(hosts.addresses.values())
    port = random.randint(20000, 40000)
    procs = []
    for node, address in enumerate(addresses):
        command = (f"OMP_NUM_THREADS=1 {sys.executable} -m torch.distributed.run --nnodes {len(addresses)} "
                   f"--node_rank {node} --nproc_per_node {per_host} --master_addr {addresses[0]} "
                   f"--master_port {port} {script} '{json.dumps(sizes)}' '{json.dumps(ITERS)}' {report}")
        ssh = ["ssh", "-o", "BatchMode=yes", *hosts.ssh_args, f"root@{address}", command]
        procs.append(subprocess.Popen(ssh, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        if proc.returncode:
            raise SystemExit(f"torchrun over ssh failed ({proc.returncode}):\n{err[-2000:]}")
    return {int(k): v for k, v in json.loads(report.read_text()).items()}


def mpnb_round(session, sizes: list[int], monitor: bool = True) -> dict[int, float]:
    if not monitor:
        channel.detach(session, timeout=2.0)
    try:
        return _timed_cell(session, sizes)
    finally:
        if not monitor:
            channel.attach(session)


def _timed_cell(session, sizes: list[int]) -> dict[int, float]:
    code = f"{MEASURE}\ntimes = measure({sizes!r}, {ITERS!r})"
    run_cell(session, code, CellOptions(quiet=True, monitor=False))
    every = session.view().pull("times", block=True)
    return {mb: max(r[mb] for r in every) for mb in sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes-mb", default="1,16,256")
    parser.add_argument("--ranks-per-host", type=int, default=2)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    if skip_reason(sshd=True):
        raise SystemExit(f"cannot simulate hosts here: {skip_reason(sshd=True)}")
    sides = ("torchrun", "mpnb", "mpnb, no monitor")
    times: dict[str, dict[int, list[float]]] = {side: {s: [] for s in sizes} for side in sides}
    with tempfile.TemporaryDirectory() as tmp, \
            simulated_hosts(Path(tmp), engines_per_host=0, sshd=True) as hosts:
        spec = ",".join(f"root@{a}:{args.ranks_per_host}" for a in hosts.addresses.values())
        session = mpnb.start(ssh=spec, ssh_args=hosts.ssh_args, verbose=False)
        try:
            mpnb_round(session, [1])  # the first cell's one-off costs stay out of the rounds
            for i in range(args.rounds):
                for side in sides if i % 2 == 0 else sides[::-1]:
                    if side == "torchrun":
                        got = torchrun_round(hosts, sizes, Path(tmp), args.ranks_per_host)
                    else:
                        got = mpnb_round(session, sizes, monitor=side == "mpnb")
                    for mb in sizes:
                        times[side][mb].append(got[mb])
                last = {side: {mb: v[-1] * 1e3 for mb, v in per.items()} for side, per in times.items()}
                print(f"round {i + 1}: " + "; ".join(
                    f"{mb} MB " + " / ".join(f"{side} {last[side][mb]:.1f} ms" for side in sides)
                    for mb in sizes), flush=True)
        finally:
            mpnb.stop()
    world = args.ranks_per_host * len(hosts.addresses)
    print(f"\nall_reduce, {world} ranks on 2 hosts (gloo): median time per op over the rounds, and the")
    print("median of each round's ratio to torchrun (they ran back to back, so they saw the same load)")
    header = f"{'size':>7} {'torchrun':>9} {'mpnb':>9} {'ratio':>6} {'no monitor':>11} {'ratio':>6}"
    print(header + "  (target <= 1.05)")
    for mb in sizes:
        row = [f"{mb:>5} MB", f"{statistics.median(times['torchrun'][mb]) * 1e3:>6.1f} ms"]
        for side in sides[1:]:
            pairs = zip(times[side][mb], times["torchrun"][mb], strict=True)
            width = 6 if side == "mpnb" else 8
            row += [f"{statistics.median(times[side][mb]) * 1e3:>{width}.1f} ms",
                    f"{statistics.median(a / b for a, b in pairs):>6.3f}"]
        print(" ".join(row))


if __name__ == "__main__":
    main()
