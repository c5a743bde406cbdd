"""What `mpnb.estimate` returns: bytes per category for each rank, and the most loaded one."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mpnb.units import format_bytes


@dataclass(frozen=True)
class RankEstimate:
    """Bytes one rank holds on its device, by category, plus what it keeps in CPU memory."""

    rank: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    offloaded: int = 0

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.buffers


@dataclass(frozen=True)
class Estimate:
    """Per-rank prediction; the category attributes are those of the most loaded rank."""

    ranks: tuple[RankEstimate, ...]
    num_params: int
    summary: str
    bytes_per_param: tuple[float, float, float]  # P, G, K as used
    notes: tuple[str, ...] = field(default=())

    @property
    def worst(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: (r.total, -r.rank))

    @property
    def parameters(self) -> int:
        return self.worst.parameters

    @property
    def gradients(self) -> int:
        return self.worst.gradients

    @property
    def optimizer(self) -> int:
        return self.worst.optimizer

    @property
    def activations(self) -> int:
        return self.worst.activations

    @property
    def buffers(self) -> int:
        return self.worst.buffers

    @property
    def offloaded(self) -> int:
        return self.worst.offloaded

    @property
    def model_states(self) -> int:
        return self.worst.model_states

    @property
    def total(self) -> int:
        return self.worst.total

    def by_rank(self) -> dict[int, int]:
        """{rank: total device bytes}, the shape `MemoryStore.estimate` takes."""
        return {r.rank: r.total for r in self.ranks}

    def fits(self, capacity: int) -> bool:
        return all(r.total <= capacity for r in self.ranks)

    def as_dict(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "parameters": worst.parameters,
            "gradients": worst.gradients,
            "optimizer": worst.optimizer,
            "activations": worst.activations,
            "buffers": worst.buffers,
            "offloaded": worst.offloaded,
            "model_states": worst.model_states,
            "total": worst.total,
            "num_params": self.num_params,
            "summary": self.summary,
            "bytes_per_param": list(self.bytes_per_param),
            "per_rank": [{**asdict(r), "total": r.total} for r in self.ranks],
            "notes": list(self.notes),
        }

    def __repr__(self) -> str:
        w = self.worst
        same = all(r.total == w.total for r in self.ranks)
        who = "every rank" if same else f"rank {w.rank} (most loaded)"
        parts = [
            f"parameters {format_bytes(w.parameters)}",
            f"gradients {format_bytes(w.gradients)}",
            f"optimizer {format_bytes(w.optimizer)}",
            f"activations {format_bytes(w.activations)}",
            f"buffers {format_bytes(w.buffers)}",
        ]
        if w.offloaded:
            parts.append(f"offloaded to CPU {format_bytes(w.offloaded)}")
        return (
            f"<Estimate {self.summary}, {self.num_params:,} params: {who} holds "
            f"{format_bytes(w.total)} = {', '.join(parts)}>"
        )
