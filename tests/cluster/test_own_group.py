"""Code that brings its own process group, on a live 2-rank CPU world (issue 15 items 1-3).

A cell's own `init_process_group` uses mpnb's group (or is refused when it asks for another world);
a cell's `destroy_process_group` is undone before the next cell on every rank; a script that owns its
group (`own_group.script_owns_group`) gets a real one of its own, on a loopback-bound store, and mpnb's
group is back afterwards, also after an exception. One cluster for the whole module.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from IPython.utils.capture import capture_output

from mpnb.engine.own_group import REFORMED_NOTE
from mpnb.execution.output import strip_ansi
from tests.helpers import both

pytestmark = pytest.mark.timeout(300)

USES = "mpnb: init_process_group() uses mpnb's process group (gloo, 2 ranks) already formed on these engines."
ALL_REDUCE = "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nprint('sum', int(t.item()))\n"


def run(ip, source: str):
    """Run one cell; (result, stdout, stderr) as the notebook shows them."""
    with capture_output() as cap:
        result = ip.run_cell(source, store_history=True)
    return result, strip_ansi(cap.stdout), strip_ansi(cap.stderr)


@pytest.fixture(scope="module")
def ip(ipython, cluster):
    return ipython


def test_a_compatible_init_uses_mpnbs_group_with_one_note(ip):
    res, out, err = run(
        ip,
        "%%distributed\n"
        "import os\n"
        "dist.init_process_group('gloo')\n"
        "dist.init_process_group(backend='cpu:gloo,cuda:nccl', init_method='env://', rank=rank,\n"
        "                        world_size=int(os.environ['WORLD_SIZE']))\n"
        "dist.init_process_group(init_method=f\"tcp://localhost:{os.environ['MASTER_PORT']}\")\n"
        "dist.init_process_group()\n" + ALL_REDUCE,
    )
    assert res.success, out + err
    assert both(out, "sum 3")
    assert (out + err).count(USES) == 1, out + err  # once per cell, the ranks' lines grouped


@pytest.mark.parametrize(
    ("call", "names"),
    [
        ("world_size=3", ["world_size=3 (mpnb's group has 2 ranks)"]),
        ("rank=1 - rank, world_size=2", ["rank=1 (this engine is rank 0)", "rank=0 (this engine is rank 1)"]),
        ("init_method='tcp://10.0.0.1:1'", ["init_method 'tcp://10.0.0.1:1'"]),
        ("backend='nccl'", ["backend 'nccl'"]),
    ],
)
def test_an_incompatible_init_is_a_config_error_naming_the_difference(ip, call, names):
    res, out, err = run(ip, f"%%distributed\ndist.init_process_group({call})\nprint('after', 'init')\n")
    assert not res.success
    text = out + err
    assert "ConfigError" in text and "%mpnb run script.py" in text, text
    for name in names:
        assert name in text, text
    assert "after init" not in text  # the cell stopped there
    res, out, _ = run(ip, "%%distributed\n" + ALL_REDUCE)  # mpnb's group is untouched
    assert res.success and both(out, "sum 3"), out


def test_a_destroyed_group_is_formed_again_before_the_next_cell(ip):
    res, out, err = run(ip, "%%distributed\nkept = rank * 10\ndist.destroy_process_group()\n")
    assert res.success, out + err
    res, out, err = run(ip, "%%distributed\nprint('kept', kept)\n" + ALL_REDUCE)
    assert res.success, out + err
    assert both(out, "sum 3")
    assert "[rank 0] kept 0" in out and "[rank 1] kept 10" in out  # the namespace stayed
    assert (out + err).count(REFORMED_NOTE) == 1, out + err
    assert "has not been initialized" not in out + err
    res, out, err = run(ip, "%%distributed\n" + ALL_REDUCE)  # and only then
    assert res.success and REFORMED_NOTE not in out + err


def test_when_forming_it_again_fails_the_cell_says_heal_or_restart(ip, cluster):
    # an impossible backend (no NCCL in this torch) stands in for a rank that died
    run(ip, "%%distributed\nmpnb.engine.state.backend = 'nccl'\ndist.destroy_process_group()\n")
    res, out, err = run(ip, "%%distributed\nprint('user', 'code')\n")
    text = out + err
    assert not res.success and "RankError: mpnb could not form its process group again" in text, text
    assert "`%mpnb heal`" in text and "`%mpnb restart`" in text and "NCCL" in text
    assert "user code" not in text  # the hook's error stopped the cell before its code
    # back to gloo off the cell path (a cell would try to form the group first)
    cluster.view().apply_sync(
        lambda: setattr(__import__("mpnb.engine.state").engine.state, "backend", "gloo")
    )
    res, out, err = run(ip, "%%distributed\n" + ALL_REDUCE)
    assert res.success and both(out, "sum 3") and REFORMED_NOTE in out + err, out + err


def test_a_model_holding_the_old_group_does_not_block_forming_it_again(ip):
    # DDP keeps the destroyed group, and so its store, alive: the same port would be taken
    res, out, err = run(
        ip,
        "%%distributed\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "import os\nold = DDP(torch.nn.Linear(2, 1))\nold_port = os.environ['MASTER_PORT']\n"
        "dist.destroy_process_group()\n",
    )
    assert res.success, out + err
    res, out, err = run(
        ip, "%%distributed\n" + ALL_REDUCE + "print('moved', os.environ['MASTER_PORT'] != old_port)\n"
    )
    assert res.success and both(out, "sum 3") and both(out, "moved True"), out + err
    res, out, err = run(ip, "%%distributed\n" + SCRIPT + ALL_REDUCE)  # and with a script in between
    assert res.success and both(out, "script 30 True") and both(out, "sum 3"), out + err


def test_destroying_a_subgroup_keeps_the_default_group(ip):
    res, out, err = run(
        ip,
        "%%distributed\ng = dist.new_group([0, 1])\ndist.destroy_process_group(g)\n"
        "print('default', dist.is_initialized())\n" + ALL_REDUCE,
    )
    assert res.success and both(out, "default True") and both(out, "sum 3"), out + err
    assert REFORMED_NOTE not in out + err


SCRIPT = (
    "import os, psutil\n"
    "from mpnb.engine.own_group import script_owns_group\n"
    "with script_owns_group():\n"
    "    assert not dist.is_initialized()\n"
    "    dist.init_process_group('gloo')\n"
    "    s = torch.ones(1) * 10 * (rank + 1)\n"
    "    dist.all_reduce(s)\n"
    "    store = dist.distributed_c10d._get_default_store()\n"
    "    while hasattr(store, 'underlying_store'):\n"
    "        store = store.underlying_store  # the PrefixStore torch puts around it\n"
    "    listening = sorted({c.laddr[0] for c in psutil.Process().net_connections('tcp')\n"
    "                        if c.status == psutil.CONN_LISTEN and c.laddr[1] == store.port})\n"
    "    everywhere = [c.laddr for c in psutil.Process().net_connections('tcp')\n"
    "                  if c.status == psutil.CONN_LISTEN and c.laddr[0] in ('0.0.0.0', '::')]\n"
    "    print('script', int(s.item()), store.port != int(os.environ['MASTER_PORT']))\n"
    "    if rank == 0:\n"
    "        print('store listens on', listening, 'everywhere', everywhere)\n"
    "    dist.destroy_process_group()\n"
)


def test_a_script_owns_its_group_then_mpnbs_is_back(ip):
    res, out, err = run(ip, "%%distributed\n" + SCRIPT + ALL_REDUCE)
    assert res.success, out + err
    assert both(out, "script 30 True")
    assert "[rank 0] store listens on ['127.0.0.1'] everywhere []" in out
    assert both(out, "sum 3")
    assert REFORMED_NOTE not in out + err  # formed again by the context, not by the next cell


def test_an_exception_in_the_script_still_gives_the_group_back(ip):
    res, out, err = run(
        ip,
        "%%distributed\nfrom mpnb.engine.own_group import script_owns_group\ntry:\n"
        "    with script_owns_group():\n"
        "        dist.init_process_group('gloo', timeout=__import__('datetime').timedelta(seconds=20))\n"
        "        raise ValueError('boom')\n"
        "except ValueError as e:\n"
        "    print('caught', e, dist.get_world_size())\n" + ALL_REDUCE,
    )
    assert res.success, out + err
    assert both(out, "caught boom 2") and both(out, "sum 3")


def test_accelerator_and_default_backend_as_in_a_plain_cpu_process(ip):
    res, out, err = run(
        ip,
        "%%distributed\n"
        "print('acc', torch.accelerator.current_accelerator(), torch.accelerator.is_available())\n"
        "print('backend', dist.get_default_backend_for_device(device), dist.get_backend())\n",
    )
    assert res.success, out + err
    here = f"acc {torch.accelerator.current_accelerator()} {torch.accelerator.is_available()}"
    assert both(out, here), (here, out)
    assert both(out, "backend gloo gloo")
    assert dist.get_default_backend_for_device("cpu") == "gloo"
