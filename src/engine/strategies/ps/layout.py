"""Who serves and who trains, and which server holds which parameter.

Global ranks ``0 .. num_servers-1`` are servers, the rest are workers. Rank 0 is the *chief*: a server
that also evaluates, logs and writes checkpoints. It is the process a plain ``python src/train.py``
starts (and, with torchrun or srun, global rank 0), so the process whose loss ends the job anyway is
the one a job cannot do without.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CHIEF = 0


@dataclass(frozen=True)
class Roles:
    """``world_size`` processes: the first ``num_servers`` serve, the others are workers."""

    world_size: int
    num_servers: int

    @property
    def num_workers(self) -> int:
        return self.world_size - self.num_servers

    def is_server(self, rank: int) -> bool:
        return rank < self.num_servers

    def worker_index(self, rank: int) -> int:
        """A worker's index among the workers (its data shard), from its global rank."""
        return rank - self.num_servers

    def worker_rank(self, index: int) -> int:
        return index + self.num_servers


def shard_by_size(sizes: Sequence[int], num_servers: int) -> list[int]:
    """The server of each parameter: the largest parameters first, each to the server holding the fewest
    elements so far (ties: the lower server). Whole tensors, so a server applies its updates alone.

    TensorFlow's ``GreedyLoadBalancingStrategy`` places variables the same way, in creation order;
    taking the largest first keeps one big matrix from landing on a server that is already full.
    """
    load = [0] * num_servers
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        server = min(range(num_servers), key=lambda s: (load[s], s))
        owner[i] = server
        load[server] += sizes[i]
    return owner
