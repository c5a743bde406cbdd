"""Sharded checkpoints: `trainer.save` / `trainer.load` against `torch.save` / `torch.load` of the same bytes.

A 2-engine CPU cluster trains a tiny GPT made big enough that the disk dominates
(default n_embd 512, 6 layers: ~19 M parameters, ~113 MB of fp32 weights + AdamW
moments per rank under FSDP). On the same disk, in the same run:

- save: `trainer.save(dir)` against each rank `torch.save`-ing its own local shard
  tensors (the same bytes) to its own file, flushed and fsynced as DCP does its
  files; `dcp.save` of the same state alone is printed too (the floor under mpnb's
  save). Time is wall time from a barrier until every rank is done; MB/s per rank =
  this rank's shard bytes / that time. Reps alternate order; medians. Target >= 0.8.
- load: `trainer.load(dir)` against `torch.load` of those files, cold (each file's
  pages dropped from the page cache with posix_fadvise(DONTNEED) first; `fincore`
  confirms what stayed resident) and warm (read again straight after). Target >= 0.8.
- async save: N training steps while `trainer.save(dir, blocking=False)` writes, minus
  N steps without a save, as a fraction of a blocking save's time. Target <= 10%. The
  same for a plain `torch.save` of the same bytes on a thread shows this machine's floor.
- memory: the rise of this rank's RSS high-water mark (VmHWM, reset through
  /proc/self/clear_refs) during a blocking save, against the largest rank's shard
  bytes. Target <= 1x. An async save stages one CPU copy of the shard: reported apart.

Run under the cluster lock here (about 1-2 minutes):
    flock /tmp/mpnb-cluster.lock .venv/bin/python benchmarks/checkpoint.py [--strategy fsdp|zero3]
        [--n-embd 512] [--n-layer 6] [--reps 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "mpnb" / "torch_extensions"))

CONFIGS = {
    "fsdp": {"strategy": "fsdp", "micro_batch_size": 4},
    "zero3": {"strategy": "zero", "zero_stage": 3, "micro_batch_size": 4},
    "zero2": {"strategy": "zero", "zero_stage": 2, "micro_batch_size": 4},
    "ddp": {"strategy": "ddp", "micro_batch_size": 4},
}

# Runs on every engine. Each function returns this rank's numbers; rank 0's are printed.
ENGINE = """
import ctypes, os, shutil, subprocess, time, torch, mpnb
import torch.distributed as dist
from pathlib import Path
from mpnb.models import tiny_gpt, synthetic_batches
from mpnb.engine.checkpoint.writer import leaves, local_bytes
from mpnb.engine.checkpoint.reader import flat_keys

torch.manual_seed(0)
_net = tiny_gpt(0, n_embd={n_embd}, n_layer={n_layer}, n_head=8)
trainer = mpnb.prepare(_net, torch.optim.AdamW(_net.parameters(), lr=1e-3), config={config!r})
_batches = list(synthetic_batches(batch_size=8, steps=8, seed=0))
for _b in _batches[:2]:
    trainer.step(_b)  # AdamW's moments exist from the first step
ME = dist.get_rank()
ROOT = Path({root!r})


def _local(x):
    # what this rank holds of a state leaf, as a plain tensor: DTensor shard, ZeRO range, tensor
    if hasattr(x, "to_local"):
        return x.to_local()
    if hasattr(x, "flat"):
        return x.flat
    return x


def shard_tensors():
    return {{k: _local(v) for k, v in flat_keys(trainer.checkpoint_state()).items() if torch.is_tensor(v)}}


def shard_bytes():
    return sum(local_bytes(x) for x in leaves(trainer.checkpoint_state()) if hasattr(x, "shape"))


CPU = {{}}  # label -> this process's CPU seconds (all threads) per call


def timed(fn, label=None):
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if label:
        CPU.setdefault(label, []).append(time.process_time() - c0)
    dist.barrier()  # until every rank is done: the save is not usable before
    return time.perf_counter() - t0


def torch_save(path, fsync=True, tensors=None):
    with open(path, "wb") as f:
        torch.save(shard_tensors() if tensors is None else tensors, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def files_of(path):
    path = Path(path)
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def evict(path):
    # drop the files' pages from the page cache (they are clean: fsynced), so a read hits the disk
    for p in files_of(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(path):
    # fraction of the files' bytes in the page cache (fincore), None where fincore is missing
    files = files_of(path)
    if not shutil.which("fincore") or not files:
        return None
    out = subprocess.run(["fincore", "-b", "-n", "-r", "-o", "RES,SIZE", *map(str, files)],
                         capture_output=True, text=True, check=True).stdout.split()
    res, size = sum(map(int, out[0::2])), sum(map(int, out[1::2]))
    return res / max(size, 1)


def du(path):
    return sum(p.stat().st_size for p in files_of(path))


def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def hwm_rise(fn):
    # rise of the resident-set high-water mark while fn runs (clear_refs 5 resets VmHWM to VmRSS)
    dist.barrier()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back first: RSS then starts from what is live
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


def dcp_save(path):
    # torch.distributed.checkpoint alone, as mpnb calls it: the floor under trainer.save
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter, save
    from mpnb.engine.checkpoint.writer import WRITE_THREADS
    state = trainer.checkpoint_state()
    state.get("optim", {{}}).pop("param_groups", None)
    save(state, storage_writer=FileSystemWriter(path, thread_count=WRITE_THREADS),
         planner=DefaultSavePlanner(enable_plan_caching=True))


def bench_save_load(reps):
    out = {{"bytes": shard_bytes(), "mpnb_save": [], "torch_save": [], "torch_save_nosync": [],
           "dcp_save": [], "mpnb_load_cold": [], "torch_load_cold": [], "mpnb_load_warm": [],
           "torch_load_warm": [], "resident_cold": [], "resident_warm": []}}
    for rep in range(reps):
        ck, pt = ROOT / f"ck{{rep}}", ROOT / f"pt{{rep}}-rank{{ME}}.pt"
        sides = ("mpnb", "torch") if rep % 2 == 0 else ("torch", "mpnb")
        for side in sides:
            if side == "mpnb":
                out["mpnb_save"].append(timed(lambda: trainer.save(ck), "mpnb_save"))
            else:
                out["torch_save"].append(timed(lambda: torch_save(pt), "torch_save"))
        out["torch_save_nosync"].append(timed(lambda: torch_save(ROOT / f"ns{{rep}}-rank{{ME}}.pt", False)))
        out["dcp_save"].append(timed(lambda: dcp_save(ROOT / f"dcp{{rep}}")))
        out["mpnb_files"] = du(ck) / dist.get_world_size()  # per rank: the directory holds every rank's
        out["torch_file"] = du(pt)
        for side in sides:  # cold, then warm straight after
            files = ck if side == "mpnb" else pt
            for temp in ("cold", "warm"):
                if temp == "cold" and (side == "torch" or ME == 0):
                    evict(files)
                dist.barrier()
                out[f"resident_{{temp}}"].append(resident(files))
                if side == "mpnb":
                    out[f"mpnb_load_{{temp}}"].append(timed(lambda: trainer.load(ck)))
                else:
                    out[f"torch_load_{{temp}}"].append(
                        timed(lambda: torch.load(pt, weights_only=True, map_location="cpu")))
        dist.barrier()
        if ME == 0:
            shutil.rmtree(ck)
            shutil.rmtree(ROOT / f"dcp{{rep}}")
        for p in (pt, ROOT / f"ns{{rep}}-rank{{ME}}.pt"):
            p.unlink()
    out["cpu"] = {{k: sorted(v)[len(v) // 2] for k, v in CPU.items()}}
    return out


def steps_time(n, save_to=None):
    dist.barrier()
    t0 = time.perf_counter()
    handle = trainer.save(save_to, blocking=False) if save_to is not None else None
    returned = time.perf_counter() - t0
    for i in range(n):
        trainer.step(_batches[i % len(_batches)])
    dt = time.perf_counter() - t0
    done = handle.done if handle is not None else True
    if handle is not None:
        handle.wait()
    dist.barrier()
    return dt, returned, done


def steps_beside_torch_save(n, path):
    # the floor: the same bytes staged the same way, written by a plain torch.save on a thread
    import threading
    dist.barrier()
    t0 = time.perf_counter()
    staged = {{k: v.detach().clone() for k, v in shard_tensors().items()}}
    writer = threading.Thread(target=torch_save, args=(path, True, staged))
    writer.start()
    for i in range(n):
        trainer.step(_batches[i % len(_batches)])
    dt = time.perf_counter() - t0
    writer.join()
    dist.barrier()
    return dt


def bench_async(reps, blocking_save):
    t1 = steps_time(2)[0] / 2
    n = max(3, min(40, int(2 * blocking_save / t1) + 1))  # long enough to cover the background write
    out = {{"n": n, "plain": [], "overlap": [], "returned": [], "done": [], "torch_overlap": [],
           "torch_blocking": []}}
    for rep in range(reps):
        for side in ("plain", "overlap", "torch") if rep % 2 == 0 else ("torch", "overlap", "plain"):
            if side == "plain":
                out["plain"].append(steps_time(n)[0])
            elif side == "torch":
                out["torch_overlap"].append(steps_beside_torch_save(n, ROOT / f"bg{{rep}}-rank{{ME}}.pt"))
                out["torch_blocking"].append(timed(lambda: torch_save(ROOT / f"bg{{rep}}-rank{{ME}}.pt")))
                (ROOT / f"bg{{rep}}-rank{{ME}}.pt").unlink()
            else:
                dt, returned, done = steps_time(n, ROOT / f"async{{rep}}")
                out["overlap"].append(dt)
                out["returned"].append(returned)
                out["done"].append(done)
    dist.barrier()
    if ME == 0:
        for rep in range(reps):
            shutil.rmtree(ROOT / f"async{{rep}}")
    return out


def bench_memory():
    out = {{"blocking": hwm_rise(lambda: trainer.save(ROOT / "mem-b")),
           "async": hwm_rise(lambda: trainer.save(ROOT / "mem-a", blocking=False).wait()),
           "torch_save": hwm_rise(lambda: torch_save(ROOT / f"mem-{{ME}}.pt")),
           "largest_tensor": max(local_bytes(x) for x in leaves(trainer.checkpoint_state())
                                 if hasattr(x, "shape")),
           "staging_kept": sum(local_bytes(t) for t in trainer.staging_buffers.values())}}
    dist.barrier()
    if ME == 0:
        shutil.rmtree(ROOT / "mem-b")
        shutil.rmtree(ROOT / "mem-a")
    (ROOT / f"mem-{{ME}}.pt").unlink()
    return out
"""


def run(sess, call: str) -> list[dict]:
    """`call` on every engine; each rank's result, in rank order."""
    sess.view().execute(f"_result = {call}", block=True).get()
    return [sess.view().pull("_result", targets=sess.engine_id(r), block=True) for r in range(2)]


def mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--strategy", choices=list(CONFIGS), default="fsdp")
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement (median)")
    parser.add_argument(
        "--no-monitor", action="store_true", help="stop the memory sampler (isolates its cost)"
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir under /tmp)")
    args = parser.parse_args()

    import mpnb

    root = Path(tempfile.mkdtemp(prefix="mpnb-ckpt-bench-", dir=args.dir))
    sess = mpnb.start(n=2, verbose=False)
    try:
        view = sess.view()
        code = ENGINE.format(n_embd=args.n_embd, n_layer=args.n_layer, config=CONFIGS[args.strategy],
                             root=str(root))
        view.execute(code, block=True).get()
        if args.no_monitor:
            view.execute("from mpnb.engine import monitor; monitor.stop()", block=True).get()
        print("engines ready, measuring save/load", file=sys.stderr, flush=True)
        io = run(sess, f"bench_save_load({args.reps})")
        blocking = statistics.median(io[0]["mpnb_save"])
        print("measuring async save", file=sys.stderr, flush=True)
        ov = run(sess, f"bench_async({args.reps}, {blocking})")
        print("measuring memory", file=sys.stderr, flush=True)
        mem = run(sess, "bench_memory()")
    finally:
        mpnb.stop()
        shutil.rmtree(root, ignore_errors=True)
    report(args, io, ov, mem)


def report(args: argparse.Namespace, io: list[dict], ov: list[dict], mem: list[dict]) -> None:
    med = statistics.median
    r0 = io[0]
    size = r0["bytes"]
    print(f"checkpoint benchmark: tiny GPT n_embd {args.n_embd}, {args.n_layer} layers, AdamW, "
          f"{args.strategy}, 2 CPU ranks; shard per rank {mb(io[0]['bytes'])} / {mb(io[1]['bytes'])} "
          f"(weights + moments); files per rank: mpnb {mb(r0['mpnb_files'])}, "
          f"torch.save {mb(r0['torch_file'])}; "
          f"medians of {args.reps}, rank 0; memory monitor {'off' if args.no_monitor else 'on'}")

    def rate(key: str) -> float:
        return size / med(r0[key]) / 1e6

    cold = [x for x in r0["resident_cold"] if x is not None]
    warm = [x for x in r0["resident_warm"] if x is not None]
    cold_note = f"{max(cold) * 100:.0f}% resident" if cold else "residency unknown (no fincore)"
    warm_note = f"{min(warm) * 100:.0f}% resident" if warm else "residency unknown"
    print(f"{'':<34} {'mpnb':>10} {'torch':>10} {'ratio':>6}")
    rows = [
        ("save (fsynced, MB/s per rank)", "mpnb_save", "torch_save", True),
        (f"load cold ({cold_note})", "mpnb_load_cold", "torch_load_cold", True),
        (f"load warm ({warm_note})", "mpnb_load_warm", "torch_load_warm", False),
    ]
    results = []
    for label, a, b, target in rows:
        ratio = rate(a) / rate(b)
        mark = f"  {verdict(ratio >= 0.8)} (>= 0.8)" if target else "  (info)"
        results.append(ratio >= 0.8 if target else True)
        print(f"{label:<34} {rate(a):>10.0f} {rate(b):>10.0f} {ratio:>6.2f}{mark}")
    nosync = rate("torch_save_nosync")
    print("  cold = dropped from this machine's page cache (a virtual disk may still be cached by its host)")
    print(f"{'  torch.save without fsync':<34} {'':>10} {nosync:>10.0f}  (info: page cache only)")
    dcp = rate("dcp_save")
    print(f"{'  dcp.save alone (fsynced)':<34} {dcp:>10.0f} {rate('torch_save'):>10.0f} "
          f"{dcp / rate('torch_save'):>6.2f}  (info: the library under trainer.save; "
          f"mpnb = {rate('mpnb_save') / dcp:.2f} of it)")
    cpu = r0["cpu"]
    print(f"  CPU s per save (this engine, all threads): mpnb {cpu['mpnb_save']:.3f}, "
          f"torch.save {cpu['torch_save']:.3f}")
    print(f"  times s: mpnb save {med(r0['mpnb_save']):.3f}, torch.save {med(r0['torch_save']):.3f}, "
          f"mpnb load cold {med(r0['mpnb_load_cold']):.3f}, torch.load cold {med(r0['torch_load_cold']):.3f}")

    o = ov[0]
    blocking = med(r0["mpnb_save"])
    plain, overlap = med(o["plain"]), med(o["overlap"])
    cost = (overlap - plain) / blocking
    print(f"async save: {o['n']} steps {plain:.3f} s alone, {overlap:.3f} s with a background save "
          f"(save() returned after {med(o['returned']):.3f} s, write done within the steps: "
          f"{sum(o['done'])}/{len(o['done'])}); blocking save {blocking:.3f} s")
    print(f"  cost to the loop: {overlap - plain:+.3f} s = {cost * 100:.1f}% of a blocking save  "
          f"{verdict(cost <= 0.10)} (<= 10%); the CPU copy made before save() returns is "
          f"{med(o['returned']) / blocking * 100:.0f}% of it alone")
    paired = sorted(b - a for a, b in zip(o["plain"], o["overlap"], strict=True))
    print(f"  noise: the cost within each rep {paired[0]:+.3f} .. {paired[-1]:+.3f} s; the steps alone "
          f"{min(o['plain']):.3f} .. {max(o['plain']):.3f} s")
    results.append(cost <= 0.10)
    floor_s = med(o["torch_overlap"]) - plain
    print(f"  this machine's floor: a plain torch.save of the same bytes on a thread, staged the same way, "
          f"costs the loop {floor_s:+.3f} s = {floor_s / med(o['torch_blocking']) * 100:.0f}% of a blocking "
          "torch.save (info)")
    floor = r0["cpu"]["mpnb_save"] / blocking
    print(f"  a save's own CPU time is {floor * 100:.0f}% of its wall time; with every core busy training "
          "(CPU ranks), that CPU time comes out of the loop whichever thread spends it")

    largest = max(r["bytes"] for r in io)
    print(f"peak extra RSS (VmHWM rise), largest shard {mb(largest)}:")
    for rank, m in enumerate(mem):
        ratio = m["blocking"] / largest
        print(f"  rank {rank}: blocking save {mb(m['blocking'])} = {ratio:.2f}x  "
              f"{verdict(ratio <= 1.0)} (<= 1x); "
              f"async save {mb(m['async'])} = {m['async'] / largest:.2f}x + {mb(m['staging_kept'])} kept "
              "from the previous one (its CPU copy: info); "
              f"torch.save {mb(m['torch_save'])}; largest tensor {mb(m['largest_tensor'])}")
        results.append(ratio <= 1.0)
    print(f"overall: {verdict(all(results))}")


if __name__ == "__main__":
    main()
