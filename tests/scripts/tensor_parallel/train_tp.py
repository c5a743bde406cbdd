"""Megatron-style tensor parallelism on an MLP, in the style of pytorch/examples tensor_parallel_example.py.

The device mesh forms the process group itself (no `init_process_group` in this script).

    torchrun --nproc_per_node 2 train_tp.py --steps 3
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from model import ToyModel


def rank_log(rank: int, message: str) -> None:
    print(f"rank {rank}: {message}")


def main() -> None:
    parser = argparse.ArgumentParser(description="tensor parallel toy MLP")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    world_size = int(os.environ["WORLD_SIZE"])
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    tp_mesh = init_device_mesh(device_type, (world_size,))
    rank = tp_mesh.get_rank()
    rank_log(rank, f"device mesh {tp_mesh.mesh.tolist()} on {device_type}")

    # every rank builds the same full model, then keeps its own slice of each weight
    torch.manual_seed(args.seed)
    model = ToyModel(args.dim, args.hidden).to(device_type)
    tp_model = parallelize_module(
        module=model,
        device_mesh=tp_mesh,
        parallelize_plan={"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()},
    )
    shapes = {name: tuple(p.to_local().shape) for name, p in tp_model.named_parameters()}
    rank_log(rank, f"local shards {shapes}")

    optimizer = torch.optim.AdamW(tp_model.parameters(), lr=args.lr, foreach=True)
    for i in range(args.steps):
        # the same input on every rank: tensor parallelism splits the model, not the batch
        torch.manual_seed(args.seed + i)
        inp = torch.rand(8, args.dim, device=device_type)
        output = tp_model(inp)
        loss = (output**2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        rank_log(rank, f"step {i} loss {loss.item():.5f}")

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
