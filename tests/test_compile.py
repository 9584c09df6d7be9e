"""``model.compile=true``: the net is compiled in place, so checkpoints keep the plain keys and resume and eval work.

On CPU the tests use the ``aot_eager`` backend: the checkpoint keys do not depend on the backend, and
inductor's C++ compile would take most of a minute per shape on a small machine. The GPU variant
(tests/test_gpu.py) runs the default backend, inductor.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from src.models.classification_module import ClassificationModule
from src.models.components.mlp import MLP

CPU_BACKEND = "model.compile_backend=aot_eager"


def compiled_fit_resume_eval(make_cfg, *overrides: str, fit_only: tuple[str, ...] = ()) -> dict:
    """Fit one epoch with compile on, resume from its last.ckpt for a second, then evaluate that checkpoint.

    ``overrides`` apply to all three runs, ``fit_only`` to the first fit (e.g. a test callback).
    """
    from src.eval import evaluate
    from src.train import train

    compiled = ["model.compile=true", *overrides]
    first, objects = train(make_cfg("train", [*compiled, *fit_only, "test=false"], subdir="fit"))
    last = Path(objects["trainer"].checkpoint_callback.dirpath) / "last.ckpt"
    keys = list(torch.load(last, map_location="cpu", weights_only=True)["state_dict"])

    resumed, resumed_objects = train(make_cfg(
        "train", [*compiled, f"ckpt_path={last}", "trainer.max_epochs=2", "test=false"], subdir="resume"))
    evaluated, _ = evaluate(make_cfg("eval", [*compiled, f"ckpt_path={last}"], subdir="eval"))
    return {"keys": keys, "first": first, "resumed": resumed, "resumed_trainer": resumed_objects["trainer"],
            "evaluated": evaluated, "model": objects["model"], "callbacks": objects["callbacks"]}


def assert_compiled_run_round_trips(run: dict) -> None:
    assert run["keys"] and not [k for k in run["keys"] if "_orig_mod" in k], run["keys"][:5]
    assert "net.fc0.1.weight" in run["keys"]  # the net's own keys, as without compile
    assert run["resumed_trainer"].current_epoch == 2  # resumed after epoch 0 and trained epoch 1
    assert torch.isfinite(run["resumed"]["train/loss"])
    for key in ("test/loss", "test/acc"):
        assert torch.isfinite(run["evaluated"][key]), key
    assert type(run["model"].net) is MLP  # compiled in place, not wrapped


@pytest.mark.slow
def test_compiled_run_resumes_and_evaluates(make_cfg):
    assert_compiled_run_round_trips(compiled_fit_resume_eval(make_cfg, CPU_BACKEND))


@pytest.mark.fast
def test_compile_keeps_state_dict_keys_and_is_idempotent():
    torch.manual_seed(0)
    module = ClassificationModule(net=MLP(hidden_sizes=[16], dropout=0.0), optimizer=partial(torch.optim.SGD, lr=0.1),
                                  compile=True, compile_backend="eager")
    plain_keys = list(module.state_dict())
    net = module.net
    module.setup("fit")
    module.setup("fit")  # a second fit
    module.setup("test")
    assert module.net is net and type(module.net) is MLP and list(module.state_dict()) == plain_keys
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        expected = nn.Sequential(*net.children())(x)  # the same layers, called without compile
        torch.testing.assert_close(module(x), expected)
