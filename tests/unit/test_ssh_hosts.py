"""`mpnb.cluster.ssh_hosts`: the `--ssh` spec and ssh options, checked before anything starts."""

from __future__ import annotations

import subprocess

import pytest

from mpnb.cluster import ssh_hosts
from mpnb.errors import ConfigError


def test_a_spec_keeps_the_hosts_in_the_order_given():
    assert ssh_hosts.parse_hosts("nodeB:2, root@nodeA:1") == {"nodeB": 2, "root@nodeA": 1}
    assert ssh_hosts.parse_hosts({"10.0.0.2": 4}) == {"10.0.0.2": 4}


@pytest.mark.parametrize(("spec", "phrase"), [
    ("nodeA", "host:engines"),
    ("nodeA:0", "at least 1"),
    ("nodeA:two", "whole number"),
    ("nodeA:1,nodeA:2", "twice"),
    ("no de:1", "not a host name"),
    (":2", "not a host name"),
    ({"nodeA": True}, "whole number"),
])
def test_a_bad_spec_names_the_problem(spec, phrase):
    with pytest.raises(ConfigError, match=phrase):
        ssh_hosts.parse_hosts(spec)


def test_ssh_options_are_split_as_a_shell_would():
    split = ssh_hosts.check_args("-i '/keys/my key' -o BatchMode=yes")
    assert split == ["-i", "/keys/my key", "-o", "BatchMode=yes"]
    assert ssh_hosts.check_args(None) == []


def test_a_host_on_this_machine_gets_a_controller_on_loopback():
    assert ssh_hosts.controller_address({"localhost": 2}, []) == "127.0.0.1"


def test_ssh_and_scp_stderr_go_to_the_log_not_the_kernel(tmp_path):
    log = tmp_path / "ipp.log"
    wrapped = ssh_hosts._stderr_to("ls", str(log))
    done = subprocess.run([*wrapped, "/no/such/path"], capture_output=True, text=True)
    assert done.returncode != 0 and done.stderr == ""
    assert "/no/such/path" in log.read_text()
