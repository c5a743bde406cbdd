"""Deterministic per-rank payloads and their printed form (rounded so the text is stable)."""

import torch


def make_payload(rank: int, size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(size, generator=g) + rank


def describe(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in t.tolist()) + "]"
