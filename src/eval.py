"""Evaluate a checkpoint on the test split.

    python src/eval.py ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt
    python src/eval.py ckpt_path=... trainer=ddp trainer.devices=2   # same metrics, exactly

Checkpoints from every strategy (single device, dp, ddp, pipeline) hold the full,
unsplit model, so they all load here.
"""

from __future__ import annotations

from typing import Any

import rootutils

# the project root on sys.path and in PROJECT_ROOT; .env is loaded by LoadDotenv (src/engine/utils/job_setup.py)
rootutils.setup_root(__file__, indicator=".project-root", pythonpath=True, dotenv=False)

from src.engine import prompt_exit, start_ranks_early

HYDRA = {"version_base": "1.3", "config_path": "../configs", "config_name": "eval.yaml"}

if __name__ == "__main__":
    prompt_exit.install()  # before the imports below register their atexit handlers: it must run after them
    # trainer=ddp: the other ranks start now and import while this one does (in such a rank: it waits here)
    start_ranks_early(__file__, **HYDRA)

import hydra
import lightning as L
from omegaconf import DictConfig

from src.engine import (
    RankedLogger,
    check_config,
    checkpoint_model,
    extras,
    hydra_main,
    instantiate_callbacks,
    instantiate_loggers,
    isolated_job,
    lightning_lines_held,
    log_hyperparameters,
    preflight,
    require_ckpt_path,
    require_step,
    task_wrapper,
)

log = RankedLogger(__name__)


@task_wrapper
def evaluate(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Test ``cfg.ckpt_path``; returns ``(metric_dict, object_dict)``."""
    require_ckpt_path(cfg, "eval.py", "test")
    check_config(cfg)
    with lightning_lines_held():  # a refusal below is one line on stderr, without Lightning's start-up lines
        datamodule, model = checkpoint_model(cfg)
        require_step(model, "test_step", "eval.py", "define test_step (it logs the test metrics), or predict with "
                     "src/predict.py")
        trainer: L.Trainer = hydra.utils.instantiate(
            cfg.trainer,
            callbacks=instantiate_callbacks(cfg.get("callbacks")),
            logger=instantiate_loggers(cfg.get("logger")),
        )
        preflight(trainer, model, datamodule)
    objects = {"cfg": cfg, "datamodule": datamodule, "model": model, "trainer": trainer}
    log_hyperparameters(objects)  # rank 0, once: config and parameter counts to every logger
    log.info(f"Testing checkpoint {cfg.ckpt_path}")
    trainer.test(model=model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    return dict(trainer.callback_metrics), objects


@hydra_main(**HYDRA)  # config errors: 1 line
def main(cfg: DictConfig) -> None:
    with isolated_job():
        require_ckpt_path(cfg, "eval.py", "test")  # before extras prints the config, which holds it
        extras(cfg)
        evaluate(cfg)


if __name__ == "__main__":
    with prompt_exit.exit_code_recorded():  # then end without the interpreter's teardown
        main()
