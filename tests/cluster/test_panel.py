"""The config panel with a running cluster: it follows the session's config both ways, renders in a kernel."""

from __future__ import annotations

import pytest

import mpnb
from mpnb import Config, estimate


def _engine_configs(sess) -> list[dict]:
    view = sess.view()
    view.execute("from mpnb.engine import state as _mpnb_state; _panel_cfg = dict(_mpnb_state.config)",
                 block=True)
    return view.pull("_panel_cfg", block=True)


@pytest.fixture(scope="module")
def late_cluster():
    """The module's one cluster, started while a planning panel is already open: (session, that panel)."""
    from mpnb.cluster import lifecycle as cluster_mod

    cluster_mod.stop()
    early = mpnb.config_panel(world_size=8, device_kind="cuda")
    assert early.world.disabled is False  # planning: no cluster yet
    try:
        sess = mpnb.start(n=2, timeout=30, verbose=False, config=Config(strategy="zero", zero_stage=1))
        yield sess, early
    finally:
        cluster_mod.stop()
        early.close()


def test_open_panel_attaches_to_a_cluster_started_later(late_cluster) -> None:
    sess, early = late_cluster
    assert early.world_size() == 2 and early.world.disabled and early.device_kind() == "cpu"
    assert early.strategy.value == "zero" and early.zero_stage.value == 1 and early.config == sess.config
    early.zero_stage.value = 2
    early.apply()
    assert sess.config.zero_stage == 2


def test_panel_edits_the_session_config_both_ways(late_cluster, ipython, capsys) -> None:
    from mpnb.models import tiny_gpt

    cluster, _ = late_cluster

    model = tiny_gpt()
    p = mpnb.config_panel(model)
    try:
        assert p.world_size() == cluster.world_size == 2 and p.world.disabled
        assert p.device_kind() == "cpu"
        assert p.config == cluster.config
        import psutil  # CPU ranks: the capacity marker is the machine's memory

        assert abs(p.capacity() - psutil.virtual_memory().total) < 0.1e9

        # Apply reaches every engine
        p.strategy.value = "zero"
        p.zero_stage.value = 2
        p.apply_button.click()
        wanted = Config(strategy="zero", zero_stage=2)
        assert cluster.config == wanted == p.config
        assert _engine_configs(cluster) == [wanted.to_dict()] * 2
        # the live chart's dashed line is the panel's estimate
        assert cluster.memory.estimate == estimate(model, wanted, 2, seq_len=model.config.seq_len).by_rank()

        # the panel's Apply is what `%mpnb config` then shows
        capsys.readouterr()
        ipython.run_line_magic("mpnb", "config")
        assert capsys.readouterr().out.strip() == wanted.summary(2)

        # `%mpnb config ...` updates the open panel
        ipython.run_line_magic("mpnb", "config strategy=zero zero_stage=3 micro_batch_size=4")
        assert (p.strategy.value, p.zero_stage.value, p.micro_batch_size.value) == ("zero", 3, 4)
        assert p.config == cluster.config == Config(strategy="zero", zero_stage=3, micro_batch_size=4)
        assert "changed outside the panel" in p.changes.value
        assert p.apply_button.disabled  # the form equals the session's config
        assert _engine_configs(cluster) == [cluster.config.to_dict()] * 2

        # so does any other set_config
        cluster.set_config(Config(strategy="fsdp", reshard_after_forward=False))
        assert p.strategy.value == "fsdp" and p.reshard_after_forward.value is False
        assert p.config == cluster.config

        # fp16 on CPU ranks: the message, and nothing is sent
        p.precision.value = "fp16"
        assert "fp16 is not supported on CPU" in p.message.value and p.apply_button.disabled
        p.apply()
        assert cluster.config.precision == "fp32"
    finally:
        p.close()
    cluster.set_config(Config())  # a closed panel no longer follows the session
    assert p.config.strategy == "fsdp"


def test_panel_renders_in_a_real_kernel_and_updates_its_bars() -> None:
    """The widget reaches a front end: a view on display, then bar updates as comm messages."""
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3")
    try:
        def run(code: str) -> list[dict]:
            msg_id = client.execute(code)
            out = []
            while True:
                msg = client.get_iopub_msg(timeout=120)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                out.append(msg)
                if msg["msg_type"] == "error":
                    raise AssertionError("\n".join(msg["content"]["traceback"]))
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    return out

        shown = run("import mpnb\np = mpnb.config_panel(world_size=4)\np")
        views = [m for m in shown if m["msg_type"] == "execute_result"
                 and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]]
        assert len(views) == 1
        state: dict[str, dict] = {}  # comm id -> the widget state a front end ends up with
        for m in shown:
            if m["msg_type"] in ("comm_open", "comm_msg"):
                state.setdefault(m["content"]["comm_id"], {}).update(m["content"]["data"].get("state", {}))
        root = [c for c, st in state.items() if "mpnb-panel" in st.get("_dom_classes", [])]
        assert len(root) == 1  # the stable class the browser test looks for
        apply = [c for c, st in state.items() if "mpnb-panel-apply" in st.get("_dom_classes", [])]
        assert len(apply) == 1 and state[apply[0]]["description"] == "Apply"
        updates = run("p.strategy.value = 'zero'; p.zero_stage.value = 3")
        bar_updates = [m for m in updates if m["msg_type"] == "comm_msg"
                       and "mpnb-panel-seg" in str(m["content"]["data"].get("state", {}).get("value", ""))]
        assert bar_updates, "the estimate bars were not re-sent after the stage changed"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_panel_detaches_when_the_cluster_stops(late_cluster) -> None:
    """Last in this module on purpose: it stops the module's cluster (the fixture's stop is then a no-op)."""
    from mpnb.cluster import lifecycle as cluster_mod

    sess, early = late_cluster
    cluster_mod.stop()
    assert sess.closed and not early.world.disabled and "stopped" in early._cluster_note.value
    early.strategy.value = "ddp"
    early.apply()  # planning again: nothing is sent anywhere
    assert early.config.strategy == "ddp"
