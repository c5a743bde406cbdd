"""`%mpnb run` gives the same output as `torchrun --nproc_per_node 2` for unmodified torchrun scripts.

Five scripts in tests/scripts/ (each with argparse arguments and a sibling module it imports), written as
people write them for torchrun: plain collectives, DDP with a DistributedSampler, FSDP2 (meta-device
init, `fully_shard` per block, `to_empty`), tensor parallel (`init_device_mesh` + `parallelize_module`)
and DeepSpeed ZeRO (`deepspeed.initialize` with a config dict). Each runs once under torchrun in a
subprocess and once on the module's 2-engine cluster; every line the script printed must be the same,
line for line, on each rank.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from IPython.utils.capture import capture_output

from mpnb.engine.bootstrap import free_port
from mpnb.execution.output import strip_ansi
from tests.helpers import TORCHRUN_TEARDOWN_ABORT

pytestmark = pytest.mark.timeout(300)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
WORLD = 2

# (script, its arguments (not its defaults, so that argv must reach it), a line rank 1 must print,
#  how mpnb runs it: the `%mpnb run` magic or the `mpnb.run` function)
CASES = [
    ("collectives/collectives.py", ["--size", "3", "--rounds", "2", "--seed", "5"], "rank 1: done", "magic"),
    ("ddp/train_ddp.py", ["--epochs", "2", "--batch-size", "16", "--lr", "0.1"],
     "rank 1: replicas equal True", "magic"),
    ("fsdp2/train_fsdp2.py", ["--steps", "3", "--lr", "0.005"], "rank 1: step 2 loss", "magic"),
    ("tensor_parallel/train_tp.py", ["--steps", "3", "--hidden", "64"], "rank 1: step 2 loss", "function"),
    ("deepspeed_zero/train_ds.py", ["--zero-stage", "1", "--steps", "3"], "rank 1: step 2 loss", "function"),
]

# Lines that are not the script's own, dropped on both sides before comparing. Only these:
# - DeepSpeed's logger records ("[2026-12-03 16:24:37,646] [WARNING] [file.py:213:func] ..."): DeepSpeed
#   logs to stdout, and mpnb's engines route that logger to the engine log unless `--verbose`.
# - "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully": deepspeed.comm print()s it
#   when a process first sets up its backend (each torchrun worker does; an engine may have done it in
#   an earlier run, or at its start).
# torchrun's own banner ("Setting OMP_NUM_THREADS environment variable for each process ...") goes to
# its stderr, not compared, and is not printed at all with OMP_NUM_THREADS set as here.
NOT_THE_SCRIPTS = [
    re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] \[[A-Z]+\] \[[^\]]*\] "),
    re.compile(r"^DeepSpeed \S+ built successfully$"),
]
MPNB_LINE = re.compile(r"^\[rank (\d+)\] ?(.*)$")  # `--output all`: every line labelled with its rank


def own_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.strip() and not any(p.match(line) for p in NOT_THE_SCRIPTS)]


def torchrun_env() -> dict[str, str]:
    """This process's environment (tests/conftest.py set OMP_NUM_THREADS=1, DS_ACCELERATOR=cpu and
    TORCH_EXTENSIONS_DIR, and put the venv's ninja first on PATH, as the engines have them), without
    any rank variables a launcher around pytest might have left."""
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "mpnb" / "torch_extensions"))
    return env


TORCHRUN_ATTEMPTS = 3  # torchrun, not mpnb, is retried after a teardown abort


def run_torchrun(script: Path, args: list[str], log_dir: Path) -> dict[int, list[str]]:
    """Each rank's stdout lines from `torchrun --nproc_per_node 2 script args`.

    The workers' stdout is unbuffered (torchrun's workers write through, and print() writes the text and
    the newline separately), so on one shared pipe two ranks' lines interleave mid-line ("loss 0.56788rank
    0: step 1 ..."). torchrun's own `--redirects 1 --log-dir` writes each rank's stdout to its own file:
    the same lines, each with its true rank."""
    for attempt in range(TORCHRUN_ATTEMPTS):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
            "--master_port", str(free_port()), "--log-dir", str(log_dir / str(attempt)), "--redirects", "1",
            str(script), *args,
        ]
        proc = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=180)
        if proc.returncode == 0 or TORCHRUN_TEARDOWN_ABORT not in proc.stderr:
            break
    log_dir = log_dir / str(attempt)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert own_lines(proc.stdout.splitlines()) == [], proc.stdout  # all the workers' stdout is in the files
    per_rank = {}
    for rank in range(WORLD):
        (path,) = log_dir.glob(f"*/attempt_0/{rank}/stdout.log")
        per_rank[rank] = own_lines(path.read_text().splitlines())
    return per_rank


def run_mpnb(ip, script: Path, args: list[str], via: str) -> dict[int, list[str]]:
    """Each rank's lines from the same script run on the cluster with `--output all`."""
    if via == "magic":
        source = f"%mpnb run --output all {shlex.join([str(script), *args])}"
    else:
        source = f"import mpnb\nmpnb.run({str(script)!r}, args={args!r}, output='all')"
    with capture_output() as cap:
        result = ip.run_cell(source, store_history=True)
    out = strip_ansi(cap.stdout)
    if not result.success:
        ip.run_line_magic("mpnb", "restart")  # fresh engines, so one failed script does not fail the next
    assert result.success, f"{source}\n{out}\n{strip_ansi(cap.stderr)}"
    per_rank: dict[int, list[str]] = {rank: [] for rank in range(WORLD)}
    others = []
    for line in out.splitlines():
        m = MPNB_LINE.match(line)
        if m:
            per_rank[int(m.group(1))].append(m.group(2))
        else:
            others.append(line)
    assert own_lines(others) == [], out  # nothing printed outside a rank's label
    return {rank: own_lines(lines) for rank, lines in per_rank.items()}


@pytest.fixture(scope="module")
def ip(ipython, cluster):
    return ipython


@pytest.mark.parametrize(("script", "args", "last", "via"), CASES, ids=[c[0].split("/")[0] for c in CASES])
def test_script_output_matches_torchrun(ip, tmp_path, script, args, last, via):
    path = SCRIPTS / script
    expected = run_torchrun(path, args, tmp_path / "torchrun")
    for rank, lines in expected.items():
        # every line is the script's own (it prefixes each with its rank), so nothing else slipped through
        assert lines and all(line.startswith(f"rank {rank}: ") for line in lines), lines
    assert expected[1][-1].startswith(last), expected[1]

    got = run_mpnb(ip, path, args, via)
    for rank in range(WORLD):
        assert got[rank] == expected[rank], f"rank {rank}:\nmpnb:\n" + "\n".join(got[rank]) + (
            "\ntorchrun:\n" + "\n".join(expected[rank]))


def test_cluster_usable_after_the_scripts(ip):
    """After five scripts that formed and destroyed their own groups, a plain cell has mpnb's group."""
    with capture_output() as cap:
        result = ip.run_cell(
            "%%distributed\nt = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\n"
            "print('sum', t.item(), dist.get_world_size())\n"
        )
    assert result.success, strip_ansi(cap.stdout)
    assert "[ranks 0,1] sum 3.0 2" in strip_ansi(cap.stdout)
