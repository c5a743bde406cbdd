"""`%mpnb run` / `mpnb.run` without a cluster: the magic's arguments, every check that runs before any
engine work, the generated engine line, and the engine runner's bookkeeping (exit codes, torchrun's
environment, what is put back after a run) on this process."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

import mpnb
from mpnb.engine import script_run
from mpnb.errors import ConfigError, MpnbError, NoClusterError
from mpnb.execution import script
from mpnb.magics import MPNB_USAGE, _build_parsers


@pytest.fixture
def run_parser():
    return _build_parsers()["run"]


# ----------------------------------------------------------------------------- the magic's arguments


def test_everything_after_the_script_goes_to_it_verbatim(run_parser) -> None:
    a = run_parser.parse_args(["--keep", "--timeout", "5", "train.py", "--keep", "--timeout", "9", "-h", "x"])
    assert a.keep and a.timeout == "5" and a.script == "train.py"
    assert a.args == ["--keep", "--timeout", "9", "-h", "x"]
    a = run_parser.parse_args(["train.py"])
    assert (a.script, a.args, a.keep, a.no_monitor, a.output) == ("train.py", [], False, False, "grouped")
    a = run_parser.parse_args(["--no-monitor", "--quiet", "--output", "rank0", "t.py", "--lr=0.1"])
    assert a.no_monitor and a.quiet and a.output == "rank0" and a.args == ["--lr=0.1"]


def test_bad_mpnb_options_are_config_errors_with_usage(run_parser) -> None:
    with pytest.raises(ConfigError, match=r"%mpnb run: the following arguments are required: script.*Usage"):
        run_parser.parse_args([])
    with pytest.raises(ConfigError, match=r"unrecognized arguments: --bogus|--bogus"):
        run_parser.parse_args(["--bogus", "t.py"])


def test_usage_and_docstring_name_run() -> None:
    from mpnb.magics import MpnbMagics

    line = next(x for x in MPNB_USAGE.splitlines() if x.startswith("%mpnb run"))
    assert line.strip() in MpnbMagics.mpnb.__doc__
    assert "--keep" in line and "like IPython's %run" in MPNB_USAGE
    assert "mpnb.run" in dir(mpnb) or "run" in dir(mpnb)


# ----------------------------------------------------------------------------- checks before engine work


def test_missing_file_directory_and_syntax_error_are_refused_without_a_cluster(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    mpnb.stop()  # no cluster: each error below comes before the cluster is even looked for
    with pytest.raises(ConfigError, match=r"No script at .*nope\.py .*notebook's directory is"):
        mpnb.run("nope.py")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text("pass\n")
    with pytest.raises(ConfigError, match=r"pkg is a directory \(it holds train.py\).*pkg/train.py"):
        mpnb.run("pkg")
    (tmp_path / "broken.py").write_text("import os\n\ndef f(:\n    pass\n")
    with pytest.raises(ConfigError, match=r"(?s)broken.py:3: SyntaxError: .*def f\(:.*nothing ran"):
        mpnb.run("broken.py")
    (tmp_path / "ok.py").write_text("print('hi')\n")
    with pytest.raises(ConfigError, match=r"list of strings, not one string: e.g. args=\['--epochs', '3'\]"):
        mpnb.run("ok.py", "--epochs 3")
    with pytest.raises(ConfigError, match=r"3 is a int"):
        mpnb.run("ok.py", ["--epochs", 3])
    with pytest.raises(ConfigError, match="--output must be one of"):
        mpnb.run("ok.py", output="loud")
    with pytest.raises(NoClusterError):  # a good script and arguments: now the cluster is needed
        mpnb.run("ok.py", ["--epochs", "3"])


def test_script_paths_resolve_against_the_notebooks_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("pass\n")
    s = script.check_script("t.py")
    assert s == script.Script(str(tmp_path / "t.py"), "t.py", "t.py")
    assert script.check_script(tmp_path / "t.py").path == str(tmp_path / "t.py")


def test_only_every_rank_is_accepted() -> None:
    script.check_all_ranks(None, 2)
    script.check_all_ranks([1, 0], 2)
    script.check_all_ranks("0-1", 2)
    with pytest.raises(ConfigError, match=r"runs on every rank \(its process group needs all 2\)"):
        script.check_all_ranks([0], 2)
    with pytest.raises(ConfigError, match="runs on every rank"):
        script.check_all_ranks(1, 2)


# ----------------------------------------------------------------------------- the generated cell


def test_engine_line_is_one_python_line_whatever_the_arguments_hold() -> None:
    s = script.Script("/tmp/we ird\n'\"\u2028.py", "we ird.py", "we ird.py")
    argv = ["a\nb", "--x=\"'", "\x85", "é"]
    line = script.engine_line(s, argv, "/home/u/notebooks", True, run_id="mpnb-1")
    assert len(line.splitlines()) == 1
    call = ast.parse(line).body[0].value
    assert [ast.literal_eval(a) for a in call.args] == [s.path, argv, "/home/u/notebooks", True]
    keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert keywords == {"argv0": "we ird.py", "run_id": "mpnb-1"}
    magic = script.magic_line(s, argv)
    assert len(magic.splitlines()) == 1 and magic.startswith("run we ird.py a?b")


def test_the_generated_frame_and_hidden_runner_frames_leave_the_traceback() -> None:
    tb = [
        "\x1b[31m---------------------------------------------------------------------------\x1b[39m",
        "\x1b[31mZeroDivisionError\x1b[39m     Traceback (most recent call last)",
        "\x1b[36mCell\x1b[39m\x1b[36m \x1b[39m\x1b[32mIn[3]\x1b[39m, line 2\n"
        f"----> 2 __import__('{script.RUNNER}', fromlist=['run_script']).run_script('/t.py')\n",
        "    [... skipping hidden 1 frame]\n",
        "File \x1b[32m/t.py:4\x1b[39m\n----> 4 1/0\n",
        "File \x1b[32m/venv/site-packages/mpnb/engine/script_run.py:270\x1b[39m, in refused\n"
        "----> 270 raise\n",
        "\x1b[31mZeroDivisionError\x1b[39m: division by zero",
    ]
    kept = script.without_runner(tb)
    assert kept == [tb[0], tb[1], tb[4], tb[6]]
    assert script.without_runner(kept) == kept  # a script's own frames are never dropped


# ----------------------------------------------------------------------------- the engine runner


@pytest.mark.parametrize(
    ("code", "failure"),
    [
        (None, None),
        (0, None),
        (False, None),
        (2, "t.py exited with code 2"),
        (True, "t.py exited with code 1"),
        ("needs a GPU", "t.py exited with code 1: needs a GPU"),
    ],
)
def test_exit_codes_as_python_reads_them(code, failure) -> None:
    assert script_run.exit_failure(code, "t.py") == failure


def test_torchrun_env_has_every_variable_torchruns_agent_sets() -> None:
    import torch.distributed.elastic.agent.server.local_elastic_agent as agent

    source = Path(agent.__file__).read_text()
    block = source[source.index("worker_env = {"):]
    block = block[: block.index("}")]
    # LOCAL_RANK is set beside the block, by _set_local_rank_env
    torchrun_keys = set(re.findall(r'"([A-Z_]+)":', block)) | {"LOCAL_RANK"}
    assert len(torchrun_keys) >= 14
    env = script_run.torchrun_env("run-1")
    assert torchrun_keys <= set(env), torchrun_keys - set(env)
    assert env["ROLE_NAME"] == "default" and env["TORCHELASTIC_RUN_ID"] == "run-1"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # rank 0 serves the store: nobody to join
    assert all(isinstance(v, str) for v in env.values())


def test_own_modules_are_the_scripts_not_installed_ones(tmp_path) -> None:
    (tmp_path / "helper_mod_xyz.py").write_text("X = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import helper_mod_xyz  # noqa: F401

        names = {"helper_mod_xyz", "json", "pytest", "mpnb.errors"}
        assert script_run.own_modules(str(tmp_path), names) == ["helper_mod_xyz"]
        # a script at the root of a tree that holds the interpreter's install: its libraries stay
        assert script_run.own_modules("/", {"json", "pytest"}) == []
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("helper_mod_xyz", None)


def test_mp_spawn_is_refused_only_during_the_run() -> None:
    import torch.multiprocessing as mp
    from torch.multiprocessing import spawn as spawn_module  # the function: the module is in sys.modules

    module = sys.modules["torch.multiprocessing.spawn"]
    before = (mp.spawn, mp.start_processes, module.spawn, module.start_processes)
    assert spawn_module is before[0]
    with script_run.spawn_refused():
        for call in (mp.spawn, mp.start_processes, module.spawn):
            with pytest.raises(MpnbError, match=r"mpnb is the launcher: .*rank=int\(os.environ\['RANK'\]\)"):
                call(print, nprocs=2)
    assert (mp.spawn, mp.start_processes, module.spawn, module.start_processes) == before
