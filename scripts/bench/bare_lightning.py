"""The plain loop's work inside a minimal LightningModule: the cost of Lightning's own training loop.

    python -m scripts.bench.bare_lightning --epochs 3
    python -m scripts.bench.bare_lightning --accelerator gpu --precision bf16-mixed

Same data, split, model, optimizer, batches, tensor-side metric sums and per-epoch ``torch.save``
checkpoint as ``plain_loop``, run by ``Trainer(barebones=True)``: no logger, progress bar, checkpoint
callback, callbacks or ``self.log``. What
it loses against the plain loop is Lightning's per-step machinery (hook dispatch, the optimizer
closure, batch transfer, progress counters), which no template built on Lightning can remove; what
the project loses against it is what the template adds.

``--accelerator``/``--precision`` go to the Trainer as they are. On a GPU, the data set is held on
the device as in ``plain_loop``, so the batches Lightning receives are already there (its transfer
is then a no-op) and both do the same data work.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor

from scripts.bench.paired_step import PairedPlainStep
from scripts.bench.plain_loop import (
    build_mlp,
    checkpoint_file,
    device_arguments,
    in_memory_batches,
    load_split,
    normalize,
    refuse_unavailable,
    save_checkpoint,
    torch_device,
    train_val_split,
    work_arguments,
)
from scripts.bench.timeline import Timeline, rank_path


class Batches:
    """A re-iterable of whole in-memory batches with a length, as Lightning expects of a loader."""

    def __init__(self, x: Tensor, y: Tensor, batch: int, train: bool) -> None:
        self.x, self.y, self.batch, self.train = x, y, batch, train

    def __iter__(self):
        return in_memory_batches(self.x, self.y, self.batch, shuffle=self.train, drop_last=self.train)

    def __len__(self) -> int:
        return len(self.x) // self.batch if self.train else math.ceil(len(self.x) / self.batch)


class BareModule(L.LightningModule):
    def __init__(self, lr: float, timeline: Timeline | None, checkpoint: Path) -> None:
        super().__init__()
        self.net, self.lr, self.timeline, self.checkpoint = build_mlp(), lr, timeline, checkpoint
        self.sums: dict[str, Tensor] = {}

    def _accumulate(self, stage: str, out: Tensor, y: Tensor, loss: Tensor) -> None:
        loss_sum, correct, seen = self.sums.get(stage) or (torch.zeros((), dtype=torch.float64, device=y.device),
                                                          torch.zeros((), dtype=torch.long, device=y.device),
                                                          torch.zeros((), device=y.device))
        self.sums[stage] = (loss_sum + loss.detach().double() * len(y), correct + (out.detach().argmax(1) == y).sum(),
                            seen + len(y))

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        loss = F.cross_entropy(out, y)
        self._accumulate("train", out, y, loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self._evaluate("val", batch)

    def test_step(self, batch, batch_idx):
        self._evaluate("test", batch)

    def _evaluate(self, stage: str, batch) -> None:
        x, y = batch
        out = self.net(x)
        self._accumulate(stage, out, y, F.cross_entropy(out, y))

    def on_train_epoch_start(self) -> None:
        self.sums.pop("train", None)
        if self.timeline:
            self.timeline.epoch_start()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if self.timeline:
            self.timeline.step_end(len(batch[1]), last=batch_idx + 1 == self.trainer.num_training_batches)

    def on_train_epoch_end(self) -> None:  # after validation, as in the plain loop
        save_checkpoint(self.checkpoint, self.current_epoch, self.net, self.trainer.optimizers[0])
        if self.timeline:
            self.timeline.epoch_end()

    def on_validation_epoch_start(self) -> None:
        self.sums.pop("val", None)

    def on_test_epoch_start(self) -> None:
        self.sums.pop("test", None)

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=self.lr, fused=True)


def main(argv: list[str] | None = None) -> dict:
    parser = work_arguments(__doc__.split("\n")[0])
    parser.add_argument("--paired", default=None, help="also time an interleaved plain step; write to this JSON")
    args = device_arguments(parser).parse_args(argv)
    refuse_unavailable(args)
    if args.workload != "mlp":
        parser.error("bare Lightning runs the mlp workload only")

    device = torch_device(args.accelerator)
    timeline = Timeline(rank_path(args.timeline, 0), cuda=device.type == "cuda") if args.timeline else None
    torch.manual_seed(args.seed)
    x, y, train_idx, val_idx = train_val_split(args.data_dir, args.seed)
    x_test, y_test = load_split(args.data_dir, train=False)
    x_train, y_train, x_val, y_val = x[train_idx], y[train_idx], x[val_idx], y[val_idx]
    # the whole data set on the training device, normalized there once, as the plain loop holds it
    x_train, x_val, x_test = (normalize(t.to(device)) for t in (x_train, x_val, x_test))
    y_train, y_val, y_test = (t.to(device) for t in (y_train, y_val, y_test))
    module = BareModule(args.lr, timeline, checkpoint_file(args, "bare_lightning"))
    callbacks = [PairedPlainStep(args.paired, args.data_dir, args.lr, args.seed)] if args.paired else []
    trainer = L.Trainer(barebones=True, accelerator=args.accelerator, devices=1, precision=args.precision,
                        max_epochs=args.epochs, limit_train_batches=args.limit_train_batches or 1.0,
                        num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(module, Batches(x_train, y_train, args.batch_size, train=True),
                Batches(x_val, y_val, args.batch_size, train=False))
    trainer.test(module, Batches(x_test, y_test, args.batch_size, train=False), verbose=False)
    loss_sum, correct, seen = module.sums["test"]
    result = {"test/loss": float(loss_sum / seen), "test/acc": float(correct / seen)}
    print(f"test/loss={result['test/loss']:.4f}  test/acc={result['test/acc']:.4f}", flush=True)
    if timeline:
        timeline.meta["test_metrics"] = result
    return result


if __name__ == "__main__":
    main()
