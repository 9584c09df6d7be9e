"""Lightning's per-step SIGTERM broadcast, spaced out: matched across real ranks, and validated."""

from __future__ import annotations

from pathlib import Path

import pytest

from src.distributed.sigterm_check import space_out_sigterm_checks
from src.utils.errors import ConfigError
from tests.helpers.config import compose_cfg
from tests.helpers.multiprocess import run_workers


def counted_ddp_fit(rank: int, world_size: int, out_dir: str, every_n: int) -> dict:
    """One DDP rank of ``train(cfg)`` (8 steps) that records on which steps the SIGTERM flag was broadcast."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from src.train import train

    steps: list[int] = []
    original = _TrainingEpochLoop._broadcast_sigterm_tensor

    def recording(self):
        steps.append(self.trainer.global_step)
        return original(self)

    _TrainingEpochLoop._broadcast_sigterm_tensor = recording
    cfg = compose_cfg("train", ["trainer=ddp", f"trainer.devices={world_size}", "trainer.accelerator=cpu",
                                "test=false", f"sigterm_check_every_n_steps={every_n}"], Path(out_dir))
    _, objects = train(cfg)
    params = {k: v.detach().clone() for k, v in objects["model"].net.state_dict().items()}
    return {"steps": steps, "params": params, "global_step": objects["trainer"].global_step}


@pytest.mark.slow
@pytest.mark.parametrize(("every_n", "expected"), [(3, [0, 3, 6]), (1, list(range(8)))])
def test_broadcasts_on_the_same_steps_on_every_rank(tmp_path, every_n, expected):
    ranks = run_workers(counted_ddp_fit, 2, str(tmp_path), every_n)
    assert [r["steps"] for r in ranks] == [expected, expected]  # matched collectives: no rank waits alone
    assert [r["global_step"] for r in ranks] == [8, 8]
    first, second = ranks[0]["params"], ranks[1]["params"]
    assert all((first[k] == second[k]).all() for k in first)  # replicas still identical


@pytest.mark.fast
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "10"])
def test_bad_interval_is_a_config_error(tmp_path, bad):
    from lightning import Trainer

    with pytest.raises(ConfigError, match="sigterm_check_every_n_steps"):
        space_out_sigterm_checks(Trainer(logger=False, enable_checkpointing=False), bad)


@pytest.mark.fast
def test_one_keeps_lightnings_loop_untouched():
    from lightning import Trainer

    trainer = Trainer(logger=False, enable_checkpointing=False)
    assert space_out_sigterm_checks(trainer, 1) is False
    assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)
    assert space_out_sigterm_checks(trainer, 10) is True
    assert "_broadcast_sigterm_tensor" in vars(trainer.fit_loop.epoch_loop)
