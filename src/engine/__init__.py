"""The template's machinery, and the one module the user's rooms import it through.

``src/data/``, ``src/models/`` and the entry points (``src/train.py``, ``eval.py``, ``predict.py``,
``export.py``) import only ``from src.engine import <name>``, for a name listed here; the test
``tests/test_engine_boundary.py`` fails on any other import of ``src.engine.*`` from them. Configs name
the machinery's classes by their full path (``_target_: src.engine.strategies.ddp.DDPStrategy``).

A name is imported on first use (PEP 562), so ``from src.engine import DataError`` does not import
Lightning. Rooms: ``strategies`` (Lightning ``Strategy`` subclasses and their launchers), ``checkpointing``
(``CheckpointIO``, resume, last/best checkpoints), ``runtime`` (stop signals, rendezvous, watchdog, exit),
``run`` (the run directory and its status), ``steps`` (the ``LightningModule`` base and its exact
metrics), ``data`` (the global-batch loader and the in-memory base ``DataModule``), ``callbacks``,
``loggers``, ``collectives``, ``search`` (Optuna), ``utils`` (config checks, Hydra errors, logging).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it; a module's own name maps to itself
_WHERE = {
    # what src/models/ builds on
    "STAGES": "src.engine.steps.step_module",
    "StepModule": "src.engine.steps.step_module",
    "StepOutput": "src.engine.steps.step_module",
    "SampleAccuracy": "src.engine.steps.metrics",
    "SampleMean": "src.engine.steps.metrics",
    # what src/data/ builds on
    "InMemoryDataModule": "src.engine.data.in_memory_datamodule",
    "ConfigError": "src.engine.utils.errors",
    "DataError": "src.engine.utils.errors",
    "RefusedGlobal": "src.engine.utils.safe_unpickle",
    "load_numpy_pickle": "src.engine.utils.safe_unpickle",
    "random_crop": "src.engine.data.batch_transforms",
    "random_hflip": "src.engine.data.batch_transforms",
    # strategies and the callback users pass to Trainer(...) themselves
    "DDPStrategy": "src.engine.strategies.ddp",
    "DataParallelStrategy": "src.engine.strategies.dp",
    "FSDPStrategy": "src.engine.strategies.fsdp",
    "ParameterServerStrategy": "src.engine.strategies.ps.strategy",
    "PipelineStrategy": "src.engine.strategies.pipeline.strategy",
    "SingleDeviceStrategy": "src.engine.strategies.single_device",
    "CollectivesCheck": "src.engine.collectives.callback",
    # what the entry points call, in the order a run calls it
    "prompt_exit": "src.engine.runtime.prompt_exit",
    "start_ranks_early": "src.engine.runtime.early_ranks",
    "hydra_main": "src.engine.utils.hydra_errors",
    "extras": "src.engine.utils.task",
    "task_wrapper": "src.engine.utils.task",
    "get_metric_value": "src.engine.utils.task",
    "RankedLogger": "src.engine.utils.pylogger",
    "lightning_lines_held": "src.engine.utils.pylogger",
    "check_config": "src.engine.utils.config_checks",
    "require_step": "src.engine.utils.config_checks",
    "preflight": "src.engine.strategies.launchers",
    "isolated_job": "src.engine.runtime.hydra_launch",
    "completed_task": "src.engine.run.status",
    "run_status": "src.engine.run.status",
    "task_overrides": "src.engine.run.status",
    "PREDICTIONS_FILE": "src.engine.run.status",
    "check_checkpoint": "src.engine.checkpointing.start",
    "checkpoint_model": "src.engine.checkpointing.start",
    "require_ckpt_path": "src.engine.checkpointing.start",
    "resume_checkpoint": "src.engine.checkpointing.start",
    "load_checkpoint_file": "src.engine.checkpointing.io",
    "best_checkpoint": "src.engine.checkpointing.last_checkpoint",
    "run_position": "src.engine.checkpointing.last_checkpoint",
    "with_resume_callbacks": "src.engine.checkpointing.required",
    "drop_callbacks_without_a_metric": "src.engine.callbacks.monitored_metric",
    "drop_callbacks_needing_a_logger": "src.engine.utils.instantiators",
    "instantiate_callbacks": "src.engine.utils.instantiators",
    "instantiate_loggers": "src.engine.utils.instantiators",
    "log_hyperparameters": "src.engine.utils.logging_utils",
    "print_config_tree": "src.engine.utils.rich_utils",
    "PredictionWriter": "src.engine.callbacks.prediction_writer",
    "PredictDataModule": "src.engine.data.predict_datamodule",
    "SplitPredictDataModule": "src.engine.data.predict_datamodule",
    "load_inputs": "src.engine.data.predict_inputs",
    "predict_on_inputs": "src.engine.data.predict_inputs",
    "split_inputs": "src.engine.data.predict_inputs",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'src.engine' has no attribute {name!r}; the names it exports: src/engine/__init__.py")
    module = importlib.import_module(_WHERE[name])
    return module if module.__name__.rsplit(".", 1)[-1] == name else getattr(module, name)


def __dir__() -> list[str]:
    return __all__
