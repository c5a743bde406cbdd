"""Read one rank's device memory: CPU, CUDA and NVML behind one small interface.

The sampler thread (`mpnb.engine.monitor`) only ever calls `read()` and
`reset_peak()` on a `MemoryReader`. CUDA and NVML are reached through two narrow
protocols (`CudaApi`, `NvmlApi`) so that tests can substitute a fake for the
hardware; the real implementations import torch / pynvml lazily.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class MemoryReading:
    """Device memory at one instant, in bytes (the device half of a sample)."""

    device_kind: str  # "cpu" | "cuda"
    used: int  # CUDA allocated, or process RSS on CPU
    reserved: int  # CUDA caching-allocator reserved; = used on CPU
    peak: int  # peak of `used` since the last reset_peak()
    capacity: int  # device total memory, or machine RAM; 0 if unknown
    device_used: int | None  # NVML used (all processes on the GPU); None on CPU
    oom_count: int


class MemoryReader(Protocol):
    def read(self) -> MemoryReading: ...

    def reset_peak(self) -> None: ...


# ---------------------------------------------------------------------------- CPU


class CpuReader:
    """Process RSS; its peak from the kernel's VmHWM, which `reset_peak` clears.

    VmHWM catches spikes between two samples. On Linux both numbers come from one
    pread of /proc/self/status (a single syscall: the sampler must not steal time
    from training); elsewhere psutil gives RSS and the peak is the largest RSS
    this reader has seen since the last reset.
    """

    _STATUS = "/proc/self/status"
    _CLEAR_REFS = "/proc/self/clear_refs"

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self._capacity = int(psutil.virtual_memory().total)
        self._seen_peak = 0
        try:
            self._status_fd: int | None = os.open(self._STATUS, os.O_RDONLY)
        except OSError:
            self._status_fd = None

    def _rss_and_hwm(self) -> tuple[int, int]:
        if self._status_fd is not None:
            try:
                text = _read_holding_gil(self._status_fd)
                return _status_kib(text, b"VmRSS:") * 1024, _status_kib(text, b"VmHWM:") * 1024
            except (OSError, ValueError):
                self._status_fd = None
        return int(self._process.memory_info().rss), 0

    def read(self) -> MemoryReading:
        rss, hwm = self._rss_and_hwm()
        self._seen_peak = max(self._seen_peak, rss)
        peak = max(self._seen_peak, hwm)
        return MemoryReading("cpu", rss, rss, peak, self._capacity, None, 0)

    def reset_peak(self) -> None:
        self._seen_peak = 0
        try:
            with open(self._CLEAR_REFS, "w") as f:
                f.write("5")  # "5" resets the resident-set high-water mark (Linux >= 4.0)
        except OSError:
            pass

    def close(self) -> None:
        if self._status_fd is not None:
            os.close(self._status_fd)
            self._status_fd = None


_STATUS_BUFFER = 16384
_pread: Any = None
_buffer: Any = None


def _read_holding_gil(fd: int) -> bytes:
    """pread(fd) without releasing the GIL (libc through ctypes.PyDLL), else os.pread.

    Every GIL release in the sampler lets the training thread take the GIL, and
    taking it back forces a switch that, on a crowded CPU, can cost the training
    thread milliseconds. Reading /proc takes microseconds: holding the GIL is cheaper.
    """
    global _pread, _buffer
    if _pread is None:
        try:
            import ctypes

            libc_pread = ctypes.PyDLL(None, use_errno=True).pread
            libc_pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
            libc_pread.restype = ctypes.c_ssize_t
            _buffer = ctypes.create_string_buffer(_STATUS_BUFFER)

            def read(fd: int) -> bytes:
                n = libc_pread(fd, _buffer, _STATUS_BUFFER, 0)
                if n < 0:
                    raise OSError(ctypes.get_errno(), "pread failed")
                return ctypes.string_at(_buffer, n)

            _pread = read
        except (OSError, AttributeError):
            _pread = lambda fd: os.pread(fd, _STATUS_BUFFER, 0)  # noqa: E731
    return _pread(fd)


def _status_kib(text: bytes, field: bytes) -> int:
    start = text.index(field) + len(field)
    return int(text[start : text.index(b"kB", start)])


# --------------------------------------------------------------------------- CUDA


class CudaApi(Protocol):
    """The three calls the CUDA reader needs from torch.cuda."""

    def memory_stats(self, device: int) -> dict[str, Any]: ...

    def reset_peak_memory_stats(self, device: int) -> None: ...

    def total_memory(self, device: int) -> int: ...


class NvmlApi(Protocol):
    """Device-wide memory as the driver sees it (what nvidia-smi shows)."""

    def device_memory(self) -> tuple[int, int]:  # (used, total) bytes
        ...


class TorchCudaApi:
    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda

    def memory_stats(self, device: int) -> dict[str, Any]:
        return self._cuda.memory_stats(device)

    def reset_peak_memory_stats(self, device: int) -> None:
        self._cuda.reset_peak_memory_stats(device)

    def total_memory(self, device: int) -> int:
        return int(self._cuda.get_device_properties(device).total_memory)


class PynvmlApi:
    """NVML handle for the GPU that this process's CUDA device `index` is.

    NVML ignores CUDA_VISIBLE_DEVICES, so the handle is found by the device UUID
    that torch reports, falling back to the visible-devices list, then the index.
    """

    def __init__(self, index: int) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handle = self._find_handle(index)

    def _find_handle(self, index: int) -> Any:
        nvml = self._nvml
        try:
            import torch

            uuid = str(torch.cuda.get_device_properties(index).uuid)
            return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except Exception:
            pass
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if index < len(visible):
            entry = visible[index]
            if entry.isdigit():
                return nvml.nvmlDeviceGetHandleByIndex(int(entry))
            return nvml.nvmlDeviceGetHandleByUUID(entry)
        return nvml.nvmlDeviceGetHandleByIndex(index)

    def device_memory(self) -> tuple[int, int]:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return int(info.used), int(info.total)


class CudaReader:
    """torch's caching-allocator counters for one device, plus NVML's device view.

    `used` is what tensors hold (allocated); `reserved` what the allocator took
    from the driver; `device_used` what the whole GPU has in use (other processes
    and the CUDA context included), which is what nvidia-smi reports.
    """

    def __init__(self, index: int, cuda: CudaApi, nvml: NvmlApi | None) -> None:
        self._index = index
        self._cuda = cuda
        self._nvml = nvml
        self._total = int(cuda.total_memory(index))

    def read(self) -> MemoryReading:
        stats = self._cuda.memory_stats(self._index)
        used = int(stats.get("allocated_bytes.all.current", 0))
        device_used: int | None = None
        capacity = self._total
        if self._nvml is not None:
            try:
                device_used, total = self._nvml.device_memory()
                capacity = total or capacity
            except Exception:  # a driver hiccup must not kill the sampler
                device_used = None
        return MemoryReading(
            device_kind="cuda",
            used=used,
            reserved=int(stats.get("reserved_bytes.all.current", 0)),
            peak=max(used, int(stats.get("allocated_bytes.all.peak", 0))),
            capacity=capacity,
            device_used=device_used,
            oom_count=int(stats.get("num_ooms", 0)),
        )

    def reset_peak(self) -> None:
        self._cuda.reset_peak_memory_stats(self._index)


def make_reader(device: str) -> MemoryReader:
    """The reader for an engine's device string ("cpu" or "cuda:N")."""
    if not device.startswith("cuda"):
        return CpuReader()
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    try:
        nvml: NvmlApi | None = PynvmlApi(index)
    except Exception:  # no NVML library or driver: torch's numbers alone still work
        nvml = None
    return CudaReader(index, TorchCudaApi(), nvml)
