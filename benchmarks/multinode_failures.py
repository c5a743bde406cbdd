"""How fast a failure across hosts ends the cell, and how fast `heal` gets the world back.

Two hosts are simulated for real (network namespaces joined by a bridge, an sshd on each:
`tests/cluster/simulated_hosts.py`; needs root); `mpnb.start(ssh=...)` starts 2 ranks on each
with ipyparallel's SSH launcher. Measured, each from a fresh session:

- a failure: rank 0 (host A) raises while ranks 1-3 wait in an all_reduce, ranks 2 and 3 on
  host B, which only the ranks that finished can release. The time is from the raise (rank 0's
  clock: the simulated hosts share this machine's) to the end of the `%%distributed` cell in an
  IPython shell, error shown. The first failure of a session is its own row: it used to pay
  one-off costs (formatting the first traceback on every engine and in the kernel);
- `%mpnb heal` after each failure (the live group rebuilt on the same engines);
- SIGKILL of rank 3 (host B) while the others sleep: from the kill to the cell's end.

The same failure on one host (4 local ranks) is the baseline, run in the same process.
Targets (issue 20, item 5): failure <= 2 s, heal <= 1 s, kill reported <= 2 s.

Usage: python benchmarks/multinode_failures.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from IPython.testing.globalipapp import start_ipython

import mpnb
from tests.cluster.simulated_hosts import simulated_hosts, skip_reason
from tests.helpers import run

FAIL = """%%distributed --no-monitor
import time
t = torch.ones(1)
if rank == 0:
    time.sleep(0.5)
    raise ValueError(f"bad batch at {time.time()!r}")
dist.all_reduce(t)
"""
KILL = """%%distributed --no-monitor
import os, time
if rank == 3:
    print(f"killed at {time.time()!r}", flush=True)
    time.sleep(0.3)  # the line reaches the notebook before the engine goes
    os.kill(os.getpid(), 9)
time.sleep(30)
"""


def failed(ip, code: str) -> tuple[float, str, str]:
    """Run a cell that must fail: (when it ended, its error's text, its output)."""
    result, out = run(ip, code)
    ended = time.time()
    if type(result.error_in_exec).__name__ != "CellFailedError":
        raise SystemExit(f"the cell did not fail as it should:\n{out[-2000:]}")
    return ended, str(result.error_in_exec), out


def failure_seconds(ip) -> float:
    """From rank 0's raise to the cell's end, in seconds."""
    ended, error, _ = failed(ip, FAIL)
    return ended - float(re.search(r"bad batch at ([0-9.]+)", error).group(1))


def heal_seconds(ip) -> float:
    t0 = time.perf_counter()
    result, out = run(ip, "%mpnb heal")
    if not result.success:
        raise SystemExit(f"heal failed:\n{out[-2000:]}")
    return time.perf_counter() - t0


def kill_seconds(ip) -> float:
    """From rank 3's SIGKILL (0.3 s after it printed the time) to the cell's end."""
    ended, _, out = failed(ip, KILL)
    return ended - (float(re.search(r"killed at ([0-9.]+)", out).group(1)) + 0.3)


def failures(ip, rounds: int, into: dict[str, list[float]]) -> None:
    for i in range(rounds + 1):
        into.setdefault("first failure" if i == 0 else "later failures", []).append(failure_seconds(ip))
        into.setdefault("heal", []).append(heal_seconds(ip))


@contextlib.contextmanager
def warm_session(**start: Any) -> Iterator[None]:
    """`mpnb.start(**start)`, warmed up before anything is timed, stopped afterwards."""
    session = mpnb.start(verbose=False, **start)
    try:
        session.wait_until_warm()
        yield
    finally:
        mpnb.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="failures after the first, each healed")
    parser.add_argument("--sessions", type=int, default=2, help="fresh sessions (each has a first failure)")
    args = parser.parse_args()
    if skip_reason(sshd=True):
        raise SystemExit(f"cannot simulate hosts here: {skip_reason(sshd=True)}")
    ip = start_ipython()
    ip.run_line_magic("load_ext", "mpnb")
    across: dict[str, list[float]] = {}
    one_host: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, \
            simulated_hosts(Path(tmp), engines_per_host=0, sshd=True) as hosts:
        spec = ",".join(f"root@{a}:2" for a in hosts.addresses.values())
        for s in range(args.sessions):
            with warm_session(ssh=spec, ssh_args=hosts.ssh_args):
                failures(ip, args.rounds, across)
                across.setdefault("kill reported", []).append(kill_seconds(ip))
            with warm_session(n=4):
                failures(ip, args.rounds, one_host)
            print(f"session {s + 1}: " + "; ".join(
                f"{k} {' '.join(f'{v:.2f}' for v in vals)}" for k, vals in across.items()), flush=True)

    targets = {"first failure": 2.0, "later failures": 2.0, "heal": 1.0, "kill reported": 2.0}
    print("\n4 ranks, 2 per host (gloo), seconds: median [min-max]; one host = 4 local ranks, same process")
    print(f"{'':>16} {'2 hosts':>20} {'one host':>20} {'ratio':>6} {'target':>7}")
    for key, target in targets.items():
        a = across[key]
        row = f"{key:>16} {statistics.median(a):>7.2f} [{min(a):.2f}-{max(a):.2f}]"
        b = one_host.get(key)
        if b:
            row += f" {statistics.median(b):>7.2f} [{min(b):.2f}-{max(b):.2f}]"
            row += f" {statistics.median(a) / statistics.median(b):>6.2f}"
        else:
            row += f" {'':>20} {'':>6}"
        verdict = "met" if max(a) <= target else "NOT met"
        print(row + f" {'<= ' + str(target):>7}  {verdict} (worst {max(a):.2f})")


if __name__ == "__main__":
    main()
