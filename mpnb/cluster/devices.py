"""Which GPUs this machine has, without importing torch.

Discovery goes through one narrow seam, `probe`: NVML first (nvidia-ml-py), then
`nvidia-smi`, else no GPUs. Tests replace `probe` with a fake (`set_probe`), so
device validation can be exercised on a CPU-only machine. Used in the notebook
kernel (to plan a cluster) and on engines (to report what each host can see).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    index: int  # physical index, as NVML and nvidia-smi number it
    name: str
    memory_total: int  # bytes


def _nvml_gpus() -> list[Gpu] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: NVMLError_LibraryNotFound / DriverNotLoaded
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            gpus.append(Gpu(i, name, int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def _smi_gpus() -> list[Gpu] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.strip().splitlines():
        index, name, mem_mib = (part.strip() for part in line.split(","))
        gpus.append(Gpu(int(index), name, int(float(mem_mib)) * 2**20))
    return gpus


def _system_gpus() -> list[Gpu]:
    for source in (_nvml_gpus, _smi_gpus):
        found = source()
        if found is not None:
            return found
    return []


# The seam tests replace: () -> every GPU installed in this machine.
probe: Callable[[], list[Gpu]] = _system_gpus


def set_probe(new_probe: Callable[[], list[Gpu]] | None) -> None:
    """Replace GPU discovery (tests); None restores the real probe."""
    global probe
    probe = new_probe or _system_gpus


def visible_gpus() -> list[Gpu]:
    """GPUs this process may use: all of them, filtered by CUDA_VISIBLE_DEVICES when set."""
    gpus = probe()
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return gpus
    by_index = {g.index: g for g in gpus}
    visible = []
    for item in mask.split(","):
        item = item.strip()
        if item.isdigit() and int(item) in by_index:
            visible.append(by_index[int(item)])
        elif not item.isdigit():
            break  # UUIDs or an empty/-1 mask: CUDA stops at the first entry it cannot parse
    return visible
