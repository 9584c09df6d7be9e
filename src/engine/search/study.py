"""The Optuna study of a search: opened from the sweeper's config by the sweeper and by each trial's rank 0.

The sweeper (``src/engine/search/sweeper.py``) asks the study for trials and tells it their results; a trial's
global rank 0 (``src/engine/callbacks/optuna_pruning.py``) reports its validation metric to its own trial after
every epoch. Both build the storage, sampler and pruner from the same ``hydra.sweeper`` node, so the
storage must be one that several processes can open: a journal file (Optuna's multi-process-safe
``JournalStorage``) or a database.

The search space is written as in hydra-optuna-sweeper, in Hydra's override grammar:
``interval(a, b)`` (``tag(log, interval(a, b))``), ``range(a, b, step)`` and ``choice(...)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.utils import instantiate
from omegaconf import DictConfig

from src.engine.utils.errors import ConfigError

Distributions = dict[str, optuna.distributions.BaseDistribution]


def open_study(sweeper: DictConfig, sampler_seed_offset: int | None = None) -> optuna.Study:
    """The study named in ``sweeper`` (created when new). ``sampler_seed_offset``: build the sampler too,
    its seed moved by that much (processes asking the same study must not draw the same random points)."""
    storage = instantiate(sweeper.storage)
    pruner = instantiate(sweeper.pruner)
    study = optuna.create_study(storage=storage, study_name=sweeper.study_name, direction=sweeper.direction,
                                pruner=pruner, load_if_exists=True)
    if sampler_seed_offset is None:
        return study
    seed = sweeper.sampler.get("seed")
    moved = {} if seed is None else {"seed": seed + sampler_seed_offset}
    return optuna.load_study(study_name=sweeper.study_name, storage=storage, pruner=pruner,
                             sampler=instantiate(sweeper.sampler, **moved))


def trial_by_number(sweeper: DictConfig, study: optuna.Study, number: int) -> optuna.trial.Trial:
    """A handle on trial ``number`` of ``study`` (its attributes can be set while it runs).

    Optuna hands out ``Trial`` objects only from ``ask``/``optimize``, in the process that asked; this one is
    built from the storage's public lookups, for a trial asked elsewhere (another search, or this job's sweeper).
    """
    storage = instantiate(sweeper.storage)
    study_id = storage.get_study_id_from_name(sweeper.study_name)
    return optuna.trial.Trial(study, storage.get_trial_id_from_study_id_trial_number(study_id, number))


def study_file(sweeper: DictConfig) -> Path | None:
    """The file that holds the study (the journal, or an SQLite database), or None for a database server."""
    storage = sweeper.storage
    path = storage.get("log_storage", {}).get("file_path")
    url = str(storage.get("url") or "")
    if path is None and url.startswith("sqlite:///"):
        path = url.removeprefix("sqlite:///")
    return Path(path) if path else None


def trial_of_this_job() -> optuna.trial.Trial | None:
    """The trial this Hydra job reports to, when it is a job of an Optuna search (job ``n`` runs trial ``n``); the
    job may run in another process than its sweeper (a worker, a submitit job). With ``cv_folds=K``, job ``n``
    runs fold ``n % K`` of trial ``n // K``, and only fold 0 reports: the folds' epochs would clash."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN or hc.sweeper.get("storage") is None:  # a plain run, a grid sweep
        return None
    folds = hc.sweeper.get("cv_folds") or 1
    if hc.job.num % folds:
        return None
    study = optuna.load_study(study_name=hc.sweeper.study_name, storage=instantiate(hc.sweeper.storage),
                              pruner=instantiate(hc.sweeper.pruner))
    return trial_by_number(hc.sweeper, study, hc.job.num // folds)


def search_space(params: Mapping[str, str] | None, arguments: Sequence[str]) -> tuple[list[str], Distributions]:
    """``(fixed overrides, distributions)`` from the config's ``params`` and the command line's overrides.

    Sweep overrides (``interval``, ``range``, ``choice``) become Optuna distributions; the command line wins
    over ``params`` for the same key. Other overrides are passed unchanged to every trial.
    """
    lines = [f"{key}={value}" for key, value in (params or {}).items()] + list(arguments)
    fixed: list[str] = []
    space: Distributions = {}
    for override in OverridesParser.create().parse_overrides(lines):
        name = override.get_key_element()
        if override.is_sweep_override():
            space[name] = _distribution(override)
        else:
            fixed.append(override.input_line)
    return fixed, space


def _distribution(override: Override) -> optuna.distributions.BaseDistribution:
    sweep, name = override.value(), override.get_key_element()
    if isinstance(sweep, ChoiceSweep):
        bad = [v for v in sweep.list if not isinstance(v, None | bool | int | float | str)]
        if bad:
            raise ConfigError(f"{name}: choice({bad[0]!r}, ...) holds a list or dict, which Optuna cannot choose "
                              f"from; fix: quote each option, e.g. choice('[256,128]', '[512,256]')")
        return optuna.distributions.CategoricalDistribution(sweep.list)
    if isinstance(sweep, IntervalSweep):
        log = "log" in sweep.tags
        if isinstance(sweep.start, int) and isinstance(sweep.end, int):
            return optuna.distributions.IntDistribution(sweep.start, sweep.end, log=log)
        return optuna.distributions.FloatDistribution(sweep.start, sweep.end, log=log)
    if isinstance(sweep, RangeSweep):  # range(start, stop, step): stop excluded, as in Python
        values = list(override.sweep_iterator())
        if all(isinstance(v, int) for v in values):
            return optuna.distributions.IntDistribution(values[0], values[-1], step=int(sweep.step))
        return optuna.distributions.CategoricalDistribution(values)
    raise ConfigError(f"{override.input_line}: an Optuna search takes interval(...), range(...) or choice(...); "
                      "fix: write the parameter with one of them")


def trial_overrides(fixed: Sequence[str], params: Mapping[str, Any], seed: int | None) -> list[str]:
    """A trial's overrides: the fixed ones, its sampled parameters, and its own seed when given."""
    kept = [o for o in fixed if seed is None or o.split("=", 1)[0].lstrip("+~") != "seed"]
    return [*kept, *(f"{name}={value}" for name, value in params.items()),
            *([] if seed is None else [f"seed={seed}"])]
