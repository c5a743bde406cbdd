"""A small synthetic regression dataset, the same on every rank (built from a fixed seed)."""

import torch
from torch.utils.data import Dataset


class SyntheticRegression(Dataset):
    """y = x @ w_true + noise, with `size` samples of `features` inputs."""

    def __init__(self, size: int, features: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=g)
        w_true = torch.randn(features, 1, generator=g)
        self.y = self.x @ w_true + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


def build_model(features: int = 8, hidden: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
    )
