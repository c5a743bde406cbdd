"""Checks of the memory monitor's real GPU path, for a machine with NVIDIA GPUs.

The test suite fakes CUDA and NVML behind the readers' narrow interface; this
script runs the real ones and compares them with the driver's own view:

1. the readers in this process: torch.cuda.memory_stats and NVML against a known allocation
2. a cluster of one engine per GPU with NCCL: an all_reduce gives the right sum
3. samples from every rank reach the kernel with device_kind "cuda", and a 1 GiB
   allocation on rank 0 shows in `used`, `reserved` and `peak`
4. the chart's `device_used` (NVML, per rank) against `nvidia-smi --query-gpu=memory.used`
5. an out-of-memory error on rank 0 raises `oom_count`
6. a ZeRO-2 Trainer on the GPUs: its breakdown arrives in the samples, near mpnb.estimate

    .venv/bin/python benchmarks/gpu_check.py

Prints one PASS/FAIL line per check; exits 1 if any failed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

GiB = 2**30
MiB = 2**20
results: list[tuple[str, bool, str]] = []


def check(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def wrap(fn: Callable[[], str]) -> Callable[[], str]:
        try:
            detail = fn()
            results.append((name, True, detail))
            print(f"PASS {name}: {detail}", flush=True)
        except Exception as exc:
            results.append((name, False, repr(exc)))
            print(f"FAIL {name}: {exc!r}", flush=True)
            traceback.print_exc()
        return fn

    return wrap


def nvidia_smi_used_bytes() -> dict[int, int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    used = {}
    for line in out.strip().splitlines():
        index, mib = (v.strip() for v in line.split(","))
        used[int(index)] = int(mib) * MiB
    return used


def latest_after(store: Any, rank: int, t: float, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        samples = [s for s in store.samples(rank) if s["t"] > t]
        if samples:
            return samples[-1]
        time.sleep(0.05)
    raise TimeoutError(f"no sample from rank {rank} after t={t:.2f}")


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("FAIL no CUDA device visible to torch; run this on a GPU machine")
        return 1
    if shutil.which("nvidia-smi") is None:
        print("FAIL nvidia-smi not on PATH")
        return 1
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")

    @check("readers in this process (torch.cuda.memory_stats, NVML)")
    def _() -> str:
        from mpnb.engine.readers import make_reader

        reader = make_reader("cuda:0")
        before = reader.read()
        block = torch.empty(GiB, dtype=torch.uint8, device="cuda:0")
        during = reader.read()
        assert during.device_kind == "cuda"
        assert during.used - before.used >= GiB, (before, during)
        assert during.reserved >= during.used and during.peak >= during.used
        assert during.device_used is not None, "NVML gave no device reading"
        assert during.device_used >= during.reserved, "NVML must see at least what torch reserved"
        assert during.capacity >= 8 * GiB
        del block
        torch.cuda.empty_cache()
        return (
            f"used +{(during.used - before.used) / GiB:.2f} GiB, NVML used {during.device_used / GiB:.2f}"
            f" of {during.capacity / GiB:.1f} GiB"
        )

    import mpnb

    sess = mpnb.start(verbose=True)  # one engine per visible GPU, NCCL
    try:
        store = sess.memory
        n = sess.world_size

        @check("NCCL process group over the engines")
        def _() -> str:
            assert sess.backend == "nccl", sess.backend
            code = (
                "t = torch.full((4,), float(rank + 1), device=device)\n"
                "dist.all_reduce(t)\n"
                "_sum = t[0].item()\n"
            )
            sess.view().execute(code, block=True).get()
            sums = sess.view().pull("_sum", block=True)
            expected = n * (n + 1) / 2
            assert all(s == expected for s in sums), sums
            return f"{n} ranks, all_reduce sum {expected:g} on every rank"

        @check("CUDA samples from every rank; a 1 GiB allocation shows")
        def _() -> str:
            assert sess.monitor_channel.running
            before = {r: latest_after(store, r, time.time() - 2) for r in range(n)}
            assert all(s["device_kind"] == "cuda" for s in before.values()), before
            code = "if rank == 0:\n    _block = torch.empty(2**30, dtype=torch.uint8, device=device)\n"
            sess.view().execute(code, block=True).get()
            after = latest_after(store, 0, time.time())
            grew = after["used"] - before[0]["used"]
            assert grew >= GiB * 0.99, (before[0], after)
            assert after["reserved"] >= after["used"] and after["peak"] >= after["used"]
            return f"rank 0 used +{grew / GiB:.2f} GiB, reserved {after['reserved'] / GiB:.2f} GiB"

        @check("chart's NVML device_used vs nvidia-smi memory.used")
        def _() -> str:
            t = time.time()
            samples = {r.rank: latest_after(store, r.rank, t) for r in sess.ranks}
            smi = nvidia_smi_used_bytes()
            lines = []
            for info in sess.ranks:
                ours, theirs = samples[info.rank]["device_used"], smi[info.gpu]
                assert ours is not None
                # both read the same counter a moment apart; allow 2% or 256 MiB of drift
                assert abs(ours - theirs) <= max(0.02 * theirs, 256 * MiB), (info, ours, theirs)
                lines.append(f"GPU {info.gpu}: ours {ours / MiB:.0f} MiB, nvidia-smi {theirs / MiB:.0f} MiB")
            return "; ".join(lines)

        @check("an out-of-memory error raises oom_count")
        def _() -> str:
            before = latest_after(store, 0, time.time() - 2)["oom_count"]
            code = (
                "if rank == 0:\n"
                "    try:\n"
                "        torch.empty(1 << 50, dtype=torch.uint8, device=device)\n"
                "    except torch.cuda.OutOfMemoryError:\n"
                "        pass\n"
            )
            sess.view().execute(code, block=True).get()
            after = latest_after(store, 0, time.time())["oom_count"]
            assert after == before + 1, (before, after)
            return f"oom_count {before} -> {after}"

        @check("ZeRO-2 Trainer breakdown in the samples vs mpnb.estimate")
        def _() -> str:
            from mpnb.models import tiny_gpt
            from mpnb.planning.config import Config
            from mpnb.planning.estimator import estimate

            cfg = Config(strategy="zero", zero_stage=2, micro_batch_size=4)
            code = (
                "_block = None\n"
                "from mpnb.models import tiny_gpt, synthetic_batches\n"
                "model = tiny_gpt(n_embd=256, n_layer=6).to(device)\n"
                "trainer = mpnb.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "
                f"config={cfg.to_dict()!r})\n"
                f"for batch in synthetic_batches(batch_size={4 * n}, steps=3):\n"
                "    trainer.step(batch)\n"
            )
            sess.view().execute(code, block=True).get()
            predicted = estimate(tiny_gpt(n_embd=256, n_layer=6), cfg, n)
            t = time.time()
            lines = []
            for rank in range(n):
                sample = latest_after(store, rank, t)
                for category in ("parameters", "gradients", "optimizer"):
                    want = getattr(predicted.ranks[rank], category)
                    got = sample[category]
                    assert abs(got - want) <= 0.1 * want, (rank, category, got, want)
                lines.append(f"rank {rank} optimizer {sample['optimizer'] / MiB:.1f} MiB")
            assert store.estimate is not None
            return "; ".join(lines)

        report = mpnb.memory_report()
        print(repr(report))
    finally:
        mpnb.stop()

    failed = [name for name, ok, _ in results if not ok]
    print(f"\n{len(results) - len(failed)}/{len(results)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
