"""Memory readers and the signed side channel in this process, without engines.

CUDA and NVML are the only fakes; the real path runs in benchmarks/gpu_check.py.
"""

from __future__ import annotations

import pytest

from mpnb.engine import monitor
from mpnb.engine.readers import CpuReader, CudaReader, MemoryReading
from mpnb.monitoring import channel as monitor_channel
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
