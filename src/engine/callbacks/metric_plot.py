"""Plot loss and accuracy curves to a PNG in the run directory after fit (rank 0), from the run's CSV log."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only

from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)

History = dict[str, dict[int, float]]  # metric -> epoch -> value


class MetricPlot(Callback):
    """Draws epoch-level metrics (e.g. ``train/loss``, ``val/loss``, ``val/acc``), one panel per kind.

    The values come from the CSV log (``metrics.csv``), which a resumed run continues, so the plot shows
    the whole run, not only the part since the last resume. Without a CSV logger the values the run saw are
    drawn: they are kept in its checkpoints (this callback's state), so a resumed run draws the epochs before
    the resume too. matplotlib is imported only when the plot is drawn, so it costs nothing at start-up.
    """

    def __init__(self, filename: str = "metrics.png", kinds: tuple[str, ...] = ("loss", "acc")) -> None:
        self.filename = filename
        self.kinds = tuple(kinds)
        self.seen: History = defaultdict(dict)  # only for runs without a CSV logger

    def _wanted(self, key: str) -> bool:
        stage, _, kind = key.partition("/")
        return stage in ("train", "val") and kind in self.kinds

    def _record(self, trainer: Trainer) -> None:
        if trainer.sanity_checking:
            return
        for key, value in trainer.callback_metrics.items():
            if self._wanted(key) and value.numel() == 1:
                self.seen[key][trainer.current_epoch] = float(value)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record(trainer)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record(trainer)

    def state_dict(self) -> dict:
        return {"seen": {key: dict(values) for key, values in self.seen.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        for key, values in state_dict.get("seen", {}).items():
            self.seen[key].update(values)

    def logged(self, trainer: Trainer) -> History | None:
        """The epoch-level metrics in the CSV log, or None when the trainer has no CSV logger."""
        logger = next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
        if logger is None:
            return None
        logger.save()  # rows still in memory go to the file first
        path = Path(logger.log_dir) / "metrics.csv"
        history: History = defaultdict(dict)
        if path.is_file():
            with open(path, newline="") as f:
                for row in csv.DictReader(f):
                    for key, value in row.items():
                        if value and row.get("epoch") and self._wanted(key):
                            history[key][int(float(row["epoch"]))] = float(value)
        return history

    @rank_zero_only
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        history = self.logged(trainer)
        history = self.seen if history is None else history
        if not history:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        kinds = [k for k in self.kinds if any(key.endswith("/" + k) for key in history)]
        fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.6), squeeze=False)
        for ax, kind in zip(axes[0], kinds, strict=True):
            for key in sorted(k for k in history if k.endswith("/" + kind)):
                epochs = sorted(history[key])
                ax.plot(epochs, [history[key][e] for e in epochs], marker="o", label=key)
            ax.set_xlabel("epoch")
            ax.set_title(kind)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = Path(trainer.default_root_dir) / self.filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        log.info(f"Saved metric curves to {path}")
