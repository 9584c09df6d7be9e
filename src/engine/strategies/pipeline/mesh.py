"""The ``dp x pp`` layout of the processes: sizes, this rank's coordinates, and its process groups.

Global rank ``r`` is pipeline rank ``r % pp`` of data-parallel replica ``r // pp`` (the
row-major layout of ``init_device_mesh(device, (dp, pp), mesh_dim_names=("dp", "pp"))``).
So ranks ``0..pp-1`` form the first pipeline, and global rank 0 holds the first stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from src.engine.utils.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """How ``world_size`` processes split into ``pp`` pipeline ranks times ``dp`` replicas."""

    pp: int
    dp: int

    def coords(self, global_rank: int) -> tuple[int, int]:
        """``(dp_rank, pp_rank)`` of a global rank."""
        return divmod(global_rank, self.pp)

    def global_rank(self, dp_rank: int, pp_rank: int) -> int:
        return dp_rank * self.pp + pp_rank

    def replicas_of(self, pp_rank: int) -> list[int]:
        """Global ranks that hold pipeline rank ``pp_rank`` (one per data-parallel replica)."""
        return [self.global_rank(d, pp_rank) for d in range(self.dp)]


def resolve_layout(world_size: int, stages: int | None, dp_size: int) -> Layout:
    """Check ``stages x dp_size == world_size`` (``stages=None``: ``world_size / dp_size``)."""
    if dp_size < 1:
        raise ConfigError(f"trainer.strategy.dp_size={dp_size} is below 1; fix: set it to 1 or more")
    if stages is None:
        if world_size % dp_size:
            raise ConfigError(
                f"{world_size} processes cannot hold {dp_size} data-parallel pipeline replicas; fix: "
                f"make trainer.devices x trainer.num_nodes a multiple of trainer.strategy.dp_size"
            )
        stages = world_size // dp_size
    if stages < 1:
        raise ConfigError(f"trainer.strategy.stages={stages} is below 1; fix: set it to 1 or more, or null (processes / dp_size)")
    if stages * dp_size != world_size:
        raise ConfigError(
            f"trainer.strategy.stages={stages} x dp_size={dp_size} = {stages * dp_size} processes, but the "
            f"trainer has {world_size} (devices x num_nodes); fix: make them equal, e.g. stages=null"
        )
    return Layout(pp=stages, dp=dp_size)


@dataclass(frozen=True)
class PipelineMesh:
    """This process's place in the ``dp x pp`` mesh and the groups it talks over."""

    layout: Layout
    pp_rank: int
    dp_rank: int
    pp_group: dist.ProcessGroup  # the ranks of this pipeline (stage-to-stage traffic, output broadcast)
    dp_group: dist.ProcessGroup  # the replicas of this stage (gradient averaging, metric sync)
    device_mesh: DeviceMesh

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.layout.pp - 1


def build_mesh(device_type: str, layout: Layout) -> PipelineMesh:
    """Create the 2-D device mesh over the initialised default process group (gloo or nccl)."""
    mesh = init_device_mesh(device_type, (layout.dp, layout.pp), mesh_dim_names=("dp", "pp"))
    dp_rank, pp_rank = layout.coords(dist.get_rank())
    return PipelineMesh(
        layout=layout,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        pp_group=mesh["pp"].get_group(),
        dp_group=mesh["dp"].get_group(),
        device_mesh=mesh,
    )
