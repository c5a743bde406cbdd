"""Tiny models and synthetic data for notebooks, tests and benchmarks.

Readable in one sitting, like nanoGPT: a GPT made of `Block`s (attention + MLP),
a deterministic synthetic token stream, and a plain `nn.Sequential` MLP.

The layer names are the ones the built-in tensor-parallel plan knows
(`attn.qkv`/`attn.proj`, `mlp.fc`/`mlp.proj`) and the blocks live in
`model.blocks` (an `nn.ModuleList`), so FSDP can shard block by block and the
pipeline splitter can cut between blocks. Attention reads its head count from
`self.n_head` at every forward, so tensor parallelism can divide it per rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0  # keep 0 so runs under different strategies are comparable


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        # q, k, v in one matmul, laid out head by head ([q_h, k_h, v_h] for each head h), so
        # splitting the output features into contiguous chunks (tensor parallel) gives whole heads
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 instead of n_embd: under tensor parallelism each rank holds n_head/tp heads
        q, k, v = self.qkv(x).view(b, t, -1, 3, self.head_dim).unbind(dim=3)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (b, heads, t, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab).

    Every submodule may be `None` (the pipeline splitter deletes the parts a
    stage does not own), so `forward` skips what is missing: stage 0 keeps the
    embeddings, the last stage keeps `ln_f` and `head`.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)
        for block in self.blocks.values() if isinstance(self.blocks, nn.ModuleDict) else self.blocks:
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def tiny_gpt(seed: int = 0, **overrides: int) -> GPT:
    """A GPT small enough for 2 CPU cores (~0.2 M parameters), same weights for a given seed."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**overrides))


def mlp(sizes: tuple[int, ...] = (32, 64, 64, 10), seed: int = 0) -> nn.Sequential:
    """A plain `nn.Sequential` of Linear + GELU layers: the smallest thing `prepare` accepts."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(fan_in, fan_out))
        if i < len(sizes) - 2:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


def synthetic_batches(
    vocab_size: int = 256, seq_len: int = 32, batch_size: int = 8, steps: int = 20, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of (inputs, targets), identical on every rank for a given seed.

    The tokens follow a learnable rule (each token is the previous one plus a
    small step, modulo the vocabulary) with noise, so the loss visibly falls.
    Targets are the inputs shifted by one, as in language modelling.
    """
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, vocab_size, (batch_size, 1), generator=gen)
        stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
        seq = (start + stride * torch.arange(seq_len + 1)) % vocab_size
        noise = torch.rand(batch_size, seq_len + 1, generator=gen) < 0.1
        seq = torch.where(noise, torch.randint(0, vocab_size, seq.shape, generator=gen), seq)
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def synthetic_regression(
    in_features: int = 32, out_classes: int = 10, batch_size: int = 16, steps: int = 20, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches for `mlp()`: random features, class = argmax of a fixed random projection."""
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(in_features, out_classes, generator=gen)
    for _ in range(steps):
        x = torch.randn(batch_size, in_features, generator=gen)
        yield x, (x @ proj).argmax(dim=-1)
