"""A small classifier and a synthetic two-class dataset for the DeepSpeed example."""

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset


class SimpleNet(nn.Module):
    def __init__(self, features: int = 10, hidden: int = 32, classes: int = 2):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def two_blobs(samples: int, features: int = 10, seed: int = 0) -> TensorDataset:
    """Two Gaussian blobs, one per class (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (samples,), generator=g)
    x = torch.randn(samples, features, generator=g) + (2 * labels - 1).unsqueeze(1).float()
    return TensorDataset(x, labels)
