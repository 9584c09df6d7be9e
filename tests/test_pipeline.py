"""The ``pipeline`` strategy: split, schedules, exactness against one device, pp x dp, checkpoints, bad input.

Multi-process tests run real Lightning fits inside processes started by ``run_workers``
(gloo on CPU); Lightning joins the existing process group. Each scenario has its own spawn, so
one failure cannot hide another.
"""

from __future__ import annotations

import copy
import math
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torchmetrics import SumMetric

import src.engine.strategies  # noqa: F401  (registers "pipeline")
from src.data.toy_datamodule import ToyDataModule
from src.engine.checkpointing.optimizer_state import group_names, named_optimizer_state, names_in_order
from src.engine.steps.step_module import STAGES
from src.engine.strategies.pipeline import checkpoint as ckpt
from src.engine.strategies.pipeline.mesh import resolve_layout
from src.engine.strategies.pipeline.partition import balanced_split, plan_stages, split_table
from src.engine.strategies.pipeline.schedule import check_schedule, stage_indices
from src.engine.strategies.pipeline.strategy import PipelineStrategy
from src.engine.utils.errors import ConfigError
from src.models.components.mlp import MLP
from src.models.components.toy_net import ToyNet
from src.models.regression_module import RegressionModule
from tests.helpers.entry import run_entry
from tests.helpers.multiprocess import run_workers
from tests.test_bad_input import error_line

SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)]


# ----------------------------------------------------------------------------------------------
# models, data and trainers shared by the workers
# ----------------------------------------------------------------------------------------------
class CountingRegression(RegressionModule):
    """Also sums the samples recorded per stage (``{stage}/seen``): a SumMetric, so a world-wide sync
    would count every sample once per pipeline stage."""

    def __init__(self, net: nn.Module, lr: float = 0.1) -> None:
        super().__init__(net=net, optimizer=partial(torch.optim.SGD, lr=lr))
        for stage in STAGES:
            setattr(self, f"{stage}_seen", SumMetric())

    def record_step(self, stage, out):
        seen = getattr(self, f"{stage}_seen")
        seen.update(torch.tensor(float(out["target"].shape[0])))
        self.log(f"{stage}/seen", seen, on_step=False, on_epoch=True)
        return super().record_step(stage, out)


class BatchRecorder(Callback):
    """Keeps every training batch this rank received (to replay them on an unsplit reference)."""

    def __init__(self) -> None:
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append([t.detach().clone() for t in batch])


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # four blocks: fc0, fc1, fc2, head -> up to 4 (virtual) stages
    return MLP(in_channels=10, image_size=1, hidden_sizes=(16, 16, 16), num_classes=5, dropout=0.0)


def _toy_data(**kwargs) -> ToyDataModule:
    # test split of 50: per-replica eval batches of 16 end with a batch of 2, padded to n_microbatches
    defaults = dict(num_samples=512, num_test=50, batch_size=16, val_size=64)
    return ToyDataModule(**{**defaults, **kwargs})


def _trainer(strategy: PipelineStrategy, devices: int, root=None, **kwargs) -> Trainer:
    options = dict(
        accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=root,
    )
    return Trainer(**{**options, **kwargs})


def _reference_steps(net: nn.Module, batches, lr: float = 0.1) -> nn.Module:
    """The unsplit net after one SGD step per (full) batch on one device."""
    net = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return net


def _max_diff(state: dict, net: nn.Module) -> float:
    ref = {f"net.{k}": v for k, v in net.state_dict().items()}
    assert state.keys() == ref.keys(), (sorted(state), sorted(ref))
    return max((state[k] - ref[k]).abs().max().item() for k in ref)


def _test_loss(net: nn.Module, data: ToyDataModule) -> float:
    x, y = data.data_test.inputs, data.data_test.targets
    with torch.no_grad():
        return F.mse_loss(net(x), y).item()


# ----------------------------------------------------------------------------------------------
# fast checks: no processes
# ----------------------------------------------------------------------------------------------
@pytest.mark.fast
def test_balanced_split_minimises_the_largest_stage():
    assert [list(r) for r in balanced_split([5, 1, 1, 1, 1, 1], 2)] == [[0], [1, 2, 3, 4, 5]]
    assert [list(r) for r in balanced_split([1, 1, 1, 1], 4)] == [[0], [1], [2], [3]]
    parts = balanced_split([3, 1, 4, 1, 5, 9, 2, 6], 3)
    assert [i for r in parts for i in r] == list(range(8))  # contiguous, complete, in order
    assert max(sum([3, 1, 4, 1, 5, 9, 2, 6][i] for i in r) for r in parts) == 14  # optimum: 3+1+4+1 | 5+9 | 2+6
    with pytest.raises(ConfigError, match="has 2 blocks but the pipeline needs 3 stages"):
        balanced_split([1, 1], 3)


@pytest.mark.fast
def test_plan_of_an_mlp_and_its_table():
    plan = plan_stages(_mlp(), 2)
    assert [s.blocks for s in plan] == [("fc0", "fc1"), ("fc2", "head")]  # 448 | 357 parameters
    assert sum(s.params for s in plan) == sum(p.numel() for p in _mlp().parameters())
    table = split_table(plan, [[0, 2], [1, 3]], "params")
    assert table.row_count == 2 and [c.header for c in table.columns][:3] == ["stage", "blocks", "params"]
    assert stage_indices(1, 2, 2) == [1, 3]  # interleaved "loop" placement


@pytest.mark.fast
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "ZeroBubble"}, "schedule='ZeroBubble' is unknown"),
        ({"n_microbatches": 0}, "n_microbatches=0 is not an integer >= 1"),
        ({"schedule": "Interleaved1F1B"}, "set trainer.strategy.stages_per_rank=2"),
        ({"schedule": "GPipe", "stages_per_rank": 2}, "set stages_per_rank=1"),
        ({"dp_size": 0}, "dp_size=0 is not an integer >= 1"),
        ({"balance": "flops"}, "balance='flops' is unknown; fix: use one of params, time"),
        ({"stages": 0}, "stages=0 is not an integer >= 1"),
    ],
)
def test_bad_strategy_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PipelineStrategy(**kwargs)


@pytest.mark.fast
def test_layout_and_schedule_constraints():
    assert resolve_layout(4, None, 2).pp == 2 and resolve_layout(4, 2, 2).coords(3) == (1, 1)
    with pytest.raises(ConfigError, match="stages=3 x dp_size=1 = 3 processes, but the trainer has 2"):
        resolve_layout(2, 3, 1)
    with pytest.raises(ConfigError, match="multiple of trainer.strategy.dp_size"):
        resolve_layout(3, None, 2)
    with pytest.raises(ConfigError, match="1F1B needs n_microbatches >= the number of stages"):
        check_schedule("1F1B", 2, 1, pp=4)
    with pytest.raises(ConfigError, match="use a multiple of 2"):
        check_schedule("Interleaved1F1B", 5, 2, pp=2)
    check_schedule("GPipe", 1, 1, pp=4)  # GPipe takes any number of micro-batches


@pytest.mark.fast
def test_bad_layouts_fail_before_any_process_starts():
    trainer = Trainer(accelerator="cpu", devices=2, strategy=PipelineStrategy(stages=3), logger=False)
    with pytest.raises(ConfigError, match="stages=3 x dp_size=1"):
        trainer.fit(CountingRegression(_mlp()), datamodule=_toy_data())
    trainer = Trainer(accelerator="cpu", devices=4, strategy=PipelineStrategy(n_microbatches=2), logger=False)
    with pytest.raises(ConfigError, match="1F1B needs n_microbatches"):
        trainer.fit(CountingRegression(_mlp()), datamodule=_toy_data())
    assert "pipeline" in StrategyRegistry
    assert isinstance(Trainer(accelerator="cpu", devices=2, strategy="pipeline", logger=False).strategy,
                      PipelineStrategy)


@pytest.mark.fast
@pytest.mark.parametrize(
    ("model", "trainer_kwargs", "message"),
    [
        (lambda: CountingRegression(ToyNet()), {"devices": 3}, "has 2 blocks, fewer than the 3 pipeline stages"),
        (lambda: CountingRegression(nn.Linear(10, 5)), {}, "CountingRegression lacks net \\(it is a Linear\\); fix: build the net as an nn.Sequential"),
        (lambda: CountingRegression(ToyNet()), {"gradient_clip_val": 1.0}, "gradient_clip_algorithm=value"),
        (lambda: CountingRegression(ToyNet()), {"sync_batchnorm": True}, "sync_batchnorm=true is not supported"),
    ],
)
def test_bad_models_fail_before_any_process_starts(model, trainer_kwargs, message):
    options = {"devices": 2, **trainer_kwargs}
    trainer = Trainer(accelerator="cpu", strategy=PipelineStrategy(), logger=False, **options)
    with pytest.raises(ConfigError, match=message):
        trainer.fit(model(), datamodule=_toy_data())


@pytest.mark.fast
def test_root_cause_is_reported_first():
    """8 stages for a 2-block net also breaks 1F1B's micro-batch count and the batch split: the blocks come first."""
    trainer = Trainer(accelerator="cpu", devices=8, strategy=PipelineStrategy(n_microbatches=4), logger=False)
    with pytest.raises(ConfigError, match="model.net has 2 blocks, fewer than the 8 pipeline stages"):
        trainer.fit(CountingRegression(ToyNet()), datamodule=_toy_data(batch_size=30))


@pytest.mark.fast
def test_batch_that_does_not_split_is_refused_before_any_process_starts():
    trainer = Trainer(accelerator="cpu", devices=2, strategy=PipelineStrategy(n_microbatches=4), logger=False)
    with pytest.raises(ConfigError, match=r"data.batch_size=30 .* 1 data-parallel replica\(s\) x 4 micro-batches; "
                                          r"fix: use a multiple of 4"):
        trainer.fit(CountingRegression(ToyNet()), datamodule=_toy_data(batch_size=30))


@pytest.mark.fast
def test_predict_is_refused_before_any_process_starts():
    trainer = Trainer(accelerator="cpu", devices=2, strategy=PipelineStrategy(), logger=False)
    with pytest.raises(ConfigError, match="does not predict"):
        trainer.predict(CountingRegression(ToyNet()), datamodule=_toy_data())


@pytest.mark.fast
def test_one_global_batch_rule_for_every_strategy():
    """One function owns the split: replicas x micro-batches for a pipeline, replicas for DDP, >= devices for dp."""
    from src.engine.strategies.dp import DataParallelStrategy
    from src.engine.strategies.global_batch import per_replica_batch_size

    pipe = Trainer(accelerator="cpu", devices=4, strategy=PipelineStrategy(dp_size=2, n_microbatches=4),
                   logger=False).strategy
    assert per_replica_batch_size(64, pipe) == 32
    with pytest.raises(ConfigError, match="2 data-parallel replica\\(s\\) x 4 micro-batches; fix: use a multiple of 8"):
        per_replica_batch_size(36, pipe)
    ddp = Trainer(accelerator="cpu", devices=3, strategy="ddp", logger=False).strategy
    assert per_replica_batch_size(12, ddp) == 4
    with pytest.raises(ConfigError, match="3 data-parallel replica\\(s\\); fix: use a multiple of 3"):
        per_replica_batch_size(10, ddp)
    dp = Trainer(accelerator="cpu", devices=4, strategy=DataParallelStrategy(), logger=False).strategy
    assert per_replica_batch_size(6, dp) == 6  # one process: dp splits the whole batch itself, unevenly if need be
    with pytest.raises(ConfigError, match="each of the 4 dp devices a sample"):
        per_replica_batch_size(3, dp)


@pytest.mark.fast
def test_optimizer_state_merges_by_name_and_splits_back():
    """Two stage optimizers merge into the unsplit model's optimizer state, and split back unchanged."""
    full = _mlp()
    x, y = torch.randn(8, 10), torch.randn(8, 5)
    whole = torch.optim.Adam(full.parameters(), lr=0.01)
    F.mse_loss(full(x), y).backward()
    whole.step()

    model = nn.Module()
    model.net = full
    stage_params = [list(full.fc0.parameters()) + list(full.fc2.parameters()),  # interleaved: rank 0
                    list(full.fc1.parameters()) + list(full.head.parameters())]
    stage_opts = [torch.optim.Adam(p, lr=0.01) for p in stage_params]
    for opt in stage_opts:  # same gradients, so same state as the whole-model optimizer
        opt.step()
    parts = [named_optimizer_state(opt.state_dict(), names_in_order(opt, model)) for opt in stage_opts]
    merged = ckpt.merge_optimizer_states(parts, ["fc0", "fc1", "fc2", "head"])
    reference = whole.state_dict()
    assert merged["param_groups"][0]["params"] == reference["param_groups"][0]["params"]
    assert merged["param_groups"][0]["param_names"] == [f"net.{n}" for n, _ in full.named_parameters()]
    for i, state in reference["state"].items():
        assert torch.equal(merged["state"][i]["exp_avg"], state["exp_avg"])

    # it loads into a single-device optimizer, and each stage gets exactly its own state back
    torch.optim.Adam(full.parameters(), lr=0.01).load_state_dict(merged)
    for opt in stage_opts:
        local = ckpt.local_optimizer_state(merged, group_names(opt, model), [])
        mine = opt.state_dict()
        assert local["param_groups"][0]["params"] == mine["param_groups"][0]["params"]
        for i in mine["state"]:
            assert torch.equal(local["state"][i]["exp_avg_sq"], mine["state"][i]["exp_avg_sq"])
    # a name-less (single-device) state is read in the unsplit model's order
    fallback = [f"net.{n}" for n, _ in full.named_parameters()]
    local = ckpt.local_optimizer_state(reference, group_names(stage_opts[1], model), fallback)
    assert torch.equal(local["state"][0]["exp_avg"], reference["state"][2]["exp_avg"])  # fc1.weight is 3rd


# ----------------------------------------------------------------------------------------------
# 2 processes: each schedule equals one device; eval padding; balance=time; exact resume
# ----------------------------------------------------------------------------------------------
def _schedules_worker(rank: int, world_size: int) -> dict:
    out: dict = {}
    for name, per_rank in SCHEDULES:
        seed_everything(0)
        net = _mlp()
        reference = copy.deepcopy(net)
        recorder = BatchRecorder()
        model = CountingRegression(net)
        data = _toy_data()
        strategy = PipelineStrategy(schedule=name, stages_per_rank=per_rank, n_microbatches=4)
        trainer = _trainer(strategy, world_size, max_steps=1, callbacks=[recorder])
        trainer.fit(model, datamodule=data)
        state = trainer.strategy.lightning_module_state_dict()  # collective: gathered on rank 0
        step = _reference_steps(reference, recorder.batches)
        logged = float(trainer.callback_metrics["train/loss"])
        with torch.no_grad():
            x, y = recorder.batches[0]
            expected_loss = F.mse_loss(reference(x), y).item()
        trainer.test(model, datamodule=data, verbose=False)
        out[name] = {
            "diff": _max_diff(state, step) if rank == 0 else None,
            "loss_diff": abs(logged - expected_loss),
            "test_diff": abs(float(trainer.callback_metrics["test/loss"]) - _test_loss(step, data)),
            "test_seen": float(trainer.callback_metrics["test/seen"]),
            "local_blocks": [n for n, _ in model.net.named_children()],
        }
    return out


def _accumulate_worker(rank: int, world_size: int) -> float | None:
    """Gradient accumulation: two batches, one step, the mean of their gradients."""
    seed_everything(0)
    net = _mlp()
    reference = copy.deepcopy(net)
    recorder = BatchRecorder()
    trainer = _trainer(PipelineStrategy(), world_size, max_steps=1, accumulate_grad_batches=2, callbacks=[recorder])
    trainer.fit(CountingRegression(net), datamodule=_toy_data())
    state = trainer.strategy.lightning_module_state_dict()
    pair = [torch.cat([recorder.batches[0][i], recorder.batches[1][i]]) for i in (0, 1)]  # equal halves
    return _max_diff(state, _reference_steps(reference, [pair])) if rank == 0 else None


def _time_plan_worker(rank: int, world_size: int) -> list:
    """balance=time: rank 0 measures, every rank gets the same split."""
    seed_everything(0)
    strategy = PipelineStrategy(balance="time", n_microbatches=2)
    _trainer(strategy, world_size, max_steps=1).fit(CountingRegression(_mlp()), datamodule=_toy_data())
    return [s.blocks for s in strategy._plan]


def _resume_worker(rank: int, world_size: int, root: str) -> dict:
    """2 epochs + resume to 3 == 3 epochs straight (weights, optimizer, sampler epoch)."""

    def fit(epochs: int, ckpt_path=None, save=False):
        seed_everything(0)
        model = CountingRegression(ToyNet(), lr=0.05)
        callbacks = [ModelCheckpoint(dirpath=root, save_last=True)] if save else []
        trainer = _trainer(PipelineStrategy(), world_size, root=root, max_epochs=epochs, callbacks=callbacks,
                           enable_checkpointing=save, limit_train_batches=6)
        trainer.fit(model, datamodule=_toy_data(), ckpt_path=ckpt_path)
        return trainer.strategy.lightning_module_state_dict(), trainer.global_step

    fit(2, save=True)
    resumed, step = fit(3, ckpt_path=f"{root}/last.ckpt")
    straight, _ = fit(3)
    return {"step": step, "diff": max((resumed[k] - straight[k]).abs().max().item() for k in straight)
            if rank == 0 else None}


class RecordingPipeline(PipelineStrategy):
    """Records which blocks this rank holds when the model is moved to its device."""

    def model_to_device(self) -> None:
        self.blocks_at_move = [n for n, _ in self.lightning_module.net.named_children()]
        super().model_to_device()


class PlacementProbe(Callback):
    """The parameters this rank holds at every point after setup."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def _record(self, point: str, module) -> None:
        self.seen.append((point, sum(p.numel() for p in module.parameters())))

    def on_fit_start(self, trainer, module):
        self._record("fit_start", module)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._record("train_batch", module)

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self._record("val_batch", module)

    def on_test_start(self, trainer, module):
        self._record("test_start", module)


def _placement_worker(rank: int, world_size: int) -> dict:
    seed_everything(0)
    net = _mlp()
    stage_params = {0: sum(p.numel() for b in (net.fc0, net.fc1) for p in b.parameters()),
                    1: sum(p.numel() for b in (net.fc2, net.head) for p in b.parameters())}
    strategy, probe = RecordingPipeline(n_microbatches=4), PlacementProbe()
    trainer = _trainer(strategy, world_size, max_steps=2, limit_val_batches=1, val_check_interval=1,
                       callbacks=[probe])
    model = CountingRegression(net)
    trainer.fit(model, datamodule=_toy_data())
    fit_move = strategy.blocks_at_move
    trainer.test(model, datamodule=_toy_data(), verbose=False)
    return {"moved": [fit_move, strategy.blocks_at_move], "seen": probe.seen, "expected": stage_params[rank],
            "full": sum(stage_params.values())}


@pytest.mark.slow
def test_each_schedule_matches_one_device():
    """Proof 1: for every schedule, one optimizer step of 2 stages x 4 micro-batches gives the unsplit
    model's parameters after one step on the same batch (1e-5), so the schedule's 1/n_microbatches
    gradient scaling yields the full-batch-mean gradient. Logged train loss and test loss (last test
    batch of 2 padded to 4 micro-batches) are exact, and each rank keeps only its own blocks."""
    results = run_workers(_schedules_worker, 2, timeout=300)
    for name, _ in SCHEDULES:
        assert results[0][name]["diff"] < 1e-5, name
        for rank in (0, 1):
            r = results[rank][name]
            assert r["loss_diff"] < 1e-5 and r["test_diff"] < 1e-5, (name, rank, r)
            assert r["test_seen"] == 50  # every test sample once, none of the padding
    assert results[0]["1F1B"]["local_blocks"] == ["fc0", "fc1"]
    assert results[1]["1F1B"]["local_blocks"] == ["fc2", "head"]
    assert results[0]["Interleaved1F1B"]["local_blocks"] == ["fc0", "fc2"]


@pytest.mark.slow
def test_gradient_accumulation_matches_one_step_on_both_batches():
    assert run_workers(_accumulate_worker, 2, timeout=300)[0] < 1e-5


@pytest.mark.slow
def test_balance_by_time_agrees_across_ranks():
    plans = run_workers(_time_plan_worker, 2, timeout=300)
    assert plans[0] == plans[1] and len(plans[0]) == 2


@pytest.mark.slow
def test_checkpoint_resumes_exactly(tmp_path):
    result = run_workers(_resume_worker, 2, str(tmp_path), timeout=300)[0]
    assert result["step"] == 18 and result["diff"] == 0.0


@pytest.mark.slow
def test_each_rank_holds_only_its_stage_after_setup():
    """The split happens on the host before anything moves to the device: no rank ever places the full model,
    and from setup on each rank holds exactly its own stage's parameters (fit and test)."""
    results = run_workers(_placement_worker, 2, timeout=300)
    assert [r["moved"] for r in results] == [[["fc0", "fc1"]] * 2, [["fc2", "head"]] * 2]
    for r in results:
        points = {point for point, _ in r["seen"]}
        assert {"fit_start", "train_batch", "val_batch", "test_start"} <= points
        assert all(count == r["expected"] for _, count in r["seen"]), r
        assert r["expected"] < r["full"]


# ----------------------------------------------------------------------------------------------
# 4 processes: 2 stages x 2 data-parallel replicas
# ----------------------------------------------------------------------------------------------
def _pp_dp_worker(rank: int, world_size: int) -> dict:
    seed_everything(0)
    net = ToyNet()
    reference = copy.deepcopy(net)
    recorder = BatchRecorder()
    model = CountingRegression(net)
    data = _toy_data(batch_size=16)  # 8 samples per replica, 2 per micro-batch
    strategy = PipelineStrategy(dp_size=2, n_microbatches=4)
    trainer = _trainer(strategy, world_size, max_steps=3, callbacks=[recorder])
    trainer.fit(model, datamodule=data)
    # replicas of a stage must hold identical parameters
    local = {k: v.clone() for k, v in model.state_dict().items()}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, local)
    # the global batch of a step is the union of both replicas' batches
    batches = [None] * world_size
    dist.all_gather_object(batches, recorder.batches)
    global_batches = [[torch.cat([batches[0][s][i], batches[2][s][i]]) for i in (0, 1)] for s in range(3)]
    state = trainer.strategy.lightning_module_state_dict()
    step = _reference_steps(reference, global_batches)
    seen = float(trainer.callback_metrics["train/seen"])
    trainer.test(model, datamodule=data, verbose=False)
    return {
        "replicas_equal": all(torch.equal(everyone[rank][k], everyone[(rank + 2) % 4][k]) for k in local),
        "sampler": trainer.strategy.distributed_sampler_kwargs,
        "diff": _max_diff(state, step) if rank == 0 else None,
        "train_seen": seen,
        "test_seen": float(trainer.callback_metrics["test/seen"]),
        "test_diff": abs(float(trainer.callback_metrics["test/loss"]) - _test_loss(step, data)),
    }


@pytest.mark.slow
def test_pipeline_times_data_parallel_2x2():
    """Proof 4: 2 stages x 2 replicas on a (dp, pp) mesh: replicas stay identical, three steps equal the
    unsplit model's three steps on the global batches, and metrics count every sample exactly once."""
    results = run_workers(_pp_dp_worker, 4, timeout=300)
    assert results[0]["diff"] < 1e-5
    assert [r["sampler"] for r in results] == [{"num_replicas": 2, "rank": d} for d in (0, 0, 1, 1)]
    for r in results:
        assert r["replicas_equal"]
        assert r["train_seen"] == 3 * 16  # 3 steps of the global batch, not x2 for the two stages
        assert r["test_seen"] == 50
        assert r["test_diff"] < 1e-5
    assert math.isclose(results[0]["test_diff"], results[1]["test_diff"])


@pytest.mark.fast
def test_preflight_applies_the_global_batch_rule_only_to_datamodules_that_say_so():
    """A DataModule of your own keeps its own meaning of batch_size (often per device); the project's are global."""
    from lightning import LightningDataModule

    from src.engine.strategies.launchers import preflight

    class Theirs(LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"batch_size": 31})

    trainer = Trainer(accelerator="cpu", devices=3, strategy="ddp", logger=False)
    preflight(trainer, CountingRegression(ToyNet()), Theirs())
    with pytest.raises(ConfigError, match="use a multiple of 3"):
        preflight(trainer, CountingRegression(ToyNet()), _toy_data(batch_size=31))


# -- the protocol, from the command line: a LightningModule without it, refused before any process starts ----
LIGHTNING_DEMO = ["~model", "~data", "+data._target_=lightning.pytorch.demos.boring_classes.BoringDataModule",
                  "callbacks=none", "optimized_metric=null", "extras.print_config=false", "trainer.accelerator=cpu"]


@pytest.mark.parametrize("model", ["BoringModel", "DemoModel"])
def test_a_lightning_module_without_the_protocol_is_refused_in_one_line(tmp_path, model):
    """``src/train.py trainer=pipeline`` with Lightning's demo modules: exit 2, one line naming every missing member
    of the protocol (src/engine/strategies/protocols.py) and the fix; no traceback, no rank, no run directory."""
    proc = run_entry("train", *LIGHTNING_DEMO, f"+model._target_=lightning.pytorch.demos.boring_classes.{model}",
                     "trainer=pipeline", "trainer.devices=2", f"hydra.run.dir={tmp_path}/run", timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = error_line(proc)
    assert (f"trainer=pipeline needs net (an nn.Sequential of named blocks), criterion(output, target) -> loss, record_step(stage, out) -> loss; "
            f"{model} lacks net, criterion, record_step; fix: subclass src.engine.steps.step_module.StepModule") in line, line
    assert "Initializing distributed" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()
