"""The private directory and files behind stack dumps: only our own 0700 directory and 0600 files are
created, read or removed; symlinks and other users' files are never followed (real files, no cluster)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from mpnb import private_files

as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
OTHER_UID = 65534  # nobody


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """A fresh temp root standing in for /tmp (no XDG_RUNTIME_DIR)."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_the_directory_is_made_ours_and_0700_under_tmp(tmp):
    found = private_files.find_private_dir()
    assert found == tmp / f"mpnb-{os.geteuid()}"
    assert mode(found) == 0o700 and os.lstat(found).st_uid == os.geteuid()
    assert private_files.find_private_dir() == found  # an existing good one is reused


def test_xdg_runtime_dir_is_used_when_it_is_ours_and_private(tmp, monkeypatch):
    runtime = tmp / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert private_files.find_private_dir() == runtime / "mpnb"
    runtime.chmod(0o755)  # open to others: not trusted, /tmp/mpnb-<uid> instead
    assert private_files.find_private_dir() == tmp / f"mpnb-{os.geteuid()}"


def test_our_directory_with_a_loose_mode_is_tightened(tmp):
    path = tmp / f"mpnb-{os.geteuid()}"
    path.mkdir()
    path.chmod(0o777)
    assert private_files.find_private_dir() == path and mode(path) == 0o700


def test_a_symlink_at_the_name_is_never_followed(tmp):
    target = tmp / "victim"
    target.mkdir(mode=0o755)
    (tmp / f"mpnb-{os.geteuid()}").symlink_to(target)
    found = private_files.find_private_dir()
    assert found.parent == tmp and found.name.startswith(f"mpnb-{os.geteuid()}-") and mode(found) == 0o700
    assert mode(target) == 0o755 and not any(target.iterdir())


@as_root
def test_a_directory_another_user_owns_is_never_used(tmp):
    squatted = tmp / f"mpnb-{os.geteuid()}"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, OTHER_UID, OTHER_UID)
    found = private_files.find_private_dir()
    assert found != squatted and os.lstat(found).st_uid == os.geteuid() and mode(found) == 0o700


def test_create_makes_a_fresh_0600_file_and_replaces_a_planted_symlink(tmp):
    home = private_files.find_private_dir()
    victim = tmp / "victim.txt"
    victim.write_text("keep me")
    path = home / "stacks-1.txt"
    path.symlink_to(victim)
    fd = private_files.create(path)
    try:
        os.write(fd, b"dump")
    finally:
        os.close(fd)
    assert victim.read_text() == "keep me"
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and path.read_text() == "dump"


def test_create_refuses_a_directory_open_to_others(tmp):
    shared = tmp / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(private_files.UnsafePathError, match="open to other users"):
        private_files.create(shared / "stacks-1.txt")
    assert not (shared / "stacks-1.txt").exists()


def test_read_only_returns_our_own_private_file(tmp):
    home = private_files.find_private_dir()
    ours = home / "stacks-2.txt"
    os.close(private_files.create(ours))
    ours.write_text("Current thread (most recent call first)")
    assert private_files.read(ours) == "Current thread (most recent call first)"
    planted = tmp / "planted.txt"
    planted.write_text("planted")
    link = home / "stacks-3.txt"
    link.symlink_to(planted)
    assert private_files.read(link) is None  # a symlink is not followed
    loose = home / "stacks-4.txt"
    loose.write_text("loose")
    loose.chmod(0o644)
    assert private_files.read(loose) is None  # readable or writable by others: not trusted
    outside = tmp / "shared"
    outside.mkdir(mode=0o777)
    outside.chmod(0o777)
    (outside / "stacks-5.txt").write_text("x")
    (outside / "stacks-5.txt").chmod(0o600)
    assert private_files.read(outside / "stacks-5.txt") is None  # not in a private directory
    assert private_files.read(home / "missing.txt") is None


def test_read_from_end_gives_a_long_logs_last_bytes(tmp):
    log = private_files.find_private_dir() / "engine-1.log"
    os.close(private_files.create(log))
    log.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert private_files.read(log, limit=64).startswith("line 0\n")
    assert private_files.read(log, limit=64, from_end=True).endswith("line 99999\n")


@as_root
def test_read_and_remove_skip_a_file_another_user_owns(tmp):
    home = private_files.find_private_dir()
    theirs = home / "stacks-6.txt"
    theirs.write_text("Current thread (most recent call first)")
    theirs.chmod(0o600)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    assert private_files.read(theirs) is None
    assert not private_files.remove(theirs) and theirs.exists()


def test_remove_takes_our_file_and_leaves_a_symlinks_target(tmp):
    home = private_files.find_private_dir()
    ours = home / "stacks-7.txt"
    os.close(private_files.create(ours))
    assert private_files.remove(ours) and not ours.exists()
    victim = tmp / "victim.txt"
    victim.write_text("keep me")
    (home / "stacks-8.txt").symlink_to(victim)
    assert not private_files.remove(home / "stacks-8.txt") and victim.read_text() == "keep me"
