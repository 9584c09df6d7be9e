"""Who started this process, read from the environment in this one place.

Launchers describe a rank through environment variables, each in its own words: torchrun (``RANK``,
``LOCAL_RANK``, ``TORCHELASTIC_*``), SLURM's srun (``SLURM_PROCID``, ``SLURM_JOB_ID`` ...), submitit
(``SUBMITIT_EXECUTOR`` on top of SLURM's), SkyPilot (``SKYPILOT_TASK_ID``), mpirun, and Lightning's own
launcher, which re-runs the command with ``LOCAL_RANK``/``NODE_RANK`` set. Every other module asks
:func:`launch_context` instead of reading them, as nanoGPT reads ``RANK`` once and Lightning puts it
behind a ``ClusterEnvironment``.

The context is read when asked, not cached: Lightning's launcher writes ``LOCAL_RANK``, ``NODE_RANK``
and ``MASTER_PORT`` into the launching process's own environment as it starts the ranks, and a
multirun restores the environment between jobs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PYTHON, CHILD, TORCHRUN, SRUN, SUBMITIT, MPIRUN, SKYPILOT = (
    "python", "child", "torchrun", "srun", "submitit", "mpirun", "skypilot")
EXTERNAL_LAUNCHERS = (TORCHRUN, SRUN, SUBMITIT, MPIRUN)  # they start every rank themselves


@dataclass(frozen=True)
class LaunchContext:
    """What the launcher told this process. Indices the launcher did not give are None.

    ``launcher`` is one of: ``python`` (a plain command, or a rank a ``ddp_spawn`` parent started),
    ``child`` (a rank Lightning's launcher started by re-running the command), ``torchrun``, ``srun``,
    ``submitit``, ``mpirun``, or ``skypilot`` (a single process on a SkyPilot node).
    """

    launcher: str = PYTHON
    rank: int | None = None  # global rank
    local_rank: int | None = None
    node_rank: int = 0
    world_size: int | None = None
    local_world_size: int | None = None  # processes on this node (torchrun's --nproc_per_node)
    master_addr: str | None = None
    master_port: str | None = None
    job_id: str | None = None  # kept across requeues and spot recoveries (SLURM, SkyPilot)
    slurm_job: str | None = None  # what `scontrol requeue` takes: the job, or array job_task
    restart_count: int = 0  # torchrun's restart attempt (--max-restarts)
    torchrun_run_id: str | None = None
    torchrun_agent_store: bool = False  # torchrun's ranks share its agent's TCPStore at MASTER_ADDR:MASTER_PORT
    preempt_signal: str | None = None  # submitit: the signal its job gets before a time-out or preemption (USR2)

    @property
    def external(self) -> bool:
        """Every rank was started by a launcher outside this program (torchrun, srun, submitit, mpirun)."""
        return self.launcher in EXTERNAL_LAUNCHERS

    @property
    def is_global_zero(self) -> bool:
        """Global rank 0, or a process its launcher gave no global rank (a plain command, Lightning's ranks)."""
        return not self.rank

    @property
    def is_launching_process(self) -> bool:
        """Every index the environment gives is 0: the process that is, or will start, global rank 0."""
        return not any((self.rank, self.local_rank, self.node_rank))

    @property
    def starts_ranks(self) -> bool:
        """This process may start the other ranks itself: a plain command, not a rank something else started."""
        return self.launcher in (PYTHON, SKYPILOT)

    @property
    def before_launch(self) -> bool:
        """A plain command that has not started ranks yet (Lightning's launcher then sets LOCAL_RANK=0 here)."""
        return self.starts_ranks and self.local_rank is None


def _int(value: str | None) -> int | None:
    return int(value) if value not in (None, "") else None


def _job_id(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """``(job id for run directories, job for scontrol)``: SkyPilot's task, or SLURM's job (+array task, step)."""
    array_job, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    slurm_job = f"{array_job}_{task}" if array_job and task else env.get("SLURM_JOB_ID")
    if env.get("SKYPILOT_TASK_ID"):
        return "sky_" + "".join(c if c.isalnum() or c in "-_." else "-" for c in env["SKYPILOT_TASK_ID"]), slurm_job
    job = array_job or env.get("SLURM_JOB_ID")
    if not job:
        return None, slurm_job
    step = env.get("SLURM_STEP_ID")
    return "slurm_" + job + (f"_{task}" if task else "") + (f"_step{step}" if step else ""), slurm_job


def read_launch_context(env: Mapping[str, str] | None = None) -> LaunchContext:
    """The :class:`LaunchContext` described by ``env`` (default: this process's environment)."""
    env = os.environ if env is None else env
    job_id, slurm_job = _job_id(env)
    common = dict(master_addr=env.get("MASTER_ADDR"), master_port=env.get("MASTER_PORT"), job_id=job_id,
                  slurm_job=slurm_job, node_rank=int(env.get("NODE_RANK") or env.get("GROUP_RANK") or 0))
    if env.get("TORCHELASTIC_RUN_ID"):
        return LaunchContext(TORCHRUN, _int(env.get("RANK")), _int(env.get("LOCAL_RANK")),
                             world_size=_int(env.get("WORLD_SIZE")), local_world_size=_int(env.get("LOCAL_WORLD_SIZE")),
                             restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT") or 0),
                             torchrun_run_id=env["TORCHELASTIC_RUN_ID"],
                             torchrun_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", **common)
    if env.get("SLURM_PROCID") is not None:
        common["node_rank"] = int(env.get("SLURM_NODEID") or 0)
        submitit = bool(env.get("SUBMITIT_EXECUTOR"))
        return LaunchContext(SUBMITIT if submitit else SRUN, _int(env["SLURM_PROCID"]), _int(env.get("SLURM_LOCALID")),
                             world_size=_int(env.get("SLURM_NTASKS")),
                             preempt_signal=(env.get("SUBMITIT_PREEMPT_SIGNAL") or "USR2") if submitit else None,
                             **common)
    if env.get("OMPI_COMM_WORLD_SIZE") or env.get("PMI_SIZE"):
        rank = env.get("OMPI_COMM_WORLD_RANK") or env.get("PMI_RANK")
        return LaunchContext(MPIRUN, _int(rank), _int(env.get("OMPI_COMM_WORLD_LOCAL_RANK") or "0"),
                             world_size=_int(env.get("OMPI_COMM_WORLD_SIZE") or env.get("PMI_SIZE")), **common)
    local_rank = _int(env.get("LOCAL_RANK"))
    if local_rank:  # Lightning's launcher re-ran the command for this rank (its own process keeps LOCAL_RANK=0)
        return LaunchContext(CHILD, _int(env.get("RANK")), local_rank, world_size=_int(env.get("WORLD_SIZE")),
                             **common)
    launcher = SKYPILOT if env.get("SKYPILOT_TASK_ID") else PYTHON
    return LaunchContext(launcher, _int(env.get("RANK")), local_rank, world_size=_int(env.get("WORLD_SIZE")),
                         **common)


def launch_context() -> LaunchContext:
    """This process's :class:`LaunchContext`, as its environment says now."""
    return read_launch_context()
