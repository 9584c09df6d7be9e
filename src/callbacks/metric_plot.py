"""Plot loss and accuracy curves to a PNG in the run directory after fit (rank 0)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only

from src.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


class MetricPlot(Callback):
    """Collects epoch-level metrics (e.g. ``train/loss``, ``val/loss``, ``val/acc``) and draws one panel per kind.

    matplotlib is imported only when the plot is drawn, so it costs nothing at start-up.
    """

    def __init__(self, filename: str = "metrics.png", kinds: tuple[str, ...] = ("loss", "acc")) -> None:
        self.filename = filename
        self.kinds = tuple(kinds)
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def _record(self, trainer: Trainer) -> None:
        if trainer.sanity_checking:
            return
        for key, value in trainer.callback_metrics.items():
            stage, _, kind = key.partition("/")
            if stage in ("train", "val") and kind in self.kinds and value.numel() == 1:
                points = self.history[key]
                if points and points[-1][0] == trainer.current_epoch:
                    points[-1] = (trainer.current_epoch, float(value))
                else:
                    points.append((trainer.current_epoch, float(value)))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record(trainer)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record(trainer)

    @rank_zero_only
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.history:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        kinds = [k for k in self.kinds if any(key.endswith("/" + k) for key in self.history)]
        fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.6), squeeze=False)
        for ax, kind in zip(axes[0], kinds, strict=True):
            for key in sorted(k for k in self.history if k.endswith("/" + kind)):
                epochs, values = zip(*self.history[key], strict=True)
                ax.plot(epochs, values, marker="o", label=key)
            ax.set_xlabel("epoch")
            ax.set_title(kind)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = Path(trainer.default_root_dir) / self.filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        log.info(f"Saved metric curves to {path}")
