"""`%mpnb run script.py args` on a real 2-engine cluster: a torchrun-style script runs on every rank as
torchrun would run it, its own process group included, and the engines are as before afterwards."""

from __future__ import annotations

import ctypes
import textwrap
import threading
import time
from pathlib import Path

import pytest
from IPython.utils.capture import capture_output

from mpnb.execution.output import strip_ansi

pytestmark = pytest.mark.timeout(300)

TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
)
ALL_REDUCE = "%%distributed\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nprint('sum', t.item())\n"


def run(ip, source: str):
    """Run one cell; return (result, stdout + stderr) as the notebook would show them."""
    with capture_output() as cap:
        result = ip.run_cell(source, store_history=True)
    return result, strip_ansi(cap.stdout) + strip_ansi(cap.stderr)


def write(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(source).lstrip())
    return path


def group_works(ip) -> None:
    res, out = run(ip, ALL_REDUCE)
    assert res.success and "[ranks 0,1] sum 3.0" in out, out


def engine_counts(cluster) -> list[int]:
    """Each engine's IPython execution count: it moves whenever the engine ran anything."""
    return cluster.view().apply_sync(lambda: __import__("IPython").get_ipython().execution_count)


@pytest.fixture(scope="module")
def ip(ipython, cluster):
    return ipython


@pytest.fixture
def notebook_dir(tmp_path, monkeypatch) -> Path:
    """The notebook kernel's directory for the test: scripts go here, relative paths resolve here."""
    nb = tmp_path / "nb"
    nb.mkdir()
    monkeypatch.chdir(nb)
    return nb


def test_script_sees_what_torchrun_gives_it_and_leaves_nothing_behind(ip, cluster, notebook_dir, tmp_path):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    write(scripts, "helper_mod.py", "VALUE = 'sibling v1'\n")
    show = write(
        scripts,
        "show.py",
        f"""
        import os, sys
        import helper_mod
        print('name', __name__, 'argv', sys.argv)
        print('file', __file__, 'path0', sys.path[0])
        print('cwd', os.getcwd())
        print('sibling', helper_mod.VALUE)
        env = {{k: os.environ.get(k) for k in {TORCHRUN_VARS!r}}}
        print('env', ' '.join(f'{{k}}={{v}}' for k, v in env.items()))
        script_global = 1
        """,
    )
    res, out = run(ip, "%mpnb run ../scripts/show.py --epochs 3 --keep -x")
    assert res.success, out
    assert "[ranks 0,1] name __main__ argv ['../scripts/show.py', '--epochs', '3', '--keep', '-x']" in out
    assert f"[ranks 0,1] file {show} path0 {scripts}" in out
    assert f"[ranks 0,1] cwd {notebook_dir}" in out
    assert "[ranks 0,1] sibling sibling v1" in out
    env = {}
    for rank in (0, 1):
        line = next(x for x in out.splitlines() if x.startswith(f"[rank {rank}] env "))
        env[rank] = dict(kv.split("=", 1) for kv in line.split(" env ", 1)[1].split())
    for rank in (0, 1):
        assert set(env[rank]) == set(TORCHRUN_VARS) and "None" not in env[rank].values(), env[rank]
        assert env[rank]["RANK"] == env[rank]["LOCAL_RANK"] == env[rank]["ROLE_RANK"] == str(rank)
        assert env[rank]["WORLD_SIZE"] == env[rank]["LOCAL_WORLD_SIZE"] == env[rank]["ROLE_WORLD_SIZE"] == "2"
        assert (env[rank]["GROUP_RANK"], env[rank]["GROUP_WORLD_SIZE"]) == ("0", "1")
        assert env[rank]["ROLE_NAME"] == "default"
        assert env[rank]["TORCHELASTIC_RESTART_COUNT"] == env[rank]["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert int(env[rank]["MASTER_PORT"]) > 0 and env[rank]["MASTER_ADDR"] == "127.0.0.1"
    assert env[0]["TORCHELASTIC_RUN_ID"] == env[1]["TORCHELASTIC_RUN_ID"] != "None"
    assert env[0]["MASTER_PORT"] == env[1]["MASTER_PORT"]
    assert cluster.cell["status"] == "done" and cluster.cell["label"] == "show.py"  # the sidebar's name

    # afterwards: argv, sys.path, cwd, environment, __main__ and the script's modules are as before
    res, out = run(
        ip,
        "%%distributed\nimport os, sys\n"
        "print('after', 'TORCHELASTIC_RUN_ID' in os.environ, os.environ['RANK'] == str(rank), "
        f"{str(scripts)!r} in sys.path, os.getcwd() == {str(notebook_dir)!r}, 'helper_mod' in sys.modules, "
        "'script_global' in globals(), sys.modules['__main__'].__dict__ is globals())\n",
    )
    assert "[ranks 0,1] after False True False False False False True" in out, out
    group_works(ip)

    write(scripts, "helper_mod.py", "VALUE = 'sibling v2'\n")  # edited between two runs: read afresh
    res, out = run(ip, f"import mpnb\nmpnb.run({str(show)!r}, args=['--lr', '1'])")  # the function form
    assert res.success and "[ranks 0,1] sibling sibling v2" in out, out
    assert f"[ranks 0,1] name __main__ argv [{str(show)!r}, '--lr', '1']" in out, out


def test_the_scripts_own_process_group_then_mpnbs_again(ip, notebook_dir):
    write(
        notebook_dir,
        "own_pg.py",
        """
        import torch
        import torch.distributed as dist

        def main():
            dist.init_process_group("gloo")
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            print("script group", dist.get_world_size(), t.item())
            dist.destroy_process_group()
            print("destroyed", dist.is_initialized())

        if __name__ == "__main__":
            main()
        """,
    )
    res, out = run(ip, "%mpnb run own_pg.py")
    assert res.success, out
    assert "[ranks 0,1] script group 2 3.0" in out and "[ranks 0,1] destroyed False" in out, out
    group_works(ip)
    # a script that forms its group and leaves it: mpnb's is formed again all the same
    write(notebook_dir, "leaves_pg.py", "import torch.distributed as dist\ndist.init_process_group('gloo')\n")
    res, out = run(ip, "%mpnb run leaves_pg.py")
    assert res.success, out
    group_works(ip)


def test_a_ddp_model_freed_after_destroy_process_group_does_not_deadlock(ip, notebook_dir):
    """main() returning frees DDP, which joins gloo's threads with the GIL held while one still wants it
    (pytorch/pytorch#56297). Unfixed, 2 runs in 6 hung a rank here; each run below is bounded."""
    write(
        notebook_dir,
        "ddp_end.py",
        """
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        def main():
            dist.init_process_group("gloo")
            model = DDP(torch.nn.Linear(4, 1))
            model(torch.randn(2, 4)).sum().backward()
            out = [torch.zeros(1) for _ in range(2)]
            dist.all_gather(out, torch.ones(1))
            dist.destroy_process_group()

        main()
        """,
    )
    for _ in range(6):
        res, out = run(ip, "%mpnb run --timeout 20 ddp_end.py")
        assert res.success, out
    group_works(ip)


def test_one_off_cost_of_a_run(ip, notebook_dir):
    write(notebook_dir, "empty.py", "pass\n")
    run(ip, "%mpnb run --no-monitor empty.py")  # warm
    t0 = time.monotonic()
    for _ in range(3):
        assert run(ip, "%mpnb run --no-monitor empty.py")[0].success
    script_s = (time.monotonic() - t0) / 3
    t0 = time.monotonic()
    for _ in range(3):
        assert run(ip, "%%distributed --no-monitor\npass\n")[0].success
    cell_s = (time.monotonic() - t0) / 3
    print(f"one-off: %mpnb run of an empty script {script_s:.3f} s, an empty cell {cell_s:.3f} s")
    assert script_s < 3.0


def test_exit_codes_like_python(ip, notebook_dir):
    write(
        notebook_dir,
        "exits.py",
        """
        import sys
        import torch.distributed as dist
        how = sys.argv[1]
        print("before exit")
        if how == "none":
            sys.exit()
        if how == "message":
            sys.exit("needs a GPU")
        if how == "trained":
            dist.init_process_group("gloo")
            dist.destroy_process_group()
        sys.exit(int(how) if how.isdigit() else 0)
        """,
    )
    for how, line in (("none", "6"), ("0", "12")):  # an early exit is a success, said in one line
        res, out = run(ip, f"%mpnb run exits.py {how}")
        assert res.success, out
        code = "" if how == "none" else "0"
        note = f"mpnb: exits.py called sys.exit({code}) at line {line} before forming a "
        assert out.strip().splitlines() == [
            "[ranks 0,1] before exit",
            f"[ranks 0,1] {note}process group, so it did no distributed work.",
        ], out
    res, out = run(ip, "%mpnb run exits.py trained")
    assert res.success and out.strip().splitlines() == ["[ranks 0,1] before exit"], out  # nothing extra
    res, out = run(ip, "%mpnb run exits.py 3")
    assert not res.success and type(res.error_in_exec).__name__ == "CellFailedError"
    assert "[ranks 0,1] ScriptExit: exits.py exited with code 3" in out, out
    assert "---> 12 sys.exit(int(how) if how.isdigit() else 0)" in out  # where the script exited
    res, out = run(ip, "%mpnb run exits.py message")
    assert "[ranks 0,1] ScriptExit: exits.py exited with code 1: needs a GPU" in out, out


def test_traceback_starts_at_the_scripts_own_line(ip, notebook_dir):
    path = write(
        notebook_dir,
        "boom.py",
        """
        def step(rank):
            return 1 / (rank - rank)

        import os
        step(int(os.environ["RANK"]))
        """,
    )
    res, out = run(ip, "%mpnb run boom.py")
    assert not res.success
    assert "[ranks 0,1] ZeroDivisionError: division by zero" in out, out
    assert f"File {path}:5" in out and "----> 5 step(int(os.environ[\"RANK\"]))" in out, out
    assert f"File {path}:2, in step" in out and "----> 2     return 1 / (rank - rank)" in out
    # nothing of mpnb's: no generated line, no runner frames, no note about hidden frames
    for word in ("run_script", "__import__", "script_run", "Cell In[", "skipping hidden"):
        assert word not in out, (word, out)


def test_argparse_rejection_shows_usage_and_the_next_cell_runs(ip, notebook_dir):
    write(
        notebook_dir,
        "train.py",
        """
        import argparse
        parser = argparse.ArgumentParser()
        parser.add_argument("--lr", type=float, required=True)
        args = parser.parse_args()
        print("lr", args.lr)
        """,
    )
    res, out = run(ip, "%mpnb run train.py --epochs 3")
    assert not res.success
    assert "usage: train.py [-h] --lr LR" in out, out
    assert "error: the following arguments are required: --lr" in out
    assert "ScriptExit: train.py exited with code 2" in out
    res, out = run(ip, "%mpnb run train.py --lr 0.5")
    assert res.success and "[ranks 0,1] lr 0.5" in out, out
    group_works(ip)


def test_bad_input_is_refused_before_any_engine_work(ip, cluster, notebook_dir):
    write(notebook_dir, "broken.py", "print('x')\nif True\n    pass\n")
    (notebook_dir / "adir").mkdir()
    write(notebook_dir, "fine.py", "print('must not run')\n")
    before = engine_counts(cluster)
    cases = [
        ("%mpnb run missing.py", "ConfigError: No script at"),
        ("%mpnb run adir", "is a directory"),
        ("%mpnb run broken.py --x", "broken.py:2: SyntaxError: expected ':'"),
        ("%mpnb run --bogus broken.py", "unrecognized arguments"),
        ("%mpnb run --timeout -1 fine.py", "--timeout must be a positive number"),
        ("%mpnb run --output loud fine.py", "--output must be one of"),
        ("%mpnb run", "the following arguments are required: script"),
    ]
    for line, expected in cases:
        res, out = run(ip, line)
        assert not res.success and type(res.error_in_exec).__name__ == "ConfigError", (line, out)
        assert expected in out and "must not run" not in out, (line, out)
    assert engine_counts(cluster) == before  # no engine ran anything


def test_mp_spawn_is_refused_with_the_way_out(ip, notebook_dir):
    write(
        notebook_dir,
        "spawner.py",
        """
        import torch.multiprocessing as mp

        def worker(rank):
            print("worker", rank)

        if __name__ == "__main__":
            mp.spawn(worker, nprocs=2)
        """,
    )
    res, out = run(ip, "%mpnb run spawner.py")
    assert not res.success
    assert "[ranks 0,1] MpnbError: mpnb is the launcher" in out and "rank=int(os.environ['RANK'])" in out, out
    assert "worker 0" not in out and "worker 1" not in out
    group_works(ip)


def interrupt_main_after(seconds: float) -> None:
    main = threading.main_thread().ident

    def later():
        time.sleep(seconds)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(KeyboardInterrupt))

    threading.Thread(target=later, daemon=True).start()


LOOP = """
import time
import torch.distributed as dist
dist.init_process_group("gloo")
print("looping", flush=True)
for _ in range(2000):
    time.sleep(0.05)
"""


def test_stop_button_stops_every_rank_and_mpnbs_group_is_back(ip, cluster, notebook_dir):
    write(notebook_dir, "loop.py", LOOP)
    interrupt_main_after(2.0)
    t0 = time.monotonic()
    res, out = run(ip, "%mpnb run loop.py")
    assert not res.success and time.monotonic() - t0 < 10, out
    assert cluster.cell["status"] == "stopped", cluster.cell
    assert set(cluster.cell["ranks"].values()) == {"stopped"}, cluster.cell
    group_works(ip)


def test_timeout_ends_a_hung_script(ip, cluster, notebook_dir):
    write(notebook_dir, "hang.py", LOOP)
    t0 = time.monotonic()
    res, out = run(ip, "%mpnb run --timeout 2 hang.py")
    assert not res.success and "--timeout 2 s" in out, out
    assert time.monotonic() - t0 < 15
    assert "%mpnb heal" not in out, out  # the ranks left the script together: mpnb's group is whole
    group_works(ip)


def test_keep_leaves_the_scripts_globals_for_the_next_cell(ip, notebook_dir):
    write(
        notebook_dir,
        "model_script.py",
        """
        import pickle
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 2)

        model = Net().fc
        pickle.loads(pickle.dumps(Net()))  # the script's classes pickle as __main__.Net, as under torchrun
        print("built", sum(p.numel() for p in model.parameters()))
        """,
    )
    res, out = run(ip, "%mpnb run model_script.py")
    assert res.success and "[ranks 0,1] built 10" in out, out
    res, out = run(ip, "%%distributed\nprint('model' in globals())\n")
    assert "[ranks 0,1] False" in out, out
    res, out = run(ip, "%mpnb run --keep model_script.py")
    assert res.success, out
    code = "%%distributed\nprint(type(model).__name__, model.weight.shape, __name__, '__file__' in dir())\n"
    res, out = run(ip, code)
    assert "[ranks 0,1] Linear torch.Size([2, 4]) __main__ False" in out, out


def test_one_rank_failing_releases_the_other_from_the_scripts_collective(ip, notebook_dir):
    write(
        notebook_dir,
        "one_fails.py",
        """
        import os
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise ValueError("rank 1 gives up")
        t = torch.ones(1)
        dist.all_reduce(t)  # rank 0 waits here for a peer that has gone
        """,
    )
    t0 = time.monotonic()
    res, out = run(ip, "%mpnb run one_fails.py")
    seconds = time.monotonic() - t0
    assert not res.success and "[rank 1] ValueError: rank 1 gives up" in out, out
    assert "rank 1 failed first" in out and "[rank 0] RuntimeError" in out, out  # the peer, released
    assert seconds < 20, f"{seconds:.1f} s"  # 0.6 s: rank 1 leaving the script ends its group
    assert "%mpnb heal" not in out, out
    group_works(ip)
