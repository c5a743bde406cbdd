"""FSDP2 training of a tiny transformer, in the style of pytorch/examples distributed/FSDP2.

Meta-device init, `fully_shard` on each block then on the root, `to_empty` and in-place init.

    torchrun --nproc_per_node 2 train_fsdp2.py --steps 3
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from model import ModelArgs, Transformer


def main(args: argparse.Namespace) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{rank}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = dist.get_default_backend_for_device(device)
    dist.init_process_group(backend=backend)
    world_size = dist.get_world_size()

    torch.manual_seed(args.seed)
    model_args = ModelArgs(n_layers=args.layers, max_seq_len=args.seq_len)
    with torch.device("meta"):
        model = Transformer(model_args)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)

    model.to_empty(device=device)
    model.init_weights()
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    print(f"rank {rank}: {total} parameters, {local} on this rank ({world_size} shards)")

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # each rank its own batch, seen every step: the loss must fall as the model memorises it
    g = torch.Generator().manual_seed(args.seed + 1000 * rank)
    tokens = torch.randint(0, model_args.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
    for step in range(args.steps):
        logits = model(tokens[:, :-1].to(device))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1).to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        print(f"rank {rank}: step {step} loss {loss.item():.5f} mean {mean.item():.5f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PyTorch FSDP2 example")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    main(parser.parse_args())
