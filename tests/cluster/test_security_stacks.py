"""Stack dumps on a real 2-engine cluster: a private 0700 directory, fresh 0600 files, planted symlinks and
other users' files never followed or read, nothing left after a restart or a stop.

The tests share one cluster and run in file order: the first needs engines that have not run a
`%%distributed` cell yet (their dump files do not exist), the last restarts and then stops it.
"""

from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path

import pytest
from IPython.utils.capture import capture_output

from mpnb.errors import RankError
from mpnb.execution.output import strip_ansi
from tests.helpers import own_cluster

pytestmark = pytest.mark.timeout(300)

PG_TIMEOUT_S = 10
OTHER_UID = 65534  # nobody: a file "another user" planted (chown needs root)
# rank 0 waits in all_reduce for rank 1, which skipped it: at --timeout the kernel dumps rank 0's stack
HANG = "%%distributed --timeout 3 --no-monitor\nt = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)"
# What faulthandler would write for a rank in plain Python: if read, the notebook would show the frame.
PLANTED = (
    "Current thread 0x00007f0000000000 (most recent call first):\n"
    '  File "/planted/evil.py", line 666 in planted_frame\n'
    '  File "/x/IPython/core/interactiveshell.py", line 3577 in run_code\n'
    '  File "/x/ipykernel/ipkernel.py", line 449 in do_execute\n'
)


def run(ip, source: str):
    """Run one cell; return (result, stdout+stderr as shown, seconds)."""
    t0 = time.monotonic()
    with capture_output() as cap:
        result = ip.run_cell(source, store_history=True)
    return result, strip_ansi(cap.stdout + cap.stderr), time.monotonic() - t0


def old_path(pid: int) -> str:
    """Where engines wrote their stacks before: a name anyone could predict in the shared /tmp."""
    return os.path.join(tempfile.gettempdir(), f"mpnb-stacks-{pid}.txt")


def assert_next_cell_works(ip) -> None:
    code = "%%distributed --no-monitor\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', int(t.item()))\n"
    res, out, _ = run(ip, code)
    assert res.success and "sum 2" in out, out


@pytest.fixture(scope="module")
def sess():
    with own_cluster(timeout=PG_TIMEOUT_S) as s:
        yield s


@pytest.fixture(scope="module")
def ip(ipython, sess):
    return ipython


@pytest.fixture
def victims(tmp_path):
    """Files a planted symlink points at; each must keep its text."""
    made: list[tuple[str, str]] = []

    def make(name: str, text: str = "keep me\n") -> str:
        path = tmp_path / name
        path.write_text(text)
        path.chmod(0o644)
        made.append((str(path), text))
        return str(path)

    yield make
    for path, text in made:
        assert Path(path).read_text() == text, f"{path} was written through a planted symlink"


def test_planted_symlinks_are_never_followed_and_dumps_are_private(ip, sess, victims):
    for info in sess.ranks:  # checked before planting anything, so a failure here leaves nothing behind
        assert info.stacks and not os.path.lexists(info.stacks), "no %%distributed cell has run yet"
    planted = []
    for info in sess.ranks:
        for path in (info.stacks, old_path(info.pid)):
            if os.path.lexists(path):
                os.unlink(path)
            os.symlink(victims(f"victim-{len(planted)}.txt"), path)
            planted.append(path)
    try:
        res, out, seconds = run(ip, HANG)
        assert not res.success and seconds < 9, out
        # the dump was still read back: rank 0's engine made a fresh file instead of the symlink
        stack = out.split("[rank 0]\n", 1)[1]
        assert "Cell In[" in stack and "line 4" in stack and "torch/distributed" in stack, out
        for info in sess.ranks:
            home = os.path.dirname(info.stacks)
            st_dir, st = os.lstat(home), os.lstat(info.stacks)
            assert stat.S_ISDIR(st_dir.st_mode) and stat.S_IMODE(st_dir.st_mode) == 0o700
            assert st_dir.st_uid == os.geteuid() and st.st_uid == os.geteuid()
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
            assert os.path.islink(old_path(info.pid))  # the old name is not touched at all
    finally:
        for path in planted:
            if os.path.islink(path):
                os.unlink(path)
    run(ip, "%mpnb heal")
    assert_next_cell_works(ip)


@pytest.mark.skipif(os.geteuid() != 0, reason="a file owned by another user needs chown (root)")
def test_planted_stack_text_is_never_read(ip, sess, victims):
    # rank 0 waits in all_reduce, rank 1 sleeps: at the timeout both stacks are dumped and read back
    code = HANG.replace("--no-monitor\n", "--no-monitor\nimport time\n") + "\nelse:\n    time.sleep(6)"
    rank0, rank1 = sess.ranks
    aside = [info.stacks for info in sess.ranks if os.path.isfile(info.stacks)]
    for path in aside:  # the engines keep writing to their files (open fds); put them back after
        os.rename(path, path + ".aside")
    planted = []
    for path in (rank0.stacks, old_path(rank0.pid)):  # another user's regular file, 0600
        if os.path.lexists(path):
            os.unlink(path)
        with open(path, "w") as f:
            f.write(PLANTED)
        os.chmod(path, 0o600)
        os.chown(path, OTHER_UID, OTHER_UID)
        planted.append(path)
    for path in (rank1.stacks, old_path(rank1.pid)):  # a symlink to text the planter wrote
        if os.path.lexists(path):
            os.unlink(path)
        os.symlink(victims("theirs-stack.txt", PLANTED), path)
        planted.append(path)
    try:
        res, out, _ = run(ip, code)
        assert isinstance(res.error_in_exec, RankError), out  # the cell ends as usual, without those stacks
        assert "planted_frame" not in out and "evil.py" not in out, out
    finally:
        for path in planted:
            if os.path.lexists(path):
                os.unlink(path)
        for path in aside:
            os.rename(path + ".aside", path)
    run(ip, "%mpnb heal")
    assert_next_cell_works(ip)


def test_no_dump_file_remains_after_restart_and_stop(ip, sess):
    run(ip, HANG)  # the engines have their dump files now
    before = [info.stacks for info in sess.ranks]
    assert all(os.path.isfile(path) for path in before)
    res, out, _ = run(ip, "%mpnb restart")
    assert res.success, out
    assert not any(os.path.lexists(path) for path in before), "the old engines' files stay after a restart"
    run(ip, HANG)
    after = [info.stacks for info in sess.ranks]
    assert all(os.path.isfile(path) for path in after)
    res, out, _ = run(ip, "%mpnb stop")
    assert res.success, out
    assert not any(os.path.lexists(path) for path in after), "dump files stay after %mpnb stop"
    for info in sess.ranks:
        assert not os.path.lexists(old_path(info.pid))
