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
    offloaded: int = 0  # in CPU memory: the sum of `offloaded_parts`
    # (parameters, gradients, optimizer) of `offloaded`: what each category keeps in CPU memory
    offloaded_parts: tuple[int, int, int] = (0, 0, 0)

    def held(self) -> dict[str, int]:
        """Bytes of each model-state category the rank holds, on its device or offloaded to CPU.

        This is what `trainer.memory_breakdown()` counts (it reads the rank's tensors
        wherever they sit), while `parameters`/`gradients`/`optimizer` are device bytes only.
        """
        p, g, k = self.offloaded_parts
        return {"parameters": self.parameters + p, "gradients": self.gradients + g,
                "optimizer": self.optimizer + k}

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
    # how activations were estimated, e.g. "Llama-style decoder (...) per Korthikanti et al. 2022"; "" if not
    activation_formula: str = ""
    # {collective kind: bytes} the busiest rank hands to collectives per step (`mpnb.planning.comm_estimate`)
    comm_bytes_per_step: dict[str, int] = field(default_factory=dict)

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
            "activation_formula": self.activation_formula,
            "comm_bytes_per_step": dict(self.comm_bytes_per_step),
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
