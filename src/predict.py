"""A checkpoint's predictions on new data, one CSV row per input.

    python src/predict.py ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt              # the test split
    python src/predict.py ckpt_path=... input=path/to/images/      # PNG/JPEG files, converted to the model's input
    python src/predict.py ckpt_path=... input=batch.npy trainer=ddp trainer.devices=2      # the same CSV

Writes ``<run dir>/predictions.csv`` (source, predicted class, label where known, each class's
probability) in input order, and says the accuracy where every input has a label. Checkpoints of every
strategy load (an fsdp folder of shards too), as in ``src/eval.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import rootutils

# the project root on sys.path and in PROJECT_ROOT; .env is loaded by LoadDotenv (src/engine/utils/job_setup.py)
rootutils.setup_root(__file__, indicator=".project-root", pythonpath=True, dotenv=False)

from src.engine import prompt_exit, start_ranks_early

HYDRA = {"version_base": "1.3", "config_path": "../configs", "config_name": "predict.yaml"}

if __name__ == "__main__":
    prompt_exit.install()  # before the imports below register their atexit handlers: it must run after them
    # trainer=ddp: the other ranks start now and import while this one does (in such a rank: it waits here)
    start_ranks_early(__file__, **HYDRA)

import hydra
import lightning as L
from omegaconf import DictConfig

from src.engine import (
    PREDICTIONS_FILE,
    DataError,
    InMemoryDataModule,
    PredictDataModule,
    PredictionWriter,
    RankedLogger,
    SplitPredictDataModule,
    check_config,
    checkpoint_model,
    extras,
    hydra_main,
    isolated_job,
    lightning_lines_held,
    load_inputs,
    predict_on_inputs,
    preflight,
    require_ckpt_path,
    split_inputs,
    task_wrapper,
)

log = RankedLogger(__name__)


@task_wrapper
def predict(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Predict with ``cfg.ckpt_path`` on ``cfg.input``; returns ``({"predict/acc": ...} where labelled, objects)``."""
    require_ckpt_path(cfg, "predict.py", "predict with")
    check_config(cfg)
    with lightning_lines_held():  # a refusal below is one line on stderr, without Lightning's start-up lines
        datamodule, model = checkpoint_model(cfg)
        # bad input: one line, before anything is written
        if isinstance(datamodule, InMemoryDataModule):
            inputs = load_inputs(str(cfg.input), datamodule, str(cfg.ckpt_path))
            source = PredictDataModule(datamodule, inputs.dataset)
        else:  # a data module of the user's: its own test or predict loader
            inputs = split_inputs(str(cfg.input), datamodule)
            source = SplitPredictDataModule(datamodule, str(cfg.input))
            predict_on_inputs(model)
        writer = PredictionWriter(Path(cfg.paths.output_dir) / PREDICTIONS_FILE, inputs.sources,
                                  classification=getattr(model, "task", None) == "classification")
        trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=[writer], logger=False)
        if len(inputs.sources) < trainer.world_size:  # a rank with no input would have nothing to predict
            raise DataError(f"input={cfg.input} holds {len(inputs.sources)} input(s) for {trainer.world_size} "
                            f"ranks, and each rank predicts at least one; fix: predict with at most "
                            f"{len(inputs.sources)} device(s), e.g. trainer.devices={len(inputs.sources)}")
        preflight(trainer, model, datamodule)
    objects = {"cfg": cfg, "datamodule": datamodule, "model": model, "trainer": trainer, "writer": writer}
    log.info(f"Predicting {len(inputs.sources)} inputs ({cfg.input}) with {cfg.ckpt_path}")
    trainer.predict(model, datamodule=source, ckpt_path=cfg.ckpt_path, return_predictions=False)
    return ({} if writer.accuracy is None else {"predict/acc": writer.accuracy}), objects


@hydra_main(**HYDRA)  # config errors: 1 line
def main(cfg: DictConfig) -> None:
    with isolated_job():
        require_ckpt_path(cfg, "predict.py", "predict with")
        extras(cfg)
        predict(cfg)


if __name__ == "__main__":
    with prompt_exit.exit_code_recorded():  # then end without the interpreter's teardown
        main()
