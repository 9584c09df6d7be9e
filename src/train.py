"""Train a model, then test its best checkpoint.

    python src/train.py                                    # Fashion-MNIST MLP, one device
    python src/train.py trainer=ddp trainer.devices=4      # DDP, 4 processes (gloo on CPU, nccl on GPU)
    python src/train.py trainer=ddp_spawn trainer.devices=2
    python src/train.py trainer=dp trainer.devices=2       # one process, batch split across devices
    python src/train.py trainer=pipeline trainer.devices=2 # model split into 2 pipeline stages
    torchrun --nproc_per_node=2 src/train.py trainer=ddp trainer.devices=2
    python src/train.py -m trainer=ddp trainer.devices=2 model.optimizer.lr=0.01,0.1
"""

from __future__ import annotations

from typing import Any

import rootutils

# the project root on sys.path and in PROJECT_ROOT; .env is loaded by LoadDotenv (src/engine/utils/job_setup.py)
rootutils.setup_root(__file__, indicator=".project-root", pythonpath=True, dotenv=False)

from src.engine import prompt_exit, start_ranks_early

HYDRA = {"version_base": "1.3", "config_path": "../configs", "config_name": "train.yaml"}

if __name__ == "__main__":
    prompt_exit.install()  # before the imports below register their atexit handlers: it must run after them
    # trainer=ddp: the other ranks start now and import while this one does (in such a rank: it waits here)
    start_ranks_early(__file__, **HYDRA)

import hydra
import lightning as L
from omegaconf import DictConfig

from src.engine import (
    RankedLogger,
    best_checkpoint,
    check_checkpoint,
    check_config,
    completed_task,
    drop_callbacks_needing_a_logger,
    drop_callbacks_without_a_metric,
    extras,
    get_metric_value,
    hydra_main,
    instantiate_callbacks,
    instantiate_loggers,
    isolated_job,
    lightning_lines_held,
    log_hyperparameters,
    preflight,
    require_step,
    resume_checkpoint,
    run_position,
    run_status,
    task_overrides,
    task_wrapper,
    with_resume_callbacks,
)

log = RankedLogger(__name__)


@task_wrapper
def train(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fit (resuming from ``cfg.ckpt_path``, or this run's own ``last.ckpt``), then test the best checkpoint.

    Returns ``(metric_dict, object_dict)`` so tests and sweeps can look inside.
    """
    check_config(cfg)  # before anything is built
    done = completed_task(cfg)
    if done is not None:  # a requeue or relaunch of a run that finished: nothing is trained again
        log.info(f"This run already finished (status.yaml in {cfg.paths.output_dir}): nothing left to do")
        return done, {"cfg": cfg}
    ckpt_path = resume_checkpoint(cfg, cfg.paths.output_dir)
    with lightning_lines_held():  # a refusal below is one line on stderr, without Lightning's start-up lines
        if cfg.get("seed") is not None:
            L.seed_everything(cfg.seed, workers=True)  # same seed on every rank: replicas start identical
        log.info(f"Instantiating datamodule <{cfg.data._target_}>")
        datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.data)
        log.info(f"Instantiating model <{cfg.model._target_}>")
        model: L.LightningModule = hydra.utils.instantiate(cfg.model)
        if ckpt_path:
            check_checkpoint(ckpt_path, model, cfg)
        loggers = instantiate_loggers(cfg.get("logger"))
        callbacks = drop_callbacks_needing_a_logger(instantiate_callbacks(cfg.get("callbacks")), loggers)
        callbacks = drop_callbacks_without_a_metric(callbacks, cfg.get("optimized_metric"))
        if cfg.get("train"):  # resume and stop signals never depend on what `callbacks` holds
            callbacks = with_resume_callbacks(callbacks, cfg.paths.output_dir, cfg.last_ckpt_every_n_train_steps)
        log.info(f"Instantiating trainer <{cfg.trainer._target_}>")
        trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers)
        preflight(trainer, model, datamodule)  # before any rank starts and before the run is recorded as running
        if cfg.get("test"):  # after the strategy's own check of the model, which names more of what is missing
            require_step(model, "test_step", "train.py (test=true)", "test=false, or define test_step")
    objects = {"cfg": cfg, "datamodule": datamodule, "model": model, "callbacks": callbacks,
               "logger": loggers, "trainer": trainer}
    log_hyperparameters(objects)  # rank 0, once: config and parameter counts to every logger

    with run_status(trainer, cfg.paths.output_dir, task_overrides()) as status:
        if cfg.get("train"):
            if ckpt_path and not cfg.get("ckpt_path"):
                log.info(f"Resuming this run from {ckpt_path} (auto_resume=true)")
            fit(cfg, trainer, model, datamodule, ckpt_path)
        status.metrics = dict(trainer.callback_metrics)
        if cfg.get("test"):
            status.note(f"training finished at {run_position(trainer)}; testing")
            ckpt = best_checkpoint(trainer)
            if not ckpt:
                log.warning("No best checkpoint found: testing the weights at the end of training")
            trainer.test(model=model, datamodule=datamodule, ckpt_path=ckpt or None)
            status.metrics.update(trainer.callback_metrics)
            log.info(f"Best checkpoint: {ckpt or '-'}")
    return status.metrics, objects


def fit(cfg: DictConfig, trainer: L.Trainer, model: L.LightningModule, datamodule: L.LightningDataModule,
        ckpt_path: str | None) -> None:
    """``trainer.fit``; after a resume from the final checkpoint (nothing left to train), validate instead."""
    trainer.fit(model=model, datamodule=datamodule, ckpt_path=ckpt_path)
    metric = cfg.get("optimized_metric")
    if metric and metric not in trainer.callback_metrics and trainer.state.finished:
        # resumed from the final checkpoint of a run that had finished training: fit logged nothing, so
        # validate the final weights, which gives what the uninterrupted run's last validation gave
        log.info(f"Training had already finished at step {trainer.global_step}: validating the final weights")
        loggers, trainer.loggers = trainer.loggers, []  # the run logged this validation before its final checkpoint
        try:
            trainer.validate(model=model, datamodule=datamodule, verbose=False)
        finally:
            trainer.loggers = loggers


@hydra_main(**HYDRA)  # config errors: 1 line
def main(cfg: DictConfig) -> float | None:
    """Hydra entry: returns the optimized metric so sweepers can read it."""
    with isolated_job():
        extras(cfg)
        metric_dict, objects = train(cfg)
        trainer = objects.get("trainer")  # none when the run had already finished
        if trainer is not None and not trainer.is_global_zero:  # sweepers read rank 0's value; ps workers validate nothing
            return None
        return get_metric_value(metric_dict, cfg.get("optimized_metric"))


if __name__ == "__main__":
    with prompt_exit.exit_code_recorded():  # then end without the interpreter's teardown
        main()
