"""The parallel degrees of a run: which strategy, and how the ranks divide the work.

`ParallelDims` is built once from a `Config` and the world size (as
torchtitan's `distributed/parallel_dims.py`); the estimator, the code
generator, the config checks and the engine's strategies all read the
degrees from it instead of working them out again. The device mesh has the
dims ("pp", "dp", "tp"), pipeline outermost: tensor-parallel ranks are
neighbours (their collectives run every layer), pipeline stages furthest
apart (they exchange one activation per microbatch), so ranks
``[s*dp, (s+1)*dp)`` hold pipeline stage ``s``.

Torch-free: `build_mesh` imports torch only when the engine calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from mpnb.errors import ConfigError


class Strategy(str, Enum):
    """How the model is spread over ranks; each member is the string `Config.strategy` accepts."""

    DDP = "ddp"
    FSDP = "fsdp"
    ZERO = "zero"
    PIPELINE = "pipeline"
    TENSOR = "tensor"

    # shown as the plain string, so messages and Config reprs read "fsdp", not "Strategy.FSDP"
    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)


# How tensor parallelism splits a Linear layer: by output features, or by input features.
TENSOR_STYLES = ("colwise", "rowwise")

# Layer-name suffixes whose Linear layers the default tensor-parallel plan splits, and how
# (the engine's tensor strategy and the estimator both follow this table).
KNOWN_TENSOR_STYLES = {
    "attn.qkv": "colwise", "attn.proj": "rowwise",  # mpnb.models.GPT
    "mlp.fc": "colwise", "mlp.proj": "rowwise",
    "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",  # Llama style
    "out_proj": "rowwise",
    "up_proj": "colwise", "gate_proj": "colwise", "down_proj": "rowwise",
    "fc1": "colwise", "fc2": "rowwise",
}


class ModelParallelDegrees(Protocol):
    """What `ParallelDims.from_config` reads from a `Config` (typed here so this module needs no config)."""

    @property
    def pipeline_stages(self) -> int: ...

    @property
    def tensor_parallel(self) -> int: ...


@dataclass(frozen=True)
class ParallelDims:
    """Pipeline (pp), data-parallel (dp) and tensor-parallel (tp) degrees over `world` ranks.

    pp and tp come from the config; dp is what remains of the world. Building
    one never fails, so a summary can describe a config that cannot run;
    `problems()` / `validate()` say whether the degrees tile the world.
    """

    world: int
    pp: int = 1
    dp: int = 1
    tp: int = 1

    @classmethod
    def from_config(cls, config: ModelParallelDegrees, world_size: int) -> ParallelDims:
        pp, tp = config.pipeline_stages, config.tensor_parallel
        return cls(world=world_size, pp=pp, dp=max(1, world_size // max(1, pp * tp)), tp=tp)

    @property
    def model_parallel(self) -> int:
        return self.pp * self.tp

    def stage_of(self, rank: int) -> int:
        """The pipeline stage `rank` holds (pipeline outermost in the mesh)."""
        return rank // self.dp

    def problems(self) -> list[str]:
        """Each way the degrees fail to tile the world, naming the fix."""
        out: list[str] = []
        pp, tp, world = self.pp, self.tp, self.world
        if pp > world:
            out.append(f"pipeline_stages={pp} is more than the {world} ranks; "
                       "each stage needs at least one rank.")
        elif world % pp:
            out.append(f"pipeline_stages={pp} does not divide the world size {world}; "
                       f"use one of {divisors(world)}.")
        if tp > world:
            out.append(f"tensor_parallel={tp} is more than the {world} ranks.")
        elif world % tp:
            out.append(f"tensor_parallel={tp} does not divide the world size {world}; "
                       f"use one of {divisors(world)}.")
        return out

    def validate(self) -> ParallelDims:
        """Raise ConfigError with the first problem; return self when the degrees tile the world."""
        found = self.problems()
        if found:
            raise ConfigError(found[0])
        return self

    def build_mesh(self, device_type: str) -> Any:
        """The torch DeviceMesh over every rank, dims ("pp", "dp", "tp"), pipeline outermost."""
        from torch.distributed.device_mesh import init_device_mesh

        assert self.pp * self.dp * self.tp == self.world, self
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))


def divisors(n: int) -> str:
    """The degrees that divide `n` ranks, for messages: ``1, 2, 4``."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
