"""Plain torch.distributed collectives on gloo, as a torchrun script.

    torchrun --nproc_per_node 2 collectives.py --size 4 --rounds 2
"""

import argparse
import os

import torch
import torch.distributed as dist

from payload import describe, make_payload


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="gloo collectives smoke test")
    parser.add_argument("--size", type=int, default=4, help="elements per tensor")
    parser.add_argument("--rounds", type=int, default=2, help="how many times to repeat the collectives")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    print(f"rank {rank}: world {world_size} local_rank {local_rank} backend {dist.get_backend()}")

    for r in range(args.rounds):
        x = make_payload(rank, args.size, args.seed + r)
        summed = x.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        print(f"rank {rank}: round {r} all_reduce sum {describe(summed)}")

        biggest = x.clone()
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
        print(f"rank {rank}: round {r} all_reduce max {describe(biggest)}")

        gathered = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(gathered, x)
        print(f"rank {rank}: round {r} all_gather {' | '.join(describe(t) for t in gathered)}")

        # rank 0's payload of the next round, sent to everyone
        b = make_payload(0, args.size, args.seed + r + 1) if rank == 0 else torch.zeros(args.size)
        dist.broadcast(b, src=0)
        print(f"rank {rank}: round {r} broadcast {describe(b)}")

        dist.barrier()

    objects = [None] * world_size
    dist.all_gather_object(objects, {"rank": rank, "pid_is_int": isinstance(os.getpid(), int)})
    print(f"rank {rank}: all_gather_object {objects}")
    dist.destroy_process_group()
    print(f"rank {rank}: done")


if __name__ == "__main__":
    main()
