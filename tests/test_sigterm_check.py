"""SIGTERM in multi-process training: a signal to one rank stops every rank at the same batch, promptly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from src.engine.runtime.sigterm import SigtermNote, SigtermSync, install_sigterm_agreement
from src.engine.strategies.ddp import DDPStrategy
from src.engine.utils.errors import ConfigError
from tests.helpers.config import ROOT

STOP = re.compile(r"\[rank (\d)\].*every rank stopped at epoch (\d+), global step (\d+);")


def _wait_for(path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared in {path}:\n{path.read_text(errors='replace')[-2000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("every_n", [1, 10])
def test_sigterm_to_rank_zero_only_stops_both_ranks_at_the_same_step(tmp_path, every_n):
    """Two launches (NODE_RANK 0/1, as on two machines); only node 0 gets SIGTERM, mid-training."""
    port = str(find_free_network_port())
    procs, logs = [], [tmp_path / f"node{node}.log" for node in (0, 1)]
    for node in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node),
               "OMP_NUM_THREADS": "1"}
        args = [sys.executable, str(ROOT / "src/train.py"), "trainer=ddp", "trainer.devices=1", "trainer.num_nodes=2",
                "trainer.accelerator=cpu", "trainer.max_epochs=100", "extras.print_config=false",
                "callbacks.rich_progress_bar=null", "++trainer.limit_val_batches=2",
                f"trainer.strategy.sigterm_check_every_n_batches={every_n}", f"hydra.run.dir={tmp_path}/node{node}"]
        with open(logs[node], "w") as out:  # the child keeps its own copy of the descriptor
            procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        _wait_for(logs[0], "epoch 0:", timeout=180)  # training is under way on both ranks
        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]  # a hang (unmatched collective) fails here
    finally:
        for p in procs:
            p.kill()
    out = [log.read_text(errors="replace") for log in logs]
    assert codes == [143, 143], out[0][-1500:] + out[1][-1500:]  # preempted: 128 + SIGTERM, last.ckpt saved
    assert "Received SIGTERM" in out[0] and "Received SIGTERM" not in out[1]  # node 1 was never signalled
    stops = [STOP.findall(text) for text in out]
    assert [s[0][0] for s in stops] == ["0", "1"]
    assert stops[0][0][1:] == stops[1][0][1:]  # the same epoch and global step on both ranks
    assert "epoch 99:" not in out[0]  # stopped early, not at the end of training


@pytest.mark.slow
def test_plain_trainer_with_the_project_ddp_strategy_stops_both_ranks_at_the_same_step(tmp_path):
    """The same guarantee without Hydra or src/train.py: a user's script builds Trainer(strategy=DDPStrategy())."""
    port = str(find_free_network_port())
    script = ROOT / "tests" / "helpers" / "plain_trainer_ddp.py"
    procs, logs = [], [tmp_path / f"node{node}.log" for node in (0, 1)]
    for node in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node),
               "OMP_NUM_THREADS": "1"}
        with open(logs[node], "w") as out:
            procs.append(subprocess.Popen([sys.executable, str(script), "5"], cwd=tmp_path, env=env, stdout=out,
                                          stderr=subprocess.STDOUT))
    try:
        _wait_for(logs[0], "TRAINING", timeout=180)
        procs[0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    out = [log.read_text(errors="replace") for log in logs]
    assert codes == [143, 143], out[0][-1500:] + out[1][-1500:]  # preempted: 128 + SIGTERM, last.ckpt saved
    assert "Received SIGTERM" in out[0] and "Received SIGTERM" not in out[1]
    stops = [re.findall(r"STOP rank=(\d) epoch=(\d+) step=(\d+)", text) for text in out]
    assert [s[0][0] for s in stops] == ["0", "1"], out
    assert stops[0][0][1:] == stops[1][0][1:]  # the same epoch and global step on both ranks
    assert int(stops[0][0][2]) % 5 == 0  # stopped at an agreed check (every 5 batches)


@pytest.mark.fast
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "10"])
def test_bad_interval_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="sigterm_check_every_n_batches"):
        DDPStrategy(sigterm_check_every_n_batches=bad)


@pytest.mark.fast
def test_installed_on_multi_process_trainers_only():
    from lightning import Trainer

    single = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    assert install_sigterm_agreement(single, 10) is None  # one process: the StopSignals callback's job
    assert "_broadcast_sigterm_tensor" not in vars(single.fit_loop.epoch_loop)

    ddp = Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
    sync = install_sigterm_agreement(ddp, 10)
    check, handler = vars(ddp.fit_loop.epoch_loop)["_broadcast_sigterm_tensor"], ddp._signal_connector._sigterm_notifier_fn
    assert isinstance(check, SigtermSync) and check.every_n_batches == 10 and check is sync
    assert signal.getsignal(signal.SIGUSR1) is handler  # SIGUSR1 (SLURM's warning) takes the same path
    assert isinstance(handler, SigtermNote) and handler.sync is check


@pytest.mark.fast
def test_note_outside_fit_keeps_lightnings_stop():
    """In test/validate there is no per-batch check, so the handler sets Lightning's own flag."""
    from lightning import Trainer
    from lightning.pytorch.trainer.states import TrainerFn

    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
    install_sigterm_agreement(trainer, 10)
    note = trainer._signal_connector._sigterm_notifier_fn
    trainer.state.fn = TrainerFn.FITTING
    note(signal.SIGTERM, None)
    assert note.sync.signalled and not trainer.received_sigterm  # fit: wait for the agreed check
    trainer.state.fn = TrainerFn.TESTING
    note(signal.SIGTERM, None)
    assert trainer.received_sigterm


def test_a_spawned_ranks_stop_reaches_its_parent_as_the_same_stop():
    """Under ddp_spawn the parent learns of a stop from the ranks' exit codes: Lightning's own stop (outside fit,
    no code: it would exit 0 and leave the parent waiting for results) exits 143, and the parent raises that
    stop again; any other exit stays torch's error."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException
    from torch.multiprocessing import ProcessExitedException

    from src.engine.runtime.sigterm import Preempted, stop_of_spawned_ranks
    from src.engine.strategies.launchers import SpawnedRank

    def lightnings_stop() -> None:
        raise SIGTERMException

    with pytest.raises(SystemExit) as stopped:
        SpawnedRank(lightnings_stop, None)()
    assert stopped.value.code == 128 + signal.SIGTERM

    def exited(code: int) -> ProcessExitedException:
        return ProcessExitedException("exited", error_index=0, error_pid=1, exit_code=code)

    assert type(stop_of_spawned_ranks(exited(143), None)) is SIGTERMException  # outside fit: nothing saved
    assert stop_of_spawned_ranks(exited(1), None) is None
    assert stop_of_spawned_ranks(exited(128 + signal.SIGKILL), None) is None
    assert stop_of_spawned_ranks(exited(-signal.SIGKILL), None) is None
    assert type(stop_of_spawned_ranks(exited(-signal.SIGTERM), None)) is SIGTERMException  # before its handlers

    class Fitting:
        class state:  # noqa: N801 - a stand-in for trainer.state
            fn = "fit"

    stop = stop_of_spawned_ranks(exited(128 + signal.SIGUSR1), Fitting())
    assert isinstance(stop, Preempted) and stop.code == 128 + signal.SIGUSR1
    assert type(stop_of_spawned_ranks(exited(-signal.SIGTERM), Fitting())) is SIGTERMException  # nothing saved


@pytest.mark.fast
def test_a_stop_signal_while_a_spawned_rank_starts_is_kept_for_its_handlers():
    """Between a spawned or forked rank's start and its strategy's setup, a stop signal is kept (not Python's
    default end, nor the parent's handler a fork inherits), and the first agreed check acts on it."""
    from lightning import Trainer

    from src.engine.runtime import sigterm

    previous = {signum: signal.getsignal(signum) for signum in sigterm.STOP_SIGNALS}
    try:
        sigterm.hold_stop_signals()
        os.kill(os.getpid(), signal.SIGTERM)  # kept: this process lives on
        trainer = Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
        sync = install_sigterm_agreement(trainer, 10)
        assert sync.signum == signal.SIGTERM and sigterm._early_stop == 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@pytest.mark.fast
def test_a_ranks_copy_of_the_spawn_launcher_signals_no_process():
    """A forked rank's launcher still lists the processes of the launch before (fit's, during test): passing a
    signal on from there would test processes that are not its children (AssertionError in multiprocessing)."""
    from src.engine.strategies.launchers import PreflightMultiprocessingLauncher

    class Listed:
        def is_alive(self) -> bool:
            raise AssertionError("can only test a child process")

    launcher = PreflightMultiprocessingLauncher.__new__(PreflightMultiprocessingLauncher)
    launcher.procs, launcher.launched_by = [Listed()], os.getpid() + 1
    launcher.kill(signal.SIGTERM)  # another process's launch: nothing to pass on
