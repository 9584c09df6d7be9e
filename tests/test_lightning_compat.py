"""Every private Lightning/torch name lives in one module and fails loudly when a release removes it."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest

from src.utils import lightning_compat as compat

ROOT = Path(__file__).resolve().parents[1]
# Private names the issue lists, which only the compat module may reach.
PRIVATE = ["_hydra_subprocess_cmd", "_broadcast_sigterm_tensor", "_sigterm_notifier_fn", "_signal_connector",
           "_current_fx_name", "PYTORCH_NVML_BASED_CUDA_CHECK", "_configure_launcher", "_apply_batch_transfer_handler",
           "optimizer._optimizer", "_layer_sync", "_optimizers_to_device", "_optimizer_to_device", "_StrategyRegistry",
           "_replicate_for_data_parallel", "_PipelineSchedule", "_lightning_module", "_start_method"]


@pytest.mark.fast
def test_private_names_are_used_in_the_compat_module_only():
    users = {name: sorted(str(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*.py")
                          if name in p.read_text() and p.name != "lightning_compat.py") for name in PRIVATE}
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


@pytest.mark.fast
def test_every_private_name_the_compat_module_reaches_has_a_guard():
    """A name used in the compat module without a guard would fail with a traceback (or silently) on a release
    that drops it: every one must be in PRIVATE_NAMES, so it fails at import in one line instead."""
    source = (ROOT / "src/utils/lightning_compat.py").read_text()
    own = {"_HYDRA_CHILD_COMMAND", "_CHECKPOINT_IO", "_PER_BATCH_CHECK", "_SIGTERM_HANDLER"}  # this module's constants
    guarded = {name for _, name, _ in compat.PRIVATE_NAMES}
    assert _private_names_reached_in(source) - own - guarded == set()


@pytest.mark.fast
@pytest.mark.parametrize("index", range(len(compat.PRIVATE_NAMES)))
def test_each_guard_fails_loudly_when_its_name_is_gone(index):
    where, name, feature = compat.PRIVATE_NAMES[index]
    owner = where()
    # the same object without `name`: a stand-in carrying every other attribute of the real one
    stripped = types.SimpleNamespace(**{k: True for k in dir(owner) if k != name})
    stripped.__name__ = getattr(owner, "__name__", type(owner).__name__)
    names = list(compat.PRIVATE_NAMES)
    names[index] = (lambda: stripped, name, feature)
    with pytest.raises(compat.LightningVersionError) as err:
        compat.check_private_names(tuple(names))
    line = str(err.value)
    assert "\n" not in line and re.search(r"lightning \S+ / torch \S+", line)
    assert name in line and feature in line and "pin those versions" in line


@pytest.mark.fast
def test_guard_sees_a_renamed_attribute_of_the_real_class(monkeypatch):
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    monkeypatch.delattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor")
    with pytest.raises(compat.LightningVersionError, match="agreed SIGTERM stop"):
        compat.check_private_names()


@pytest.mark.fast
def test_guards_still_read_an_init_that_torch_compile_wrapped(monkeypatch):
    """torch.compile wraps nn.Module.__init__ in a closure (dynamo's generation tagging): the guards read through it."""
    from torch import nn

    original = nn.Module.__init__

    def patched_init(self, *args, **kwargs):  # what torch._dynamo installs, without functools.wraps
        original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "__init__", patched_init)
    compat.check_private_names()


@pytest.mark.fast
def test_hydra_child_command_is_swapped_only_inside_the_block():
    from lightning.pytorch.strategies.launchers import subprocess_script

    original = subprocess_script._hydra_subprocess_cmd

    def mine(local_rank):
        return [str(local_rank)], "."

    with compat.hydra_child_command(mine):
        assert subprocess_script._hydra_subprocess_cmd is mine
    assert subprocess_script._hydra_subprocess_cmd is original


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
