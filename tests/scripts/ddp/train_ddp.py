"""Data-parallel training with DDP and a DistributedSampler, in the style of the PyTorch DDP tutorial.

    torchrun --nproc_per_node 2 train_ddp.py --epochs 2 --batch-size 8
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from datautils import SyntheticRegression, build_model


def ddp_setup() -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)


class Trainer:
    def __init__(self, model, train_data: DataLoader, optimizer, rank: int):
        self.rank = rank
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.step = 0

    def _run_batch(self, source, targets) -> float:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> None:
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            loss = self._run_batch(source, targets)
            print(f"rank {self.rank}: epoch {epoch} step {self.step} loss {loss:.5f}")
            self.step += 1

    def train(self, epochs: int) -> None:
        for epoch in range(epochs):
            self._run_epoch(epoch)


def main() -> None:
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="input batch size on each device")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    ddp_setup()
    rank = int(os.environ["RANK"])
    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    dataset = SyntheticRegression(args.samples, seed=args.seed)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=False,
        sampler=DistributedSampler(dataset, seed=args.seed),
    )
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    trainer = Trainer(model, loader, optimizer, rank)
    print(f"rank {rank}: {len(loader)} batches per epoch of {len(dataset)} samples")
    trainer.train(args.epochs)

    # the replicas must agree after training
    checksum = torch.tensor([sum(p.detach().sum().item() for p in model.parameters())])
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, checksum)
    print(f"rank {rank}: replicas equal {len({round(t.item(), 6) for t in gathered}) == 1}")
    # DDP holds the group: freed after destroy_process_group, its gloo threads race torch's teardown
    # ("terminate called without an active exception" under torchrun, 1 run in ~10 here)
    del trainer, model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
