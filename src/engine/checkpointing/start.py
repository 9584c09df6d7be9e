"""Which checkpoint a run starts from, and whether it fits the model, before any training starts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.engine.run.status import (
    CHECKPOINT_DIR,
    LAST_CHECKPOINT,
    PREDICTIONS_FILE,
    continues_own_run,
    holds_checkpoints,
)
from src.engine.utils.errors import CheckpointError, ConfigError


def require_ckpt_path(cfg: DictConfig, script: str, purpose: str) -> None:
    """``script`` (eval.py, predict.py, export.py) works on a given checkpoint: say so, in one line, when
    ``ckpt_path`` is not set."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.get("ckpt_path"):
        raise ConfigError(f"{script} needs the checkpoint to {purpose} and ckpt_path is not set; fix: pass it, e.g. "
                          "ckpt_path=logs/train/runs/<run>/checkpoints/last.ckpt")


def checkpoint_model(cfg: DictConfig) -> tuple:
    """Seed, build ``cfg.data`` and ``cfg.model``, and check that ``cfg.ckpt_path`` fits the model: what
    eval.py and predict.py do before they build the Trainer. Returns ``(datamodule, model)``."""
    import hydra
    import lightning as L

    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    check_checkpoint(cfg.ckpt_path, model, cfg)
    return datamodule, model


def check_checkpoint(ckpt_path: str | os.PathLike, model: nn.Module, cfg: DictConfig) -> None:
    """Fail early, in one line, when ``ckpt_path`` is missing, unreadable, from another model (a file, or a
    sharded folder), or stores a config naming code this run's config does not.

    Lightning would only find out after launching processes and building the trainer,
    and a size mismatch surfaces there as a long ``load_state_dict`` traceback. ``trust_checkpoint=true``
    lets this process unpickle any object in the file, and skips the stored-config check.
    """
    from src.engine.checkpointing.io import trust, trusted

    path = Path(ckpt_path)
    if cfg.get("trust_checkpoint"):
        trust(path)
    saved, settings = saved_weight_shapes(path)
    if not trusted(path):
        refuse_foreign_targets(path, settings, cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = [k for k in expected.keys() & saved.keys() if tuple(expected[k].shape) != saved[k]]
    if missing or unexpected or mismatched:
        detail = "; ".join(
            f"{label}: {keys[:3]}{' ...' if len(keys) > 3 else ''}"
            for label, keys in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("shape mismatch", sorted(mismatched)),
            )
            if keys
        )
        raise CheckpointError(
            f"checkpoint {path} does not fit this model ({detail}); fix: use the same model/data config it was trained with"
        )


def saved_weight_shapes(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, Any]]:
    """``{key: shape}`` of a checkpoint's weights (a file's ``state_dict``, or a sharded folder's index alone),
    and its hyper-parameter entries."""
    # imported here: they load Lightning, and Hydra's callbacks import this module before the job starts
    from src.engine.checkpointing.io import load_checkpoint_file
    from src.engine.checkpointing.plain import HYPER_PARAMETER_KEYS
    from src.engine.checkpointing.sharded import is_sharded_checkpoint, read_meta, saved_shapes

    if is_sharded_checkpoint(path):
        meta = read_meta(path)  # the folder's other half: a clear error now if it is missing
        return saved_shapes(path), {k: meta[k] for k in HYPER_PARAMETER_KEYS if k in meta}
    state = load_checkpoint_file(path)
    if not isinstance(state, dict) or "state_dict" not in state:
        raise CheckpointError(
            f"{path} is not a Lightning checkpoint (no 'state_dict' entry); fix: pass a .ckpt file saved by "
            "Lightning (checkpoints/last.ckpt or epoch_*.ckpt of a run)"
        )
    shapes = {k: tuple(v.shape) for k, v in state["state_dict"].items()}
    return shapes, {k: state[k] for k in HYPER_PARAMETER_KEYS if k in state}


def refuse_foreign_targets(path: Path, settings: dict[str, Any], cfg: DictConfig) -> None:
    """Refuse a checkpoint whose stored hyper-parameters name a ``_target_`` that this run's own config does not.

    No entry point builds anything from a checkpoint's stored config, but a module that instantiates its own
    hyper-parameters would: a stored ``_target_: os.system`` must not reach it. A checkpoint of this run's
    model names only what its config names.
    """
    from src.engine.checkpointing.plain import stored_targets

    ours = set(_config_targets(OmegaConf.to_container(cfg, resolve=False)))
    for where, target in stored_targets(settings):
        if target not in ours:
            raise CheckpointError(
                f"{path} stores a config that names _target_={target!r} (at {where}), which this run's config "
                "does not name, so it was not loaded; fix: pass the model and data config it was trained with, "
                "or trust_checkpoint=true if you trust the file"
            )


def _config_targets(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["_target_"]] if isinstance(node.get("_target_"), str) else []
        return found + [t for k, v in node.items() if k != "hydra" for t in _config_targets(v)]
    if isinstance(node, list):
        return [t for v in node for t in _config_targets(v)]
    return []


def saved_data_settings(path: str | os.PathLike) -> dict[str, Any] | None:
    """The data module's hyper-parameters saved in a checkpoint (a file, or a sharded folder's meta), or None
    when it holds none (a Trainer given no data module)."""
    from src.engine.checkpointing.io import load_checkpoint_file
    from src.engine.checkpointing.sharded import is_sharded_checkpoint, read_meta

    state = read_meta(path) if is_sharded_checkpoint(Path(path)) else load_checkpoint_file(path)
    saved = state.get("datamodule_hyper_parameters") if isinstance(state, dict) else None
    return dict(saved) if saved else None


def resume_checkpoint(cfg: DictConfig, run_dir: str | Path) -> str | None:
    """The checkpoint ``fit`` starts from: ``ckpt_path``, else (``auto_resume``) the run dir's ``last.ckpt``."""

    if cfg.get("ckpt_path"):
        return str(cfg.ckpt_path)
    last = Path(run_dir) / LAST_CHECKPOINT
    if continues_own_run(cfg) and last.exists():  # a file, or trainer=fsdp's folder
        return str(last)
    return None


def check_no_earlier_checkpoints(cfg: DictConfig, run_dir: str | Path) -> None:
    """Refuse to train into a run directory that holds checkpoints this run would not resume from, and a
    run that does not train (eval, predict) into one that holds another run's checkpoints or predictions.

    ModelCheckpoint would otherwise overwrite ``epoch_*.ckpt`` and ``last.ckpt`` of the earlier run, and
    Hydra that run's ``.hydra/`` record. Called by a Hydra callback before Hydra writes ``.hydra/``, so a
    refused run changes nothing.
    """
    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    if not cfg.get("train"):
        earlier = [name for name, found in ((CHECKPOINT_DIR, holds_checkpoints(run_dir)),
                                            (PREDICTIONS_FILE, (Path(run_dir) / PREDICTIONS_FILE).exists())) if found]
        if earlier:
            raise ConfigError(f"{run_dir} holds an earlier run's {' and '.join(earlier)}, which this run would "
                              "overwrite (with its .hydra/ record); fix: pick a new hydra.run.dir")
        return
    if resume_checkpoint(cfg, run_dir) is not None:
        return
    if holds_checkpoints(run_dir):
        raise ConfigError(f"{ckpt_dir} already holds checkpoints of an earlier run; fix: pick a new "
                          f"hydra.run.dir, or resume with ckpt_path={ckpt_dir / 'last.ckpt'} (or auto_resume=true)")
