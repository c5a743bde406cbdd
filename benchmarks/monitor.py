"""Overhead of the memory monitor: training step time with the sampler at 10 Hz vs off.

Same cluster, same model, same batches, one sampler per engine that is paused and
resumed in short alternating blocks (ABBA), so that the noise of a shared machine
hits both sides alike. A DDP trainer is active, so samples also carry its
`memory_breakdown()`. Also prints the sampler thread's own CPU time, a number
that the machine's load does not disturb, the cost of one read of the bytes-sent
counter each sample carries, and the bytes it counts per DDP step against the
ring all-reduce's 2(N-1)/N x 4 bytes x parameters.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python benchmarks/monitor.py [--blocks 40]

Prints the step times of each side and their ratio (target: <= 1.01).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import mpnb
from mpnb.engine import monitor
from mpnb.monitoring import channel as monitor_channel

SETUP = """
import time, torch, mpnb
import torch.distributed as dist
from mpnb.engine import monitor
from mpnb.models import tiny_gpt, synthetic_batches
model = tiny_gpt(n_embd={n_embd}, n_layer=4, seq_len=64)
trainer = mpnb.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config={{"strategy": "ddp"}})
batches = list(synthetic_batches(seq_len=64, batch_size=16, steps=8))
for b in batches[:3]:
    trainer.step(b)  # warm up: optimizer state, allocator, autograd caches

def bench(endpoint, blocks, steps):
    # One sampler for the whole run, paused and resumed in short alternating blocks (ABBA), so
    # that the load of a shared machine falls on both sides alike and start-up is not counted.
    times = {{"on": [], "off": [], "sampler_cpu": 0.0, "on_wall": 0.0, "cpu_on": 0.0, "cpu_off": 0.0}}
    monitor.start(endpoint, busy_hz=10.0, idle_hz=10.0)
    time.sleep(0.5)  # first samples, the estimate for the trainer, reader set-up
    for block in range(blocks):
        for side in (("on", "off") if block % 2 == 0 else ("off", "on")):
            monitor.pause(side == "off")
            dist.barrier()
            cpu0, w0, p0 = monitor.status()["cpu_seconds"], time.perf_counter(), time.process_time()
            for i in range(steps):
                t0 = time.perf_counter()
                trainer.step(batches[i % len(batches)])
                times[side].append(time.perf_counter() - t0)
            times["cpu_" + side] += time.process_time() - p0  # all threads of this engine
            if side == "on":
                times["on_wall"] += time.perf_counter() - w0
                times["sampler_cpu"] += monitor.status()["cpu_seconds"] - cpu0
    monitor.stop()
    return times

def comm_check(steps=5, reads=2000):
    from mpnb.engine import state
    counter = state.comm_counter
    dist.barrier()
    before = counter.sent()
    for i in range(steps):
        trainer.step(batches[i % len(batches)])
    dist.barrier()
    time.sleep(0.2)  # acks trail the last send
    per_step = (counter.sent() - before) / steps
    t0 = time.perf_counter()
    for _ in range(reads):
        counter.sent()
    read_us = (time.perf_counter() - t0) / reads * 1e6
    n = dist.get_world_size()
    ring = 2 * (n - 1) / n * 4 * sum(p.numel() for p in model.parameters())
    return {{"per_step": per_step, "ring": ring, "read_us": read_us}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=40, help="on/off block pairs")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--n-embd", type=int, default=128)
    args = parser.parse_args()

    sess = mpnb.start(n=2, verbose=False)
    try:
        channel = getattr(sess, "monitor_channel", None) or monitor_channel.attach(sess)
        view = sess.view()
        view.execute(SETUP.format(n_embd=args.n_embd), block=True).get()
        before, t0 = channel.received, time.time()
        view.execute(f"_times = bench({channel.endpoint!r}, {args.blocks}, {args.steps})", block=True).get()
        elapsed = time.time() - t0
        received = channel.received - before
        times = view.pull("_times", targets=sess.engine_id(0), block=True)
        view.execute("_comm = comm_check()", block=True).get()
        comm = view.pull("_comm", targets=sess.engine_id(0), block=True)
        view.apply_sync(monitor.start, channel.endpoint)  # back to the defaults
    finally:
        mpnb.stop()

    on, off = times["on"], times["off"]
    n = args.steps
    block_ratios = [
        statistics.mean(on[i : i + n]) / statistics.mean(off[i : i + n]) for i in range(0, len(on), n)
    ]
    on_time = sum(on)
    print(f"{len(on)} steps each side, {args.blocks} alternating blocks of {n} steps, 2 ranks, DDP")
    for side, values in (("off", off), ("on", on)):
        mean, median = statistics.mean(values) * 1e3, statistics.median(values) * 1e3
        print(f"step time, monitor {side:3s}: mean {mean:.2f} ms, median {median:.2f} ms")
    print(
        f"samples received: {received} in {elapsed:.0f} s; at 10 Hz while on expect ~{2 * 10 * on_time:.0f}"
    )
    ratio = statistics.mean(on) / statistics.mean(off)
    print(
        f"overhead ratio on/off: mean {ratio:.4f}, median of steps "
        f"{statistics.median(on) / statistics.median(off):.4f}, "
        f"median of block pairs {statistics.median(block_ratios):.4f}"
    )
    cpu_ratio = times["cpu_on"] / times["cpu_off"]
    print(f"engine CPU time per step (all threads) on/off: {cpu_ratio:.4f}")
    share = times["sampler_cpu"] / times["on_wall"]
    print(
        f"sampler thread CPU time: {share * 100:.3f}% of the wall time while on (its own cost, free of noise)"
    )
    print(f"target <= 1.01: {'met' if statistics.median(block_ratios) <= 1.01 else 'NOT met'}")
    print(
        f"bytes sent per DDP step, counted: {comm['per_step']:,.0f}; ring all-reduce of the gradients: "
        f"{comm['ring']:,.0f} ({comm['per_step'] / comm['ring']:.3f}x); one read of the counter: "
        f"{comm['read_us']:.0f} us"
    )


if __name__ == "__main__":
    main()
