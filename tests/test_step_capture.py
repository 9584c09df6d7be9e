"""The captured training step (src/engine/steps/step_capture.py), proved on a CPU with a stand-in graph.

``tests/helpers/recorded_graph.py`` records the step's aten ops once and replays them on the same
tensors, running no Python: what a CUDA graph does. Trained through the real entry point with it, the
captured run equals the eager owned step bit for bit (weights, optimizer and scheduler state, logged
rows), so nothing the step needs is Python that a replay drops, no float that changes is baked in, and
every tensor the graph touches is still the one the run uses. The GPU twins are in tests/test_gpu.py.
"""

from __future__ import annotations

import csv
import logging
import re
from pathlib import Path

import pytest
import torch
from lightning import Callback

from src.engine.steps import step_capture
from src.models.components.toy_net import ToyNet
from src.models.regression_module import RegressionModule
from src.train import train
from tests.helpers.recorded_graph import RecordedGraph
from tests.helpers.run_if import gpu_test

STEP_LR = "model.scheduler={_target_:torch.optim.lr_scheduler.StepLR,_partial_:true,step_size:1,gamma:0.5}"
SCHEDULE_PER_STEP = "model._target_=tests.test_step_capture.PerStepScheduleRegression"
ONE_CYCLE = "model.scheduler={_target_:torch.optim.lr_scheduler.OneCycleLR,_partial_:true,max_lr:0.05,total_steps:20}"


class PerStepScheduleRegression(RegressionModule):
    """The toy model with its scheduler stepped every optimizer step (its learning rate lives on the device)."""

    def configure_optimizers(self):
        config = super().configure_optimizers()
        config["lr_scheduler"]["interval"] = "step"
        return config


class GradientWatcher(Callback):
    def on_after_backward(self, trainer, pl_module) -> None:
        pass


@pytest.fixture
def graphs(monkeypatch) -> list[RecordedGraph]:
    """CPU runs capture with the stand-in graph; the list collects every graph made."""
    made: list[RecordedGraph] = []

    def make() -> RecordedGraph:
        made.append(RecordedGraph())
        return made[-1]

    monkeypatch.setitem(step_capture.GRAPHS, "cpu", make)
    return made


def fit(make_cfg, subdir: str, *overrides: str) -> dict:
    cfg = make_cfg("train", ["test=false", *overrides], subdir=subdir)
    _, objects = train(cfg)
    objects["rows"] = logged_rows(Path(cfg.paths.output_dir))
    return objects


def logged_rows(run_dir: Path) -> list[dict]:
    (path,) = run_dir.glob("**/metrics.csv")
    with open(path) as f:
        return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in csv.DictReader(f)]


def assert_same_training(a: dict, b: dict) -> None:
    ma, mb = a["model"], b["model"]
    assert a["trainer"].global_step == b["trainer"].global_step > 0
    sa, sb = ma.state_dict(), mb.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa), [k for k in sa if not torch.equal(sa[k], sb[k])]
    oa, ob = (o["trainer"].optimizers[0].state_dict() for o in (a, b))
    assert all(torch.equal(oa["state"][i][k], ob["state"][i][k]) for i in oa["state"] for k in oa["state"][i])
    lra = [float(g["lr"]) for g in oa["param_groups"]]
    assert lra == [float(g["lr"]) for g in ob["param_groups"]]
    assert a["rows"] == b["rows"]


# -- the stand-in does what a CUDA graph does ---------------------------------------------------------------


@pytest.mark.fast
def test_the_stand_in_drops_python_bakes_floats_and_refuses_host_reads():
    weight, calls, lr = torch.ones(3), [], 0.5
    graph = RecordedGraph()
    with graph.capture():
        calls.append("python")
        weight.sub_(torch.full((3,), 2.0) * lr)
    assert torch.equal(weight, torch.ones(3)) and calls == ["python"]  # the capture left no trace
    lr = 0.25
    graph.replay()
    graph.replay()
    assert torch.equal(weight, torch.full((3,), -1.0)), "a replay reads the float recorded at capture"
    assert calls == ["python"], "a replay runs no Python"
    with pytest.raises(RuntimeError, match="reads a device value on the host"), RecordedGraph().capture():
        bool(weight.sum() > 0)


# -- captured against eager, through the entry point -------------------------------------------------------


@pytest.mark.parametrize(("case", "captures"), [
    # dropout; an epoch scheduler assigns a new float learning rate: one capture per epoch
    (["model=mlp", STEP_LR, "trainer.max_epochs=3"], 3),
    # a ragged last batch (eager); a step scheduler fills the learning rate on the device: one capture
    (["model=toy", "data=toy", SCHEDULE_PER_STEP, STEP_LR.replace("step_size:1,gamma:0.5", "step_size:5,gamma:0.9"),
      "data.batch_size=60", "++trainer.limit_train_batches=1.0", "trainer.max_epochs=2"], 1),
    # OneCycleLR also cycles Adam's beta1 every step (a tuple of floats, baked in): a capture per step
    (["model=toy", "data=toy", SCHEDULE_PER_STEP, ONE_CYCLE, "++trainer.limit_train_batches=12",
      "trainer.max_epochs=1"], 12 - step_capture.WARMUP_STEPS),
], ids=["mlp-dropout-epoch-scheduler", "toy-ragged-step-scheduler", "toy-momentum-cycle"])
def test_the_captured_step_equals_the_eager_step_bit_for_bit(make_cfg, graphs, case, captures):
    captured = fit(make_cfg, "captured", *case, "model.step_capture=true")
    eager = fit(make_cfg, "eager", *case, "model.step_capture=false")
    assert len(graphs) == captures and sum(g.replays for g in graphs) > captured["trainer"].global_step // 2
    assert_same_training(captured, eager)
    # The last graph still reads and writes the run's own parameters and optimizer state (same tensors).
    live = {t.untyped_storage().data_ptr() for t in captured["model"].parameters()}
    for state in captured["trainer"].optimizers[0].state.values():
        live |= {t.untyped_storage().data_ptr() for t in state.values() if isinstance(t, torch.Tensor)}
    assert live <= graphs[-1].pre_existing.keys()


@pytest.mark.parametrize("first", [True, False], ids=["captured-then-eager", "eager-then-captured"])
def test_a_run_resumes_across_modes(make_cfg, graphs, first):
    case = ["model=toy", "data=toy", "data.batch_size=60", "++trainer.limit_train_batches=1.0"]
    part = fit(make_cfg, "part", *case, "trainer.max_epochs=1", f"model.step_capture={first}")
    checkpoint = Path(part["trainer"].checkpoint_callback.dirpath) / "last.ckpt"
    lr = torch.load(checkpoint, weights_only=True)["optimizer_states"][0]["param_groups"][0]["lr"]
    assert isinstance(lr, float)  # loads in either mode
    resumed = fit(make_cfg, "resumed", *case, "trainer.max_epochs=2", f"model.step_capture={not first}",
                  f"ckpt_path={checkpoint}")
    whole = fit(make_cfg, "whole", *case, "trainer.max_epochs=2", "model.step_capture=false")
    resumed["rows"] = whole["rows"]  # the resumed run's log holds its second epoch only
    assert_same_training(resumed, whole)


# -- where it does not capture, it says why ----------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "why"), [
    ([], "capture needs a CUDA device"),
    (["model.owned_step=false"], "the training step is Lightning's"),
    (["model.fused_optimizer=false"], "the optimizer is not one fused"),
    (["+callbacks.watch._target_=tests.test_step_capture.GradientWatcher"], "GradientWatcher.on_after_backward"),
    (["model.compile=true"], "model.compile=true"),
])
def test_an_explicit_capture_request_on_an_ineligible_run_is_one_line(make_cfg, monkeypatch, capsys, overrides,
                                                                       why):
    if overrides:  # past the device check
        monkeypatch.setitem(step_capture.GRAPHS, "cpu", RecordedGraph)
    cfg = make_cfg("train", ["model=toy", "data=toy", "test=false", "model.step_capture=true", *overrides])
    with pytest.raises(SystemExit) as exit_info:
        train(cfg)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 2 and len(errors) == 1
    assert re.match(f"error: model.step_capture=true cannot capture this run: {why}.*; fix: ", errors[0]), errors


def test_auto_captures_where_eligible_and_not_elsewhere(make_cfg, graphs):
    objects = fit(make_cfg, "auto", "model=toy", "data=toy", "trainer.max_epochs=1")
    assert len(graphs) == 1 and graphs[0].replays == objects["trainer"].global_step - step_capture.WARMUP_STEPS
    graphs.clear()
    fit(make_cfg, "clipped", "model=toy", "data=toy", "trainer.max_epochs=1", "+trainer.gradient_clip_val=1.0")
    assert not graphs


# -- only networks known to be graph-safe are captured --------------------------------------------------------------


class UndeclaredNet(ToyNet):
    """ToyNet's layers, but a class of its own that has not declared itself graph-safe (declarations are not
    inherited)."""


class DeclaredNet(ToyNet):
    capture_safe = True


class HostSyncNet(ToyNet):
    """Declared (wrongly): its forward reads a device value on the host, which fails inside a capture."""

    capture_safe = True

    def forward(self, x):
        if bool(x.isfinite().all()):  # a host sync: fine eagerly, an error inside a CUDA capture (and the stand-in)
            return super().forward(x)
        raise ValueError("non-finite input")


class OwnCriterion(RegressionModule):
    """A loss of its own, which runs inside the captured step: not captured under auto unless declared."""

    def criterion(self, output, target):
        return torch.nn.functional.l1_loss(output, target)


TOY = ["model=toy", "data=toy", "trainer.max_epochs=2"]


def net(cls: type) -> str:
    return f"model.net._target_=tests.test_step_capture.{cls.__name__}"


def info_lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.mark.parametrize(("overrides", "why"), [
    ([net(UndeclaredNet)], "model.net is UndeclaredNet, which does not declare capture_safe = True"),
    (["model._target_=tests.test_step_capture.OwnCriterion"],
     "OwnCriterion.criterion runs inside the captured step and OwnCriterion does not declare capture_safe = True"),
], ids=["undeclared-net", "module-with-own-criterion"])
def test_auto_keeps_code_not_known_to_be_graph_safe_eager_and_says_why(make_cfg, graphs, caplog, overrides, why):
    with caplog.at_level(logging.INFO):
        objects = fit(make_cfg, "auto", *TOY, *overrides)
    assert not graphs and objects["model"].step_capture_counts == (0, 0)
    lines = info_lines(caplog, "the owned training step runs eagerly")
    assert len(lines) == 1 and why in lines[0] and "docs/subclassing.md" in lines[0], lines


def test_an_explicit_capture_request_on_an_undeclared_net_is_one_line(make_cfg, graphs, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train(make_cfg("train", ["test=false", *TOY, net(UndeclaredNet), "model.step_capture=true"]))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert exit_info.value.code == 2 and len(errors) == 1 and not graphs
    assert re.match("error: model.step_capture=true cannot capture this run: model.net is UndeclaredNet, which does "
                    "not declare capture_safe = True.*; fix: ", errors[0]), errors


def test_a_declared_net_is_captured_and_equals_the_eager_step(make_cfg, graphs):
    captured = fit(make_cfg, "captured", *TOY, net(DeclaredNet))
    eager = fit(make_cfg, "eager", *TOY, net(DeclaredNet), "model.step_capture=false")
    assert len(graphs) == 1 and graphs[0].replays == captured["trainer"].global_step - step_capture.WARMUP_STEPS
    assert captured["model"].step_capture_counts == (1, graphs[0].replays)
    assert_same_training(captured, eager)


def test_a_capture_that_fails_falls_back_to_the_eager_step_with_one_warning(make_cfg, graphs, caplog):
    """The capture raises (a host sync in forward): one warning, the failed step runs eagerly once, the fit finishes,
    and every number equals a run that never tried to capture."""
    with caplog.at_level(logging.INFO):
        fallen_back = fit(make_cfg, "fallback", *TOY, net(HostSyncNet))
    eager = fit(make_cfg, "eager", *TOY, net(HostSyncNet), "model.step_capture=false")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "could not be captured" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    assert "reads a device value on the host" in warnings[0].getMessage()
    assert len(graphs) == 1 and graphs[0].replays == 0  # tried once, never replayed
    assert fallen_back["model"].step_capture_counts == (0, 0)
    assert_same_training(fallen_back, eager)  # weights, optimizer state, learning rates, step count, logged rows
    assert all(isinstance(g["lr"], float) for g in fallen_back["trainer"].optimizers[0].param_groups)


def test_a_capture_that_fails_with_a_step_scheduler_falls_back_exactly(make_cfg, graphs):
    """With a step-interval scheduler the capture first moves the learning rates onto the device: the fallback puts
    them back as floats, and the eager numbers follow."""
    case = [*TOY, net(HostSyncNet), SCHEDULE_PER_STEP, STEP_LR.replace("step_size:1,gamma:0.5", "step_size:5,gamma:0.9")]
    fallen_back = fit(make_cfg, "fallback", *case)
    eager = fit(make_cfg, "eager", *case, "model.step_capture=false")
    assert len(graphs) == 1 and graphs[0].replays == 0
    assert_same_training(fallen_back, eager)


# -- on a GPU: the real CUDA graph ----------------------------------------------------------------------------

GPU = ["trainer=gpu", "trainer.accelerator=gpu"]


def max_weight_difference(a: dict, b: dict) -> float:
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa if sa[k].is_floating_point())


@gpu_test(1)
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_on_a_gpu_the_captured_step_equals_the_eager_step(make_cfg, record_property, precision):
    """60 steps of the default MLP (dropout on), validation and checkpoints between epochs: bit for bit."""
    case = [*GPU, f"trainer.precision={precision}", "++trainer.limit_train_batches=30", "trainer.max_epochs=2"]
    captured = fit(make_cfg, "captured", *case, "model.step_capture=true")
    eager = fit(make_cfg, "eager", *case, "model.step_capture=false")
    record_property("max_weight_difference", max_weight_difference(captured, eager))
    assert captured["model"].step_capture_counts == (1, 60 - step_capture.WARMUP_STEPS)
    assert eager["model"].step_capture_counts == (0, 0)
    assert_same_training(captured, eager)


@gpu_test(1)
def test_on_a_gpu_a_step_scheduler_moves_the_captured_learning_rate(make_cfg, record_property):
    """The learning rate a step scheduler sets reaches every replay (float32 on the device: close, not equal)."""
    case = [*GPU, "model=toy", "data=toy", SCHEDULE_PER_STEP, STEP_LR.replace("step_size:1", "step_size:3"),
            "trainer.max_epochs=2"]
    captured = fit(make_cfg, "captured", *case, "model.step_capture=true")
    eager = fit(make_cfg, "eager", *case, "model.step_capture=false")
    record_property("max_weight_difference", max_weight_difference(captured, eager))
    assert captured["model"].step_capture_counts[0] == 1
    lrs = [float(o["trainer"].optimizers[0].param_groups[0]["lr"]) for o in (captured, eager)]
    assert lrs[0] == pytest.approx(lrs[1], rel=1e-6) and lrs[1] < 0.01 * 0.5 ** 4
    sa, sb = captured["model"].state_dict(), eager["model"].state_dict()
    assert all(torch.allclose(sa[k], sb[k], rtol=1e-4, atol=1e-6) for k in sa)


@gpu_test(1)
def test_on_a_gpu_a_captured_run_resumes_captured(make_cfg):
    """One captured epoch, resumed captured for a second: the uninterrupted captured run's weights."""
    case = [*GPU, "trainer.precision=bf16-mixed", "++trainer.limit_train_batches=20"]
    part = fit(make_cfg, "part", *case, "trainer.max_epochs=1")
    checkpoint = Path(part["trainer"].checkpoint_callback.dirpath) / "last.ckpt"
    resumed = fit(make_cfg, "resumed", *case, "trainer.max_epochs=2", f"ckpt_path={checkpoint}")
    whole = fit(make_cfg, "whole", *case, "trainer.max_epochs=2")
    assert resumed["model"].step_capture_counts[1] > 0 and whole["model"].step_capture_counts[1] > 0
    resumed["rows"] = whole["rows"]
    assert_same_training(resumed, whole)


@gpu_test(1)
def test_on_a_gpu_resnet18_trains_captured(make_cfg, synthetic_cifar10, record_property):
    """ResNet18 (BatchNorm, SGD with momentum, channels_last, bf16): captured and eager differ no more than two
    eager runs do (cuDNN's convolution backward may add in any order)."""
    case = [*GPU, "trainer.precision=bf16-mixed", "data=cifar10", "model=resnet18", f"data.data_dir={synthetic_cifar10}",
            "data.verify_checksums=false", "data.val_size=100", "data.batch_size=32", "++trainer.limit_train_batches=12",
            "trainer.max_epochs=2", "trainer.benchmark=false"]
    captured = fit(make_cfg, "captured", *case, "model.step_capture=true")
    eager = fit(make_cfg, "eager", *case, "model.step_capture=false")
    again = fit(make_cfg, "again", *case, "model.step_capture=false")
    difference, noise = max_weight_difference(captured, eager), max_weight_difference(again, eager)
    record_property("max_weight_difference", difference)
    record_property("eager_noise", noise)
    captures, replayed = captured["model"].step_capture_counts
    assert captures == 1 and replayed >= captured["trainer"].global_step // 2  # ragged batches run eagerly
    assert difference <= max(10 * noise, 1e-5)
