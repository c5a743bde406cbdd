"""Memory readers and the signed side channel in this process, without engines.

CUDA and NVML are the only fakes; the real path runs in benchmarks/gpu_check.py.
"""

from __future__ import annotations

import time

import pytest

from mpnb.engine import monitor, state
from mpnb.engine.readers import CpuReader, CudaReader, MemoryReading
from mpnb.monitoring import channel as monitor_channel
from mpnb.monitoring import protocol
from mpnb.monitoring.store import MemoryStore
from tests.helpers import wait_for


class FakeCuda:
    """torch.cuda's counters as a caching allocator would report them."""

    def __init__(self) -> None:
        self.stats = {
            "allocated_bytes.all.current": 3 * 2**30,
            "reserved_bytes.all.current": 4 * 2**30,
            "allocated_bytes.all.peak": 5 * 2**30,
            "num_ooms": 2,
        }
        self.resets = 0

    def memory_stats(self, device: int) -> dict:
        assert device == 0
        return dict(self.stats)

    def reset_peak_memory_stats(self, device: int) -> None:
        self.resets += 1
        self.stats["allocated_bytes.all.peak"] = self.stats["allocated_bytes.all.current"]

    def total_memory(self, device: int) -> int:
        return 80 * 2**30


class FakeNvml:
    def __init__(self) -> None:
        self.fail = False

    def device_memory(self) -> tuple[int, int]:
        if self.fail:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return 6 * 2**30, 81 * 2**30


def test_cuda_reader_maps_torch_and_nvml_numbers():
    cuda, nvml = FakeCuda(), FakeNvml()
    reader = CudaReader(0, cuda, nvml)
    assert reader.read() == MemoryReading("cuda", 3 * 2**30, 4 * 2**30, 5 * 2**30, 81 * 2**30, 6 * 2**30, 2)
    reader.reset_peak()
    assert cuda.resets == 1 and reader.read().peak == 3 * 2**30
    nvml.fail = True  # a driver error costs the device view, not the sample
    reading = reader.read()
    assert reading.device_used is None and reading.capacity == 80 * 2**30 and reading.used == 3 * 2**30
    assert CudaReader(0, cuda, None).read().device_used is None


def test_sampler_sends_cuda_samples_through_the_channel():
    """A sampler in this process with the faked GPU, through a real signed channel."""
    key = b"test-key"
    store = MemoryStore()
    channel = monitor_channel.MonitorChannel(store, key)
    endpoint = channel.start()
    sampler = monitor.Sampler(
        endpoint, key, busy_hz=20, idle_hz=20, reader=CudaReader(0, FakeCuda(), FakeNvml())
    )
    sampler.start()
    try:
        assert wait_for(lambda: len(store.samples()) >= 5, 5)
    finally:
        assert sampler.stop()
        channel.stop()
    sample = store.samples()[-1]
    assert sample["device_kind"] == "cuda" and sample["device_used"] == 6 * 2**30
    assert sample["used"] == 3 * 2**30 and sample["reserved"] == 4 * 2**30 and sample["oom_count"] == 2
    assert sample["other"] == sample["used"]
    assert not channel.running and channel.dropped == 0


def test_cpu_reader_peak_catches_and_resets():
    reader = CpuReader()
    reader.reset_peak()
    before = reader.read()
    block = bytearray(128 * 2**20)
    del block
    after = reader.read()
    assert after.peak >= before.used + 100 * 2**20
    reader.reset_peak()
    assert reader.read().peak < after.peak - 100 * 2**20


def test_channel_refuses_to_run_without_a_key():
    from mpnb.errors import ClusterError

    with pytest.raises(ClusterError, match="key"):
        monitor_channel.MonitorChannel(MemoryStore(), b"")


# -- the wire format: signatures, counters, field checks (issue 14: items 3, 4, 5)

KEY = b"unit-test-key"


def _good_sample(rank: int = 0, **fields) -> dict:
    sample = protocol.make_sample(
        rank=rank,
        t=1.7e9,
        busy=False,
        device_kind="cpu",
        used=100,
        reserved=100,
        peak=120,
        capacity=1000,
        device_used=None,
        oom_count=0,
        parts={},
    )
    return {**sample, **fields}


def _packed(signer: protocol.Signer, samples: list, **extra) -> list[bytes]:
    return [signer.packed(protocol.MSG_TYPE, {"samples": samples, **extra})]


BAD_FIELDS = [
    {"rank": "x"},
    {"rank": -1},
    {"rank": protocol.MAX_RANK},
    {"rank": True},
    {"rank": 1.0},
    {"t": "soon"},
    {"t": float("nan")},
    {"t": float("inf")},
    {"t": -1.0},
    {"t": 10**400},
    {"t": None},
    {"busy": "yes"},
    {"busy": 1},
    {"device_kind": "tpu"},
    {"used": -5},
    {"used": 1.5},
    {"used": "100"},
    {"used": 2**63},
    {"peak": None},
    {"device_used": "a"},
    {"device_used": -1},
    {"comm_sent": -1},
    {"comm_sent": "4096"},
    {"comm_sent": 1.5},
    {"parameters": [1]},
    {"oom_count": False},
]


@pytest.mark.parametrize("bad", BAD_FIELDS, ids=lambda d: repr(d))
def test_a_signed_sample_with_a_bad_field_is_dropped_and_counted(bad):
    verifier, signer = protocol.Verifier(KEY), protocol.Signer(KEY)
    decoded = protocol.decode(verifier, _packed(signer, [_good_sample(1), {**_good_sample(2), **bad}]))
    assert [s["rank"] for s in decoded.samples] == [1] and decoded.invalid == 1


def test_valid_samples_keep_their_fields_and_lose_unknown_ones():
    verifier, signer = protocol.Verifier(KEY), protocol.Signer(KEY)
    cuda = _good_sample(3, device_kind="cuda", device_used=7, busy=True, t=1_700_000_000, comm_sent=None)
    sending = _good_sample(5, comm_sent=4 << 20)
    minimal = {"rank": 4, "t": 1.5, "used": 0}  # what older senders and hand-made messages carry
    junk = {**minimal, "junk": "x" * 100}
    decoded = protocol.decode(verifier, _packed(signer, [cuda, sending, junk, "nope"]))
    assert decoded.samples == [cuda, sending, minimal] and decoded.invalid == 1
    assert decoded.estimate is None


def test_estimates_are_checked_too():
    verifier, signer = protocol.Verifier(KEY), protocol.Signer(KEY)
    good = protocol.decode(verifier, _packed(signer, [], estimate={"0": 10, "1": 20}))
    assert good.estimate == {0: 10, 1: 20} and good.invalid == 0
    for bad in ({"x": 1}, {"0": -1}, {"0": "1"}, {"-1": 1}, [1, 2], {str(protocol.MAX_RANK): 1}):
        decoded = protocol.decode(verifier, _packed(signer, [], estimate=bad))
        assert decoded.estimate is None and decoded.invalid == 1, bad


def test_too_many_samples_or_bytes_are_refused_whole():
    verifier, signer = protocol.Verifier(KEY), protocol.Signer(KEY)
    many = [_good_sample(0)] * (protocol.MAX_SAMPLES_PER_MESSAGE + 1)
    with pytest.raises(ValueError, match="malformed"):
        protocol.decode(verifier, _packed(signer, many))
    with pytest.raises(protocol.AuthenticationError, match="too large"):
        protocol.decode(verifier, [b"x" * (protocol.MAX_MESSAGE_BYTES + 1)])
    assert len(protocol.decode(verifier, _packed(signer, many[:-1])).samples) == len(many) - 1


def test_junk_never_reaches_the_replay_check_and_a_replay_is_refused_after_any_flood():
    verifier, signer = protocol.Verifier(KEY), protocol.Signer(KEY)
    captured = _packed(signer, [_good_sample(5)])
    assert len(protocol.decode(verifier, captured).samples) == 1
    for i in range(20_000):  # forged signatures: a hash each, nothing remembered
        junk = [b"<IDS|MSG>", f"{i:064x}".encode(), captured[0].split(b"\x00")[2], b"{}", b"{}", b"{}"]
        with pytest.raises(protocol.AuthenticationError, match="bad signature"):
            verifier.open(junk)
    with pytest.raises(protocol.AuthenticationError, match="replayed"):
        protocol.decode(verifier, captured)
    later = _packed(signer, [_good_sample(5)])  # the same sender's next message is fine
    assert len(protocol.decode(verifier, later).samples) == 1
    with pytest.raises(protocol.AuthenticationError, match="replayed"):
        protocol.decode(verifier, captured)  # an older one stays refused


def test_a_restarted_sender_and_jupyter_client_messages_are_accepted():
    from jupyter_client.session import Session

    verifier = protocol.Verifier(KEY)
    for _ in range(2):  # a restarted sampler signs as a new sender, its counter from 1 again
        assert protocol.decode(verifier, _packed(protocol.Signer(KEY), [_good_sample(6)])).samples
    session = Session(key=KEY)  # msg_id "<session>_<pid>_<n>", n from 0
    frames = [session.serialize(session.msg(protocol.MSG_TYPE, {"samples": [_good_sample(7)]}))]
    first = protocol.decode(verifier, frames[0])
    assert first.samples[0]["rank"] == 7
    with pytest.raises(protocol.AuthenticationError, match="replayed"):
        protocol.decode(verifier, frames[0])
    with pytest.raises(protocol.AuthenticationError, match="bad signature"):
        protocol.decode(protocol.Verifier(b"other-key"), _packed(protocol.Signer(KEY), []))
    unsigned = Session(key=b"")
    with pytest.raises(protocol.AuthenticationError, match="bad signature"):
        protocol.decode(verifier, unsigned.serialize(unsigned.msg(protocol.MSG_TYPE, {"samples": []})))


def test_a_curve_channel_admits_only_allowed_keys():
    """The channel `attach` builds: a CURVE server with an allow-list; only an allowed pair gets in."""
    import zmq

    store = MemoryStore()
    _, server_secret = zmq.curve_keypair()
    channel = monitor_channel.MonitorChannel(store, KEY, curve_secretkey=server_secret)
    endpoint = channel.start()
    allowed, stranger = zmq.curve_keypair(), zmq.curve_keypair()
    channel.allow([allowed[0]])
    curve = (channel.curve_publickey, *allowed)
    sampler = monitor.Sampler(endpoint, KEY, busy_hz=20, idle_hz=20, reader=CpuReader(), curve=curve)
    intruder = monitor.Sampler(
        endpoint, KEY, busy_hz=20, idle_hz=20, reader=CpuReader(), curve=(channel.curve_publickey, *stranger)
    )
    plain = monitor.Sampler(endpoint, KEY, busy_hz=20, idle_hz=20, reader=CpuReader())
    for s in (sampler, intruder, plain):
        s.start()
    try:
        assert wait_for(lambda: len(store.samples()) >= 10, 5)
        sampler.stop()
        assert wait_for(lambda: all(s.sent + s.errors >= 5 for s in (intruder, plain)), 10)  # they tried
        time.sleep(0.5)  # a sample the allowed sampler sent just before its stop may still be on its way
        assert channel.received <= sampler.sent  # every sample let in came from it: none from the others,
        assert channel.dropped == 0  # not even as far as the signature check
    finally:
        for s in (sampler, intruder, plain):
            s.stop()
        channel.stop()
    assert not channel.running


# -- checkpoints saved on the engines reach the kernel's list (issue 17, item 5)


def _checkpoint(path: str = "/tmp/ckpt/step-4", **fields) -> dict:
    record = {"path": path, "step": 4, "strategy": "zero", "label": "ZeRO-2", "world_size": 2,
              "bytes": 123_456, "seconds": 0.25, "t": 1.7e9}
    return {**record, **fields}


def test_checkpoint_records_are_checked_like_samples():
    verifier, signer = protocol.Verifier(KEY), protocol.Signer(KEY)
    good = protocol.decode(verifier, [signer.packed(protocol.MSG_TYPE, protocol.checkpoint_content(
        {**_checkpoint(seconds=None), "junk": "x"}))])
    assert good.checkpoint == _checkpoint(seconds=None) and good.invalid == 0 and good.samples == []
    bad_fields = [
        {"path": ""}, {"path": 7}, {"path": "a\x00b"}, {"path": "x" * (protocol.MAX_PATH_CHARS + 1)},
        {"step": -1}, {"step": 1.0}, {"world_size": 0}, {"world_size": True}, {"bytes": "1"},
        {"seconds": float("nan")}, {"seconds": -1}, {"t": None}, {"strategy": ""}, {"label": None},
    ]
    for bad in bad_fields:
        decoded = protocol.decode(verifier, [signer.packed(protocol.MSG_TYPE, protocol.checkpoint_content(
            _checkpoint(**bad)))])
        assert decoded.checkpoint is None and decoded.invalid == 1, bad
    missing = {k: v for k, v in _checkpoint().items() if k != "bytes"}
    assert protocol.valid_checkpoint(missing) is None and protocol.valid_checkpoint([1]) is None


def test_the_store_keeps_one_checkpoint_per_path_newest_last(monkeypatch):
    from mpnb.monitoring import store as store_mod

    store = MemoryStore()
    assert store.checkpoints() == [] and store.checkpoints_version == 0
    store.add_checkpoint(_checkpoint("/a", step=1))
    store.add_checkpoint(_checkpoint("/b", step=2))
    store.add_checkpoint(_checkpoint("/a", step=3))  # saved again to the same path: one row, now newest
    assert [(c["path"], c["step"]) for c in store.checkpoints()] == [("/b", 2), ("/a", 3)]
    assert store.checkpoints_version == 3
    store.checkpoints()[0]["step"] = 99  # a copy: callers cannot change the store
    assert store.checkpoints()[0]["step"] == 2
    monkeypatch.setattr(store_mod, "MAX_CHECKPOINTS", 2)
    store.add_checkpoint(_checkpoint("/c", step=4))
    assert [c["path"] for c in store.checkpoints()] == ["/a", "/c"]  # the oldest is forgotten


def test_announce_checkpoint_goes_through_the_sampler_and_is_silent_without_one(tmp_path):
    """rank 0's announce -> the engine's sampler -> the signed channel -> the store, in this process."""
    import json

    from mpnb.engine.checkpoint.announce import announce_checkpoint
    from mpnb.planning.config import Config

    written = tmp_path / "step-4"
    written.mkdir()
    config = Config(strategy="zero", zero_stage=2).to_dict()
    (written / "mpnb.json").write_text(json.dumps({"config": config}))
    record = {"path": str(written), "step": 4, "strategy": "zero", "world_size": 2, "seconds": 0.5,
              "bytes": 4096}
    store = MemoryStore()
    channel = monitor_channel.MonitorChannel(store, KEY)
    endpoint = channel.start()
    monitor.start(endpoint, key=KEY, busy_hz=1, idle_hz=1, reader=CpuReader())
    try:
        before = time.time()
        announce_checkpoint(record)
        assert wait_for(lambda: store.checkpoints(), 3), "the checkpoint never reached the kernel's store"
        got = store.checkpoints()[0]
        assert {k: got[k] for k in record} == record
        assert got["label"] == "ZeRO-2" and before <= got["t"] <= time.time()
        announce_checkpoint({**record, "path": str(tmp_path / "gone"), "bytes": -1})  # dropped, not raised
        announce_checkpoint({**record, "path": str(tmp_path / "gone"), "step": 5})  # no manifest: plain name
        assert wait_for(lambda: len(store.checkpoints()) == 2, 3)
        assert store.checkpoints()[-1]["label"] == "zero" and channel.dropped == 0
    finally:
        assert monitor.stop()
        channel.stop()
    announce_checkpoint(record)  # no sampler (one process, no cluster): nothing to tell, nothing raised
    announce_checkpoint({"path": None})
    assert not state.announcements
