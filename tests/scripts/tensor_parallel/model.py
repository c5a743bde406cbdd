"""The MLP that tensor parallelism splits: `in_proj` by columns, `out_proj` by rows."""

import torch
import torch.nn as nn


class ToyModel(nn.Module):
    """MLP based model"""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.relu(self.in_proj(x)))
