"""Library chatter goes to the engine's log, not the cell: `--verbose` parsing and `mpnb.engine.quiet`.

The engine-side parts run here in the test process itself (they need no cluster): a real C
compiler's error, a real FutureWarning, a real logger record.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest

from mpnb.cluster import logs
from mpnb.engine import quiet
from mpnb.engine.control import CELL_MARK
from mpnb.errors import ConfigError, NoClusterError
from mpnb.execution.options import CellOptions
from tests.helpers import expect_error

pytestmark = pytest.mark.usefixtures("no_leftover_session")


def test_verbose_and_quiet_exclude_each_other(ipython):
    expect_error(ipython, "%%distributed --verbose --quiet\npass", ConfigError,
                 "Give either --quiet", "or --verbose", "not both")
    with pytest.raises(ConfigError, match="not both"):
        CellOptions(quiet=True, verbose=True).check()
    CellOptions(verbose=True).check()  # alone it is fine


def test_verbose_is_a_flag_of_the_cell_magic(ipython):
    # well-formed: the missing cluster is what stops it, after --verbose was parsed
    expect_error(ipython, "%%distributed --verbose --rank 0\npass", NoClusterError, "%mpnb start")
    expect_error(ipython, "%%distributed --verbose=yes\npass", ConfigError, "%%distributed")


def test_the_engine_reads_verbose_from_the_cells_first_line(monkeypatch):
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    cell = SimpleNamespace(raw_cell=f"{CELL_MARK} --verbose  # all ranks{quiet.VERBOSE_MARK}\nx = 1\n")
    quiet._pre_run_cell(cell)
    assert quiet.verbose()
    quiet._pre_run_cell(SimpleNamespace(raw_cell=f"{CELL_MARK}  # all ranks\nx = 1\n"))
    assert not quiet.verbose()
    quiet._pre_run_cell(SimpleNamespace(raw_cell=f"x = 1  {quiet.VERBOSE_MARK}\n"))  # not an mpnb cell
    assert not quiet.verbose()
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    assert quiet.verbose()


def _log_text() -> str:
    with open(logs.engine_log_path()) as f:
        return f.read()


def test_captured_sends_compiler_prints_warnings_and_records_to_the_log(monkeypatch, capfd):
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    quiet._pre_run_cell(SimpleNamespace(raw_cell="x = 1\n"))
    quiet.install()
    before = len(_log_text()) if os.path.exists(logs.engine_log_path()) else 0
    with quiet.captured():
        # a real linker error, written by a subprocess straight to fd 2
        subprocess.run(["cc", "-x", "c", "-", "-o", os.devnull, "-lmpnb_no_such_lib"],
                       input=b"int main(void){return 0;}", check=False)
        print("DeepSpeed op built successfully")
        warnings.warn("a library's warning", UserWarning, stacklevel=1)
        logging.getLogger("DeepSpeed").warning("a DeepSpeed record")
    out, err = capfd.readouterr()
    assert "mpnb_no_such_lib" not in out + err and "successfully" not in out + err, (out, err)
    assert "a library's warning" not in err and "DeepSpeed record" not in out + err
    text = _log_text()[before:]
    for expected in ("mpnb_no_such_lib", "DeepSpeed op built successfully", "a library's warning",
                     "a DeepSpeed record"):
        assert expected in text, (expected, text)
    print("after")  # fd 1 and 2 are back where they were
    sys.stderr.write("after too\n")
    out, err = capfd.readouterr()
    assert out == "after\n" and err == "after too\n"


def test_deprecations_go_to_the_log_unless_the_cell_is_verbose(monkeypatch):
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    shown: list[str] = []  # what reaches the cell: the showwarning quiet.install_warnings wraps
    monkeypatch.setattr(warnings, "showwarning", lambda message, *rest: shown.append(str(message)))
    quiet.install_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        quiet._pre_run_cell(SimpleNamespace(raw_cell="x = 1\n"))
        warnings.warn("`old_api` is deprecated", FutureWarning, stacklevel=1)
        assert shown == []
        assert "old_api` is deprecated" in _log_text()
        warnings.warn("plain advice", UserWarning, stacklevel=1)  # not a deprecation: still shown
        assert shown == ["plain advice"]
        warnings.warn("FSDP2-wrapped module (FSDPLlamaForCausalLM) returned a view tensor.", UserWarning,
                      stacklevel=1)  # about mpnb's own wrapping of a transformers model: logged
        assert shown == ["plain advice"] and "returned a view tensor" in _log_text()
        quiet._pre_run_cell(SimpleNamespace(raw_cell=f"{CELL_MARK}{quiet.VERBOSE_MARK}\nx = 1\n"))
        for _ in range(3):
            warnings.warn("`other_api` is deprecated", FutureWarning, stacklevel=1)
        assert shown == ["plain advice", "`other_api` is deprecated"]  # shown, once
    quiet._pre_run_cell(SimpleNamespace(raw_cell="x = 1\n"))


def test_the_log_is_private_and_appended_to():
    from mpnb import private_files

    path = logs.engine_log_path()
    logs.write("first line")
    logs.write("second line\n")
    assert private_files.read(path) is not None  # ours, 0600, in our 0700 directory
    assert logs.tail(path, 2).splitlines() == ["first line", "second line"]
    assert os.path.basename(path) == f"engine-{os.getpid()}.log"


def test_a_killed_builds_lock_is_removed_and_a_running_ones_kept(tmp_path, monkeypatch):
    from mpnb.engine import ds_ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    names = [b.NAME for b in ds_ops.op_builders()]
    if not names:
        pytest.skip("DeepSpeed loads no JIT op on this accelerator")
    lock = tmp_path / names[0] / "lock"
    lock.parent.mkdir()
    held = os.open(lock, os.O_CREAT | os.O_EXCL)  # as torch's FileBaton holds it while ninja runs
    try:
        assert ds_ops.lock_holders(str(lock)) == [os.getpid()]
        ds_ops.clear_stale_locks()
        assert lock.exists()  # a load or build is running: wait for it, as torch does
        os.utime(lock, (0, 0))
        ds_ops.clear_stale_locks()
        assert not lock.exists()  # older than any build: its holder is on another host, and dead
    finally:
        os.close(held)
    lock.touch()  # an engine killed while it held the lock: no process has it open
    ds_ops.clear_stale_locks()
    assert not lock.exists()
    assert not ds_ops.is_built(ds_ops.op_builders()[0])  # nothing built in this empty cache


def test_a_lock_on_a_shared_file_system_is_left_to_its_age(tmp_path, monkeypatch):
    """Another host's build holds its lock where this machine's /proc cannot see it."""
    from mpnb.engine import ds_ops

    mounts = tmp_path / "mounts"
    mounts.write_text(f"overlay / overlay rw 0 0\nserver:/home {tmp_path}/home nfs4 rw 0 0\n"
                      f"sshfs#h:/x {tmp_path}/my\\040dir fuse.sshfs rw 0 0\n")
    assert ds_ops.on_network_file_system(str(tmp_path / "home" / "ext" / "lock"), str(mounts))
    assert ds_ops.on_network_file_system(str(tmp_path / "my dir" / "lock"), str(mounts))
    assert not ds_ops.on_network_file_system(str(tmp_path / "homework" / "lock"), str(mounts))
    assert not ds_ops.on_network_file_system(str(tmp_path))  # this machine's own disk

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(ds_ops, "on_network_file_system", lambda path: True)
    names = [b.NAME for b in ds_ops.op_builders()]
    lock = tmp_path / names[0] / "lock"
    lock.parent.mkdir()
    lock.touch()
    ds_ops.clear_stale_locks()
    assert lock.exists()  # no holder here, but one on another host may be building
    os.utime(lock, (0, 0))
    ds_ops.clear_stale_locks()
    assert not lock.exists()


def test_a_built_op_is_built_while_another_engine_holds_its_lock(monkeypatch):
    """Every engine's warm-up loads the op, and each load holds torch's lock while ninja checks the
    build: an engine that found the lock took a built op for unbuilt and skipped it."""
    from mpnb.engine import ds_ops

    monkeypatch.setenv("PATH", os.environ["PATH"])
    ds_ops.use_own_ninja()  # the ninja the Makefile built the ops with
    ds_ops.default_extensions_dir()
    builders = ds_ops.op_builders()
    assert builders, "DeepSpeed's CPU accelerator loads its shm comm op"
    builder = builders[0]
    assert ds_ops.is_built(builder), "`make install` builds it into $TORCH_EXTENSIONS_DIR"
    lock = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], builder.NAME, "lock")
    held = os.open(lock, os.O_CREAT | os.O_EXCL)
    try:
        assert ds_ops.is_built(builder)
    finally:
        os.close(held)
        os.unlink(lock)
