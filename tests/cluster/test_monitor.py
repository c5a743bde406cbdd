"""The memory side channel: engine sampler threads -> signed ZMQ -> the kernel's MemoryStore.

A real 2-engine CPU cluster; the readers with faked CUDA and NVML are tested in tests/unit/test_monitor.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from jupyter_client.session import Session

from mpnb.engine import monitor
from mpnb.monitoring import channel as monitor_channel
from mpnb.monitoring import protocol
from mpnb.monitoring.store import MemoryStore
from tests.helpers import wait_for


@pytest.fixture(scope="module")
def sess(cluster):
    assert cluster.monitor_channel.running, "mpnb.start must start the memory monitor"
    return cluster


def _window(store: MemoryStore, rank: int, t0: float, t1: float) -> list[dict]:
    return [s for s in store.samples(rank) if t0 <= s["t"] <= t1]


def test_samples_arrive_at_10hz_while_a_cell_runs(sess):
    store = sess.memory
    assert wait_for(lambda: set(store.ranks()) >= {0, 1}), "no samples from the engines at all"
    t0 = time.time()
    sess.view().execute("import time; time.sleep(2)", block=True)
    t1 = time.time()
    for rank in (0, 1):
        busy = [s for s in _window(store, rank, t0, t1) if s["busy"]]
        # 2 s at 10 Hz is 20; a loaded 2-core machine may lose a few
        assert len(busy) >= 12, f"rank {rank}: only {len(busy)} busy samples in {t1 - t0:.1f} s"
        sample = busy[-1]
        assert sample["rank"] == rank and sample["device_kind"] == "cpu"
        assert sample["used"] > 50 * 2**20 and sample["peak"] >= sample["used"]
        assert sample["capacity"] > sample["used"] and sample["device_used"] is None
        # no trainer yet: no tensor categories, and the RSS is not stacked as "other" on CPU
        assert all(sample[c] == 0 for c in protocol.CATEGORIES)


def test_idle_rate_is_about_1hz(sess):
    store = sess.memory
    time.sleep(1.2)  # let the previous cell's busy tail pass
    t0 = time.time()
    time.sleep(4.0)
    t1 = time.time()
    for rank in (0, 1):
        window = _window(store, rank, t0, t1)
        assert all(not s["busy"] for s in window)
        assert 3 <= len(window) <= 6, f"rank {rank}: {len(window)} idle samples in 4 s"


def test_peak_remembers_a_freed_allocation_until_the_next_cell(sess):
    store = sess.memory
    # rank 1 touches 200 MiB and frees it; its peak must keep it after the cell, rank 0's must not
    code = "import time\nif rank == 1:\n    b = bytearray(200 * 2**20); del b\ntime.sleep(0.3)"
    sess.view().execute(code, block=True)
    ended = time.time()
    assert wait_for(lambda: all(any(s["t"] > ended for s in store.samples(r)) for r in (0, 1)))
    last = {r: store.samples(r)[-1] for r in (0, 1)}
    assert last[1]["peak"] >= last[1]["used"] + 150 * 2**20, last[1]
    assert last[0]["peak"] < last[0]["used"] + 100 * 2**20, last[0]
    sess.view().execute("pass", block=True)  # a new cell starts a new peak window
    started = time.time()
    assert wait_for(lambda: any(s["t"] > started for s in store.samples(1)))
    last1 = store.samples(1)[-1]
    assert last1["peak"] < last1["used"] + 100 * 2**20, last1


def test_rates_are_configurable(sess):
    store = sess.memory
    sess.view().apply_sync(monitor.configure, idle_hz=5.0)
    try:
        time.sleep(1.0)
        t0 = time.time()
        time.sleep(2.0)
        n = len(_window(store, 0, t0, time.time()))
        assert 7 <= n <= 13, f"{n} samples in 2 s at 5 Hz"
    finally:
        sess.view().apply_sync(monitor.configure, idle_hz=monitor.DEFAULT_IDLE_HZ)


def _send(channel: monitor_channel.MonitorChannel, frames_list: list[list[bytes]]) -> None:
    """Push from this process, as an engine would: with a CURVE pair the channel allows."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    if getattr(channel, "curve_publickey", None):
        public, secret = zmq.curve_keypair()
        channel.allow([public])
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            channel.curve_publickey,
            public,
            secret,
        )
    sock.connect(channel.endpoint)
    for frames in frames_list:
        sock.send_multipart(frames)
    sock.close()
    ctx.term()


def _fake_sample(rank: int) -> dict:
    return {"rank": rank, "t": time.time(), "busy": False, "used": 1}


def test_unsigned_badly_signed_and_replayed_messages_are_dropped(sess):
    channel = sess.monitor_channel
    store = sess.memory
    dropped = channel.dropped
    client_session = sess.client.session
    good = Session(key=client_session.key, signature_scheme=client_session.signature_scheme)
    bad = Session(key=b"not-the-cluster-key", signature_scheme=client_session.signature_scheme)

    valid = good.serialize(good.msg(monitor.MSG_TYPE, {"samples": [_fake_sample(98)]}))
    forged = bad.serialize(bad.msg(monitor.MSG_TYPE, {"samples": [_fake_sample(99)]}))
    unsigned = Session(key=b"").serialize(
        Session(key=b"").msg(monitor.MSG_TYPE, {"samples": [_fake_sample(97)]})
    )
    _send(channel, [forged, unsigned, [b"garbage"], valid, valid])  # the last is a replay

    # the receiver counts drops as it reads and stores the batch after: wait for both
    assert wait_for(lambda: channel.dropped >= dropped + 4 and store.samples(98)), channel.dropped - dropped
    assert len(store.samples(98)) == 1  # the authentic one got through, its replay did not
    assert store.samples(99) == [] and store.samples(97) == []


# -- another local process attacks the channel (issue 14: items 3, 4, 5)

# Runs in a separate process with its own zmq context; reads its orders as JSON on stdin.
ATTACKER = r"""
import json, os, sys, threading, zmq
from mpnb.monitoring.protocol import MSG_TYPE, Signer
orders = json.load(sys.stdin)
ctx = zmq.Context()
sock = ctx.socket(zmq.PUSH)
sock.setsockopt(zmq.LINGER, orders.get("linger_ms", 10000))
sock.setsockopt(zmq.SNDTIMEO, orders.get("linger_ms", 10000))  # a refused sender's sends would block
if orders.get("curve"):  # [server public, own public, own secret]: an allowed sender
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (k.encode() for k in orders["curve"])
sock.connect(orders["endpoint"])
signer = Signer(bytes.fromhex(orders.get("key", "00")))

def send(*frames):
    try:
        sock.send_multipart(frames)
    except zmq.Again:
        pass


for step in orders["steps"]:
    if step[0] == "big":  # one frame of this many MiB
        send(b"x" * (step[1] << 20))
    elif step[0] == "parts":  # one message of this many parts of just under 1 MiB
        send(*[b"x" * ((1 << 20) - 64)] * step[1])
    elif step[0] == "signed":  # a signed message with these samples
        send(signer.packed(MSG_TYPE, {"samples": step[1]}))
    elif step[0] == "capture":  # a signed message, remembered for a replay
        captured = signer.packed(MSG_TYPE, {"samples": step[1]})
        send(captured)
    elif step[0] == "junk":  # this many messages with forged signatures
        head = captured.split(b"\0")[2]
        for i in range(step[1]):
            send(b"\0".join([Signer.DELIM, b"%064x" % i, head, b"{}", b"{}", b"{}"]))
    elif step[0] == "replay":
        send(captured)
sock.close()
# A sender refused at the handshake can keep zmq's term waiting past its linger: leave anyway.
watchdog = threading.Timer(orders.get("linger_ms", 10000) / 1000 + 2, os._exit, (0,))
watchdog.daemon = True
watchdog.start()
ctx.term()
"""


def _attack(channel, steps: list, allowed: bool = True, signed: bool = True, linger_ms: int = 10000) -> None:
    """Run ATTACKER in another process; `allowed`: with a CURVE pair the channel admits (an engine's)."""
    orders: dict = {"endpoint": channel.endpoint, "steps": steps, "linger_ms": linger_ms}
    server = getattr(channel, "curve_publickey", None)
    if server and allowed:
        public, secret = zmq.curve_keypair()
        channel.allow([public])
        orders["curve"] = [server.decode(), public.decode(), secret.decode()]
    if signed:
        orders["key"] = mpnb_session_key().hex()
    subprocess.run(
        [sys.executable, "-c", ATTACKER], input=json.dumps(orders), text=True, timeout=180, check=True
    )


def mpnb_session_key() -> bytes:
    import mpnb

    return mpnb.session().client.session.key


def _kernel_peak_rss_growth(action) -> int:
    """Bytes by which this process's peak RSS (the kernel's: the channel runs here) rose during `action`."""

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # restart the peak (VmHWM) from the present RSS
    before = status("VmRSS:")
    action()
    return status("VmHWM:") - before


def _engines_still_report(store: MemoryStore) -> bool:
    since = time.time()
    return wait_for(lambda: all(_window(store, r, since, since + 60) for r in (0, 1)), 10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc")
def test_oversized_frames_from_another_process_leave_the_kernel_small(sess):
    channel = sess.monitor_channel

    def attack() -> None:
        # a stranger: a 300 MiB frame, then 300 parts of 1 MiB (zmq holds a multipart message whole)
        _attack(channel, [["big", 300], ["parts", 300]], allowed=False, signed=False, linger_ms=3000)
        # a sender the channel admits: frames over the size limit cost it its connection, not our memory
        _attack(channel, [["big", 64], ["big", 2]], signed=False, linger_ms=3000)
        time.sleep(1.0)

    growth = _kernel_peak_rss_growth(attack)
    assert growth < 64 * 2**20, f"the kernel's peak RSS rose by {growth / 2**20:.0f} MiB"
    assert channel.running and _engines_still_report(sess.memory)


def test_malformed_signed_samples_are_dropped_counted_and_the_monitor_goes_on(sess):
    from mpnb.monitoring.report import memory_report

    channel, store = sess.monitor_channel, sess.memory
    invalid, now = channel.invalid, time.time()
    good = {**_fake_sample(94), "t": now}
    bad = [
        {**good, "rank": "x"},
        {**good, "t": "soon"},
        {**good, "rank": 10**9},
        {**good, "used": -1},
        {**good, "busy": "yes"},
        {**good, "device_kind": "tpu"},
        "not a sample",
    ]
    _attack(channel, [["signed", [b]] for b in bad] + [["signed", [*bad, good]]])
    assert wait_for(lambda: channel.invalid >= invalid + 2 * len(bad) and store.samples(94), 10), (
        channel.invalid
    )
    assert channel.running
    assert [s["t"] for s in store.samples(94)] == [now]
    assert all(isinstance(s["t"], float) for s in store.samples())  # sorting, the report, the sidebar
    assert 94 in memory_report(sess).to_dict()
    assert _engines_still_report(store)


def test_a_replay_after_a_flood_of_junk_signatures_is_refused(sess):
    channel, store = sess.monitor_channel, sess.memory
    dropped, flood = channel.dropped, 300_000  # enough to flush jupyter_client's digest history (65 536)
    _attack(channel, [["capture", [_fake_sample(93)]], ["junk", flood], ["replay"]])
    assert wait_for(lambda: channel.dropped >= dropped + flood + 1, 120), channel.dropped - dropped
    assert len(store.samples(93)) == 1  # the genuine message once, its replay refused
    assert channel.running and _engines_still_report(store)


def test_engine_with_the_wrong_key_is_ignored(sess):
    """A sampler that signs with another key gets nothing into the store; the right key is restored."""
    channel = sess.monitor_channel
    store = sess.memory
    rank1 = sess.view([1])
    rank1.apply_sync(monitor.start, channel.endpoint, key=b"wrong-key", idle_hz=10.0)
    try:
        time.sleep(0.3)
        dropped, t0 = channel.dropped, time.time()
        time.sleep(1.5)
        assert _window(store, 1, t0, time.time()) == []
        assert channel.dropped >= dropped + 4  # batches of 10 Hz samples, 4 a second
        assert len(_window(store, 0, t0, time.time())) >= 1  # rank 0 is unaffected
    finally:
        rank1.apply_sync(monitor.start, channel.endpoint)
    assert wait_for(lambda: any(s["t"] > time.time() - 1 for s in store.samples(1)), 5)


def test_binds_to_the_cluster_interface_not_all_interfaces(sess, monkeypatch):
    import psutil

    assert sess.monitor_channel.endpoint.startswith("tcp://127.0.0.1:")

    class RemoteClient:  # the connection info a client of a controller on another host has
        _config = {"registration": "tcp://10.99.0.1:5000", "interface": "tcp://10.99.0.1"}

    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    chosen = monitor_channel.bind_interface(RemoteClient())
    assert chosen != "0.0.0.0" and chosen in local  # one of this machine's own addresses
    monkeypatch.setenv(monitor_channel.INTERFACE_ENV, "127.0.0.2")
    assert monitor_channel.bind_interface(RemoteClient()) == "127.0.0.2"


# -- the Trainer's breakdown, measured by the monitor, against mpnb.estimate

# What someone running notebooks 01/02 steps through; each must hold less model state per rank.
TREND = [("ddp", 0), ("zero", 1), ("zero", 2), ("zero", 3), ("fsdp", 0)]
MODEL_STATES = ("parameters", "gradients", "optimizer")


def test_the_chart_shows_model_states_shrinking_from_ddp_to_zero3_and_fsdp(sess):
    """The chart's store after two steps under each strategy: per-rank bytes as the live chart stacks them."""
    from mpnb.models import tiny_gpt
    from mpnb.planning.config import Config
    from mpnb.planning.estimator import estimate

    store = sess.memory
    shown: dict[str, dict[str, int]] = {}
    for strategy, stage in TREND:
        cfg = Config(strategy=strategy, zero_stage=stage, micro_batch_size=4)
        predicted = estimate(tiny_gpt(), cfg, 2)
        code = (
            "import torch, mpnb\n"
            "from mpnb.models import tiny_gpt, synthetic_batches\n"
            "model = tiny_gpt()\n"
            "trainer = mpnb.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "
            f"config={cfg.to_dict()!r})\n"
            "for batch in synthetic_batches(batch_size=8, steps=2):\n"
            "    trainer.step(batch)\n"
        )
        store.set_estimate(None)
        sess.view().execute(code, block=True).get()

        def trained(rank: int, want=predicted) -> bool:  # the newest sample carries the breakdown
            last = store.samples(rank)[-1:]
            expected = want.ranks[rank]
            return bool(last) and last[0]["activations"] > 0 and all(
                abs(last[0][c] - getattr(expected, c)) <= 0.1 * getattr(expected, c) for c in MODEL_STATES
            )

        # re-read right after each of the first steps; the next sample (<= 0.1 s) carries it
        assert wait_for(lambda: trained(0) and trained(1), 3), (strategy, stage, store.samples(0)[-1])
        name = f"{strategy}{stage}" if strategy == "zero" else strategy
        for rank in (0, 1):
            sample = store.samples(rank)[-1]
            assert sample["other"] == 0 and sample["used"] > 50 * 2**20  # RSS: its own line, not stacked
            shown[f"{name}/{rank}"] = {c: sample[c] for c in (*MODEL_STATES, "activations")}
        # the estimate line is for this model and config, from the whole model even where it is sharded
        assert wait_for(lambda: store.estimate is not None, 5)
        assert store.estimate == predicted.by_rank()
    print("per-rank bytes the chart shows:", shown)  # the measurement issue 13 asks for (-s to see)

    def states(name: str) -> int:
        return sum(shown[f"{name}/0"][c] for c in MODEL_STATES)

    assert states("ddp") > states("zero1") > states("zero2") > states("zero3")
    assert states("fsdp") < states("zero2")
    assert shown["zero3/0"]["parameters"] < shown["zero2/0"]["parameters"] == shown["ddp/0"]["parameters"]
    assert shown["zero2/0"]["gradients"] < shown["zero1/0"]["gradients"]
    assert shown["zero1/0"]["optimizer"] < shown["ddp/0"]["optimizer"]  # DeepSpeed's 12 bytes / 2 < torch's 8


def test_a_pipeline_stage_sends_the_estimate_for_the_whole_model(sess):
    from mpnb.models import tiny_gpt
    from mpnb.planning.config import Config
    from mpnb.planning.estimator import estimate

    cfg = Config(strategy="pipeline", pipeline_stages=2, microbatches=2, micro_batch_size=4)
    sess.memory.set_estimate(None)
    sess.view().execute(
        "import torch, mpnb\nfrom mpnb.models import tiny_gpt\nmodel = tiny_gpt()\n"
        f"trainer = mpnb.prepare(model, config={cfg.to_dict()!r})\n",
        block=True,
    ).get()
    predicted = estimate(tiny_gpt(), cfg, 2).by_rank()
    assert wait_for(lambda: sess.memory.estimate is not None, 5)
    assert sess.memory.estimate == predicted and predicted[0] != predicted[1]  # one line per stage


def test_saved_checkpoints_reach_the_kernels_list(sess, tmp_path):
    """Rank 0 announces each finished save over the side channel: the sidebar's list (issue 17, item 5)."""
    from mpnb.checkpoints.format import MANIFEST
    from mpnb.planning.config import Config

    first, second = tmp_path / "step-2", tmp_path / "step-3"
    cfg = Config(strategy="zero", zero_stage=2, micro_batch_size=4)
    before = time.time()
    sess.view().execute(
        "import torch, mpnb\nfrom mpnb.models import tiny_gpt, synthetic_batches\nmodel = tiny_gpt()\n"
        "trainer = mpnb.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "
        f"config={cfg.to_dict()!r})\n"
        "batches = iter(synthetic_batches(batch_size=8, steps=3))\n"
        "for _ in range(2):\n    trainer.step(next(batches))\n"
        f"trainer.save({str(first)!r})\n"
        "trainer.step(next(batches))\n"
        f"trainer.save({str(second)!r}, blocking=False).wait()\n"  # finishes on the save's own thread
        f"trainer.save({str(first)!r})\n",  # the same path again: one row, now the newest
        block=True,
    ).get()

    def listed() -> list[tuple[str, int]]:
        return [(c["path"], c["step"]) for c in sess.memory.checkpoints()]

    want = [(str(second), 3), (str(first), 3)]
    assert wait_for(lambda: listed()[-2:] == want, 5), listed()
    for record in sess.memory.checkpoints()[-2:]:
        manifest = json.loads(Path(record["path"], MANIFEST).read_text())
        on_disk = sum(f["bytes"] for r in manifest["ranks"] for f in r["files"].values())
        assert record["bytes"] == on_disk > 0
        assert (record["strategy"], record["label"], record["world_size"]) == ("zero", "ZeRO-2", 2)
        assert 0 < record["seconds"] < 60 and before < record["t"] <= time.time()


def test_set_busy_switches_to_the_busy_rate_for_apply_work(sess):
    store = sess.memory
    sess.view().apply_sync(monitor.set_busy, True)
    try:
        time.sleep(0.5)
        t0 = time.time()
        time.sleep(1.5)
        window = _window(store, 0, t0, time.time())
        assert len(window) >= 9 and all(s["busy"] for s in window), len(window)
    finally:
        sess.view().apply_sync(monitor.set_busy, False)
    t1 = time.time()
    assert wait_for(lambda: any(not s["busy"] and s["t"] > t1 for s in store.samples(0)), 3)


def test_restarted_engines_sample_again(sess):
    import mpnb

    old_pids = {r.rank: r.pid for r in sess.ranks}
    channel = sess.monitor_channel
    mpnb.restart(verbose=False)
    assert sess.monitor_channel is channel and channel.running  # the kernel end is kept
    assert {r.rank: r.pid for r in sess.ranks} != old_pids
    t0 = time.time()
    assert wait_for(lambda: all(_window(sess.memory, r, t0, time.time() + 1) for r in (0, 1)), 10)
    assert all(s["running"] for s in sess.view().apply_sync(monitor.status))


# -- last: stopping the cluster stops the samples


def test_detach_stops_every_sampler_thread(sess):
    monitor_channel.detach(sess)
    statuses = sess.view().apply_sync(monitor.status)
    assert statuses == [{"running": False}, {"running": False}]
    assert sess.monitor_channel is None
    monitor_channel.attach(sess)
    assert all(s["running"] for s in sess.view().apply_sync(monitor.status))


def test_samples_stop_when_the_cluster_stops(sess):
    import mpnb

    store, channel = sess.memory, sess.monitor_channel
    assert wait_for(lambda: any(s["t"] > time.time() - 1.5 for s in store.samples()), 5)
    mpnb.stop()
    stopped = time.time()
    count = len(store.samples())
    time.sleep(2.5)
    assert len(store.samples()) == count
    assert not any(s["t"] > stopped + 0.5 for s in store.samples())
    assert not channel.running


def test_memory_samples_arrive_from_a_cluster_with_curve(monkeypatch):
    """ipyparallel with CurveZMQ has no HMAC key; the channel signs with a key of its own (issue 14: 11)."""
    import mpnb

    monkeypatch.setenv("IPP_ENABLE_CURVE", "1")
    sess = mpnb.start(n=2, timeout=30, verbose=False)
    try:
        assert sess.client.curve_serverkey and not sess.client.session.key
        channel = sess.monitor_channel
        assert channel is not None and channel.running and channel.curve_publickey
        assert _engines_still_report(sess.memory)
        t0 = time.time()
        sess.view().execute("import time; time.sleep(1)", block=True)
        assert all(any(s["busy"] for s in _window(sess.memory, r, t0, time.time())) for r in (0, 1))
        assert channel.dropped == 0
    finally:
        mpnb.stop()
