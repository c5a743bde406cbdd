"""`%mpnb heal` without a cluster is a clear error, in a real IPython shell."""

from __future__ import annotations

from IPython.utils.capture import capture_output

from mpnb.cluster import lifecycle as cluster_mod
from mpnb.errors import NoClusterError


def test_heal_without_cluster_is_a_clear_error(ipython):
    cluster_mod.stop()
    with capture_output():
        res = ipython.run_cell("%mpnb heal")
    assert isinstance(res.error_in_exec, NoClusterError)
    assert "no process group to heal" in str(res.error_in_exec) and "%mpnb start" in str(res.error_in_exec)
