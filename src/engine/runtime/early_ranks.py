"""Start a popen launch's other ranks as the command starts, so that they import while rank 0 does.

Lightning's popen launcher starts local ranks 1..N-1 when ``fit`` begins, by re-running the command, and
each of them then imports torch and Lightning (most of a rank's start-up) while rank 0 waits for it in the
rendezvous. Here the entry script starts them before it imports anything heavy
(:func:`start_ranks_early`). Each imports Lightning, then waits on a pipe for what the launcher would have
started it with: its command's arguments, its working directory and its environment. The launcher
(:class:`src.engine.strategies.launchers.PreflightSubprocessLauncher`) adopts them in place of new
processes (:func:`adopt`), and the processes it needs but finds none for, it starts as Lightning does.

A rank that is not adopted ends before it has read a config or written a line: when the run is refused by
its pre-flight, had already finished, or needs fewer ranks than its config said (:func:`end_unadopted`, also
at exit). Ranks start early only for a plain command of overrides (no ``-m``, ``--cfg`` or other flag) whose
composed config has ``trainer.strategy.start_method: popen`` and a whole number of devices, and that no
launcher started (torchrun, srun, mpirun, or a rank of this launch). Anything else starts where Lightning
starts it. The decision composes the config once more (Hydra's compose API, a few tenths of a second).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from src.engine.runtime.launch_context import read_launch_context

GATE_ENV = "SRC_EARLY_RANK_GATE"  # in an early rank: the descriptor of the pipe it waits on
PREIMPORTS = ("hydra", "lightning.pytorch")  # what every rank imports before its first step


@dataclass
class EarlyRank:
    """A process started for ``local_rank``, waiting for its orders on the pipe whose write end is ``gate``."""

    local_rank: int
    prefix: list[str]  # the interpreter and the script (or ``-m`` module) it runs
    proc: subprocess.Popen
    gate: int


_waiting: dict[int, EarlyRank] = {}


def start_ranks_early(script: str, config_path: str, config_name: str, version_base: str | None = None) -> None:
    """In the command a user ran: start the local ranks its config will launch. In such a rank: import, wait.

    ``script`` is the entry script's ``__file__``; the other arguments are its ``hydra.main`` arguments.
    Call it first thing under ``if __name__ == "__main__"``, before the script imports Lightning.
    """
    if GATE_ENV in os.environ:
        _wait_for_orders(int(os.environ.pop(GATE_ENV)))
        return
    count = ranks_to_start(sys.argv[1:], os.path.join(os.path.dirname(os.path.abspath(script)), config_path),
                           config_name, version_base)
    if count:
        start(count, entry_prefix())


def entry_prefix() -> list[str]:
    """The interpreter and the script (or ``-m`` module) this process runs, as a child rank's command starts."""
    import __main__

    if getattr(__main__, "__spec__", None) is None:
        return [sys.executable, os.path.abspath(sys.argv[0])]
    return [sys.executable, "-m", __main__.__spec__.name]


def ranks_to_start(overrides: Sequence[str], config_dir: str, config_name: str, version_base: str | None) -> int:
    """How many local ranks this command's config will start by re-running it: 0 where that is not known."""
    if os.name != "posix" or any(arg.startswith("-") for arg in overrides):
        return 0  # a flag (multirun, --cfg, --config-name...): the command is not one job of known config
    if not read_launch_context().before_launch:
        return 0  # a launcher started this process, or it is a rank of a launch itself
    try:
        from hydra import compose, initialize_config_dir
        from omegaconf import DictConfig, ListConfig, OmegaConf

        with initialize_config_dir(config_dir=config_dir, version_base=version_base):
            cfg = compose(config_name, overrides=list(overrides), return_hydra_config=True)
        if str(OmegaConf.select(cfg, "hydra.mode")).endswith("MULTIRUN"):
            return 0
        strategy, devices = cfg.trainer.get("strategy"), cfg.trainer.get("devices")
        if not isinstance(strategy, DictConfig) or strategy.get("start_method") != "popen":
            return 0
        processes = len(devices) if isinstance(devices, ListConfig) else devices if type(devices) is int else 1
    except Exception:  # a config error is the real compose's to report, in its own words
        return 0
    return max(processes - 1, 0)


def start(count: int, prefix: list[str]) -> None:
    """Start local ranks 1..``count``, each running ``prefix`` and waiting for its orders; end them at exit
    unless a launcher adopts them."""
    if not _waiting:
        atexit.register(end_unadopted)
    for local_rank in range(1, count + 1):
        read_end, gate = os.pipe()  # both ends close on exec; only the child's read end is passed on
        try:
            proc = subprocess.Popen(prefix, env={**os.environ, GATE_ENV: str(read_end)}, pass_fds=(read_end,))
        finally:
            os.close(read_end)
        _waiting[local_rank] = EarlyRank(local_rank, prefix, proc, gate)


def adopt(local_rank: int, command: list[str], env: dict[str, str], cwd: str | None) -> subprocess.Popen | None:
    """The early process for ``local_rank``, now running ``command`` in ``cwd`` with ``env``; None if there is none
    (the caller starts one), or if it cannot run that command or died while it waited (it is then ended)."""
    early = _waiting.pop(local_rank, None)
    if early is None:
        return None
    if command[: len(early.prefix)] != early.prefix:
        _end(early)
        return None
    orders = {"args": command[len(early.prefix):], "cwd": cwd or os.getcwd(), "env": dict(env)}
    try:
        with os.fdopen(early.gate, "wb") as gate:  # it reads to the end: the close is what lets it go on
            gate.write(json.dumps(orders).encode())
    except OSError:  # it died while importing (BrokenPipeError)
        _end(early)
        return None
    return early.proc


def end_unadopted() -> None:
    """End every early rank no launcher adopted; they have only imported, so nothing of the run is lost."""
    while _waiting:
        _end(_waiting.popitem()[1])


def _end(early: EarlyRank) -> None:
    with contextlib.suppress(OSError):
        os.close(early.gate)
    with contextlib.suppress(OSError):
        early.proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        early.proc.wait(timeout=30)


def _wait_for_orders(gate: int) -> None:
    """In an early rank: import, then take the arguments, directory and environment of the launcher's orders;
    end quietly if none come (the launch did not happen) or on Ctrl-C before they do."""
    try:
        for name in PREIMPORTS:
            with contextlib.suppress(Exception):  # a failing import fails again, loudly, where the script imports
                importlib.import_module(name)
        with os.fdopen(gate, "rb") as pipe:
            orders = pipe.read()
    except KeyboardInterrupt:
        os._exit(130)
    if not orders:
        os._exit(0)
    orders = json.loads(orders)
    os.chdir(orders["cwd"])
    os.environ.clear()
    os.environ.update(orders["env"])
    sys.argv[1:] = orders["args"]
