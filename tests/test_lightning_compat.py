"""Every private Lightning/torch name lives in one module, checked where its feature runs: one line when gone."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest

from src.engine.utils import lightning_compat as compat

ROOT = Path(__file__).resolve().parents[1]
# Private names the issue lists, which only the compat module may reach.
PRIVATE = ["_hydra_subprocess_cmd", "_broadcast_sigterm_tensor", "_sigterm_notifier_fn", "_signal_connector",
           "_current_fx_name", "PYTORCH_NVML_BASED_CUDA_CHECK", "_configure_launcher", "_apply_batch_transfer_handler",
           "optimizer._optimizer", "_layer_sync", "_optimizers_to_device", "_optimizer_to_device", "_StrategyRegistry",
           "_replicate_for_data_parallel", "_PipelineSchedule", "_lightning_module", "_start_method"]


@pytest.mark.fast
def test_private_names_are_used_in_the_compat_module_only():
    # the name itself, not a part of a longer one (multiprocessing's public get_start_method holds _start_method)
    users = {name: sorted(str(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*.py")
                          if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", p.read_text())
                          and p.name != "lightning_compat.py") for name in PRIVATE}
    assert {name: files for name, files in users.items() if files} == {}


def _private_names_reached_in(source: str) -> set[str]:
    """Private names a module's code reaches: ``x._name`` attributes, ``"_name"`` strings (getattr/setattr),
    and ``from m import _Name``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and re.fullmatch(r"_[A-Za-z]\w*", node.attr) and not node.attr.endswith("__"):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"_[A-Za-z]\w*",
                                                                                               node.value):
            names.add(node.value)
        elif isinstance(node, ast.ImportFrom):
            names |= {alias.name for alias in node.names if alias.name.startswith("_")}
    return names


def _required_in(source: str) -> set[str]:
    """The names the module checks with ``require(owner, name, feature)``: literal, or a module constant."""
    tree = ast.parse(source)
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("require", "_launcher_class"):
            arg = node.args[1]
            names.add(arg.value if isinstance(arg, ast.Constant) else constants.get(getattr(arg, "id", ""), ""))
        elif isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):  # for name in ("_a", "_b"): require
            names |= {e.value for e in ast.walk(node.iter) if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return names


# reached without a check: the hook and slot Lightning builds a strategy's launcher in (the sanctioned place), the
# name the hook-name mixin compares against (a miss there only makes hook-name writes slower), the sync_batchnorm
# slot that the Trainer fills only where a strategy has it (read with a default); this module's own names
UNCHECKED = {"_configure_launcher", "_launcher", "_current_fx_name", "_layer_sync", "_PER_BATCH_CHECK",
             "_SIGTERM_HANDLER", "_NVML_CHECK", "_NVML_LIBRARY", "_AUTOMATIC_STEPS", "_MANUAL_STEPS", "_code_names",
             "_launcher_class"}


@pytest.mark.fast
def test_every_private_name_the_compat_module_reaches_is_checked_where_it_is_used():
    """A name used in the compat module without a check would fail with a traceback (or silently) on a release
    that drops it: the accessor that uses it checks it first, so its feature fails in one line instead."""
    source = (ROOT / "src/engine/utils/lightning_compat.py").read_text()
    assert _private_names_reached_in(source) - UNCHECKED - _required_in(source) == set()


@pytest.mark.fast
def test_importing_the_compat_module_checks_nothing_but_its_base_classes():
    source = (ROOT / "src/engine/utils/lightning_compat.py").read_text()
    top_level_calls = [n for stmt in ast.parse(source).body if not isinstance(stmt, ast.FunctionDef | ast.ClassDef)
                       for n in ast.walk(stmt) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "require"]
    assert top_level_calls == []


def _one_line(err: pytest.ExceptionInfo, name: str, feature: str) -> None:
    line = str(err.value)
    assert "\n" not in line and re.search(r"lightning \S+ / torch \S+", line)
    assert name in line and feature in line and "pin those versions" in line


def _trainer_without(owner: str, name: str) -> types.SimpleNamespace:
    """A stand-in trainer whose ``owner`` part ("trainer", "fit_loop", "epoch_loop") lacks ``name``."""
    epoch_loop = types.SimpleNamespace(_broadcast_sigterm_tensor=None, _should_check_val_fx=None,
                                       _batches_that_stepped=0)
    fit_loop = types.SimpleNamespace(epoch_loop=epoch_loop, _data_fetcher=None)
    trainer = types.SimpleNamespace(fit_loop=fit_loop, _logger_connector=None, _signal_connector=None)
    delattr({"trainer": trainer, "fit_loop": fit_loop, "epoch_loop": epoch_loop}[owner], name)
    return trainer


CHECKS = [  # (accessor, argument, the name it lacks, the feature named)
    (compat.replace_sigterm_check, lambda: _trainer_without("epoch_loop", "_broadcast_sigterm_tensor"),
     "_broadcast_sigterm_tensor", "the agreed SIGTERM stop"),
    (compat.mark_sigterm_received, lambda: _trainer_without("trainer", "_signal_connector"), "_signal_connector",
     "the SIGTERM stop"),
    (compat.validation_follows, lambda: _trainer_without("fit_loop", "_data_fetcher"), "_data_fetcher",
     "no periodic last.ckpt"),
    (compat.log_training_epoch_now, lambda: _trainer_without("trainer", "_logger_connector"), "_logger_connector",
     "an epoch's training row"),
    (compat.layer_sync_of, None, None, None),  # reads the slot the Trainer fills only where it exists: no check
    (compat.state_reductions, lambda: types.SimpleNamespace(), "_reductions", "a running metric resumed"),
    (compat.forget_mesh_groups, lambda: types.SimpleNamespace(), "_pg_registry", "fsdp's sub-groups"),
    (compat.replica_sharing_parameters, lambda: types.SimpleNamespace(), "_replicate_for_data_parallel",
     "dp replicas on CPU"),
]


@pytest.mark.fast
@pytest.mark.parametrize("index", range(len(CHECKS)))
def test_each_accessor_fails_in_one_line_when_its_name_is_gone(index):
    accessor, make, name, feature = CHECKS[index]
    if make is None:
        assert accessor(types.SimpleNamespace()) is None
        return
    with pytest.raises(compat.LightningVersionError) as err:
        if accessor is compat.replace_sigterm_check:
            accessor(make(), lambda: None, lambda signum, frame: None)
        else:
            accessor(make())
    _one_line(err, name, feature)


@pytest.mark.fast
def test_a_renamed_attribute_of_the_real_loop_fails_the_sigterm_feature_only(monkeypatch):
    from lightning import Trainer
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    monkeypatch.setattr(_TrainingEpochLoop, "advance", lambda self, data_fetcher: None)  # no longer calls it
    with pytest.raises(compat.LightningVersionError, match="agreed SIGTERM stop"):
        compat.replace_sigterm_check(trainer, lambda: None, lambda signum, frame: None)
    monkeypatch.undo()
    compat.replace_sigterm_check(trainer, print, print)  # the real one: installed
    assert compat.per_batch_check_of(trainer) is print


@pytest.mark.fast
def test_called_in_reads_through_a_closure_that_wraps_a_function():
    """torch.compile wraps functions in closures without functools.wraps: CalledIn reads the wrapped code."""

    def inner():
        return object()._hidden_name

    def wrapper(*args, **kwargs):  # what torch._dynamo installs, without functools.wraps
        return inner(*args, **kwargs)

    assert hasattr(compat.CalledIn(wrapper), "_hidden_name")
    assert not hasattr(compat.CalledIn(wrapper), "_another_name")


@pytest.mark.fast
def test_public_replacements_match_lightning(monkeypatch):
    """The accessors that now use public API give what Lightning's private helpers gave."""
    import torch
    from lightning.fabric.utilities import optimizer as fabric_optimizer
    from lightning.fabric.utilities.distributed import _suggested_max_num_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    try:
        compat.set_num_threads_if_needed(2)
        assert compat.os.environ["OMP_NUM_THREADS"] == str(_suggested_max_num_threads(2))
    finally:
        torch.set_num_threads(threads)
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([param])
    param.grad = torch.ones(2)
    optimizer.step()
    compat.optimizers_to_device([optimizer], torch.device("meta"))
    state = optimizer.state[param]
    assert state["exp_avg"].device.type == "meta" and state["step"].device.type == "cpu"
    assert fabric_optimizer is not None


@pytest.mark.fast
def test_fast_hook_name_writes_bypass_module_setattr():
    from src.models.components.toy_net import ToyNet
    from src.models.regression_module import RegressionModule

    module = RegressionModule(ToyNet(), optimizer=None)
    module._current_fx_name = "training_step"
    assert module.__dict__["_current_fx_name"] == "training_step"


def _no_library(name: str) -> None:
    raise OSError(f"{name}: cannot open shared object file")


@pytest.mark.fast
def test_the_nvml_switch_is_dropped_only_where_nvml_cannot_load(monkeypatch):
    import torch

    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    assert not compat.skip_nvml_check_without_nvml(load=lambda name: object())  # NVML loads: the switch stays
    assert compat.os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    answer = torch.cuda.is_available()
    assert compat.skip_nvml_check_without_nvml(load=_no_library)
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in compat.os.environ
    assert torch.cuda.is_available() == answer  # the CUDA runtime gives the answer either way
    assert not compat.skip_nvml_check_without_nvml(load=_no_library)  # not set: nothing to drop
