"""The owned training step (manual optimization, src/engine/steps/owned_step.py) gives Lightning's automatic
optimization's numbers bit for bit: weights, optimizer and scheduler state, logged rows, over several
epochs, in one process and under DDP x2; and a run killed under one resumes under the other."""

from __future__ import annotations

import csv
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from lightning import Callback
from lightning.pytorch.callbacks import LambdaCallback
from lightning.pytorch.profilers import PassThroughProfiler

from src.engine.checkpointing.last_checkpoint import last_checkpoint_path
from src.models.regression_module import RegressionModule
from src.train import train
from tests.helpers.training_runs import finish, run_dirs, start, wait_for_checkpoint

pytestmark = pytest.mark.slow

STEP_LR = "model.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:1,gamma:0.5}"
PLATEAU = "model.scheduler={_target_:torch.optim.lr_scheduler.ReduceLROnPlateau,_partial_:true,patience:0,factor:0.5}"
SHORT = ["trainer.max_epochs=3", "++trainer.limit_train_batches=12", "++trainer.limit_val_batches=3"]


def logged_rows(run_dir: Path) -> list[dict]:
    """The CSV log without the wall-clock columns."""
    with open(run_dir / "csv" / "version_0" / "metrics.csv") as f:
        return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in csv.DictReader(f)]


def assert_same_state(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"] > 0
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert a["lr_schedulers"] == b["lr_schedulers"]


@pytest.mark.parametrize("launch", [[], ["trainer=ddp", "trainer.devices=2"]], ids=["1-process", "ddp-2-ranks"])
def test_owned_step_equals_lightnings_step_bit_for_bit(tmp_path, launch):
    runs = {}
    for owned in (True, False):
        proc = start(tmp_path / str(owned), *launch, *SHORT, STEP_LR, f"model.owned_step={owned}")
        assert finish(proc) == 0, proc.stderr_text[-3000:]
        (runs[owned],) = run_dirs(tmp_path / str(owned))
    last = {owned: torch.load(d / "checkpoints" / "last.ckpt", weights_only=False) for owned, d in runs.items()}
    assert last[True]["lr_schedulers"][0]["_last_lr"] != last[True]["lr_schedulers"][0]["base_lrs"]  # it stepped
    assert_same_state(last[True], last[False])
    assert logged_rows(runs[True]) == logged_rows(runs[False])


class KeepEpochEndCheckpoint(Callback):
    """Copies ``last.ckpt`` as epoch 1's end saved it (before Lightning's loop steps a plateau scheduler)."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 2:
            shutil.copy(last_checkpoint_path(trainer), last_checkpoint_path(trainer).with_name("epoch_1_end.ckpt"))


def test_a_plateau_scheduler_steps_on_the_same_metric_and_resumes_from_an_epoch_end(make_cfg):
    """ReduceLROnPlateau under either step: the same weights and scheduler state when fit ends; and a run resumed
    from the ``last.ckpt`` of an epoch's end ends there too (it held the scheduler before its step, which the
    resume then skipped)."""
    keep = "+callbacks.keep._target_=tests.test_owned_step.KeepEpochEndCheckpoint"
    ends, resumed = [], []
    for owned in (True, False):
        common = ["model=toy", "data=toy", PLATEAU, f"model.owned_step={owned}", "test=false", "trainer.max_epochs=4"]
        _, objects = train(make_cfg("train", [*common, keep], subdir=f"{owned}"))
        module = objects["model"]
        assert module.automatic_optimization is not owned
        ends.append((module.state_dict(), objects["trainer"].lr_scheduler_configs[0].scheduler.state_dict()))
        epoch_end = last_checkpoint_path(objects["trainer"]).with_name("epoch_1_end.ckpt")
        _, objects = train(make_cfg("train", [*common, f"ckpt_path={epoch_end}"], subdir=f"{owned}-resumed"))
        resumed.append((objects["model"].state_dict(), objects["trainer"].lr_scheduler_configs[0].scheduler.state_dict()))
    (weights, plateau), (weights_lightning, plateau_lightning) = ends
    assert all(torch.equal(weights[k], weights_lightning[k]) for k in weights)
    assert plateau == plateau_lightning and plateau["last_epoch"] == 4
    for (weights, plateau), (weights_resumed, plateau_resumed) in zip(ends, resumed, strict=True):
        assert plateau_resumed == plateau, "the resumed scheduler took every epoch's step"
        assert all(torch.equal(weights[k], weights_resumed[k]) for k in weights)


@pytest.mark.faults
@pytest.mark.parametrize("first", [True, False], ids=["owned-then-lightning", "lightning-then-owned"])
def test_a_run_killed_in_one_mode_resumes_in_the_other_bit_exact(tmp_path, first, reference_runs):
    """kill -9 mid-run, then resume it with the other mode (``ckpt_path`` into the same run dir): the
    uninterrupted run's weights."""
    proc = start(tmp_path, f"model.owned_step={first}")
    assert wait_for_checkpoint(proc, tmp_path), proc.stderr_text if proc.poll() else "no checkpoint"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    (run_dir,) = run_dirs(tmp_path)
    killed_at = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    resumed = start(tmp_path, f"model.owned_step={not first}", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
                    f"hydra.run.dir={run_dir}")
    assert finish(resumed) == 0, resumed.stderr_text[-3000:]
    final = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    expected = torch.load(reference_runs() / "checkpoints" / "last.ckpt", weights_only=False)
    assert 0 < killed_at < final["global_step"] == expected["global_step"]
    assert all(torch.equal(final["state_dict"][k], expected["state_dict"][k]) for k in expected["state_dict"])




LISTENED = {"calls": 0}  # calls of the listeners below, in this process


class CountsBackward(Callback):
    """Overrides a hook Lightning runs inside the step: the owned step must then keep Lightning's calls."""

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        LISTENED["calls"] += 1


def lambda_listener() -> LambdaCallback:
    """The same hook, set on an instance (as ``LambdaCallback`` sets the hooks it is given)."""
    return LambdaCallback(on_before_backward=lambda trainer, pl_module, loss: LISTENED.__setitem__(
        "calls", LISTENED["calls"] + 1))


class CountsManualBackward(RegressionModule):
    """A module whose ``manual_backward`` does more than Lightning's."""

    def manual_backward(self, loss, *args, **kwargs) -> None:
        LISTENED["calls"] += 1
        super().manual_backward(loss, *args, **kwargs)


class WatchesOptimizerStep(PassThroughProfiler):
    """Records, for each ``optimizer_step`` entry, whether the weights changed inside it (the entry holds the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: torch.Tensor | None = None
        self.changed: list[bool] = []

    def start(self, action_name: str) -> None:
        if action_name == "optimizer_step" and self.watched is not None:
            self._before = self.watched.detach().clone()

    def stop(self, action_name: str) -> None:
        if action_name == "optimizer_step" and self.watched is not None:
            self.changed.append(not torch.equal(self._before, self.watched))


class WatchWeights(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        trainer.profiler.watched = next(pl_module.parameters())


LISTENERS = {"callback": "+callbacks.counts._target_=tests.test_owned_step.CountsBackward",
             "instance-hook": "+callbacks.counts._target_=tests.test_owned_step.lambda_listener",
             "module": "model._target_=tests.test_owned_step.CountsManualBackward"}


def assert_direct_step_equals_lightnings_calls(make_cfg, listener: str, *overrides: str) -> None:
    """Train twice: with nothing listening inside the step (the owned step calls backward and the optimizer itself),
    and with ``listener`` (Lightning's ``manual_backward``/``optimizer.step()``, which call it every step). Both
    end with the same weights, Adam state and step count, and the profiler's ``optimizer_step`` entry holds
    each weight update."""
    common = ["model=toy", "data=toy", "model.optimizer._target_=torch.optim.Adam", STEP_LR, "test=false",
              "trainer.max_epochs=2", "trainer.profiler._target_=tests.test_owned_step.WatchesOptimizerStep",
              "+callbacks.watch._target_=tests.test_owned_step.WatchWeights", *overrides]
    LISTENED["calls"] = 0
    ends = {}
    for listens in (False, True):
        _, objects = train(make_cfg("train", [*common, *([LISTENERS[listener]] if listens else [])], subdir=str(listens)))
        module, trainer = objects["model"], objects["trainer"]
        assert not module.automatic_optimization and module._direct is not listens
        assert trainer.profiler.changed == [True] * trainer.global_step
        ends[listens] = (trainer.global_step, module.state_dict(), trainer.optimizers[0].state_dict())
    assert LISTENED["calls"] == ends[True][0] > 0
    (steps, weights, optim), (steps_l, weights_l, optim_l) = ends[False], ends[True]
    assert steps == steps_l
    assert all(torch.equal(weights[k], weights_l[k]) for k in weights)
    state, state_l = optim["state"], optim_l["state"]
    assert state.keys() == state_l.keys() and len(state) > 0
    assert all(torch.equal(state[i][k], state_l[i][k]) for i in state for k in ("exp_avg", "exp_avg_sq", "step"))


@pytest.mark.parametrize("listener", list(LISTENERS))
def test_the_direct_owned_step_equals_the_one_through_lightnings_calls(make_cfg, listener):
    assert_direct_step_equals_lightnings_calls(make_cfg, listener)


@pytest.mark.fast
def test_the_direct_step_steps_aside_for_ddps_model_averaging():
    """Post-local SGD averages the parameters inside DDP's optimizer step: the direct call would skip that."""
    from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from src.engine.steps.owned_step import adds_to_optimizer_step
    from src.engine.strategies.ddp import DDPStrategy

    assert not adds_to_optimizer_step(DDPStrategy())
    assert adds_to_optimizer_step(DDPStrategy(model_averaging_period=4))
    assert adds_to_optimizer_step(LightningDDPStrategy())  # it does not say whether it averages
    assert not adds_to_optimizer_step(SingleDeviceStrategy("cpu"))
