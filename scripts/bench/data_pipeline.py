"""Time the input pipelines alone (no model): how much of a training step is spent making the batch.

The project's batch is one index op on the data set, normalized once and held on the training device
(``InMemoryDataset.__getitems__``; ``data.on_device=auto``), plus its augmentation
(``transform_batch``, run by ``on_after_batch_transfer``); the per-sample pipeline builds each image
through PIL, ``ToTensor`` and ``Normalize`` and collates.
"""

from __future__ import annotations

import sys
import time

import torch

from scripts.bench.contenders import ROOT, SYNTHETIC_CIFAR10


def _ms_per_batch(batches, transform, count: int, skip: int = 2, sync=lambda: None) -> float:
    count = max(1, min(count, len(batches) - skip))  # large batches: fewer per epoch
    it = iter(batches)
    for _ in range(skip):  # first batches include worker start-up
        transform(next(it)[0])
    sync()
    start = time.perf_counter()
    for _ in range(count):
        transform(next(it)[0])
    sync()
    return 1e3 * (time.perf_counter() - start) / count


def project_batch_ms(batch_size: int = 128, count: int = 200, accelerator: str = "cpu") -> float:
    """ms to fetch and transform one training batch with the project's Fashion-MNIST DataModule, its data
    placed as a trainer on ``accelerator`` places it (on a GPU: timed up to ``torch.cuda.synchronize()``)."""
    from types import SimpleNamespace

    from src.data.mnist_datamodule import FashionMNISTDataModule

    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    dm = FashionMNISTDataModule(data_dir=str(ROOT / "data"), batch_size=batch_size,
                         system_dir="/usr/share/datasets/fashion-mnist")
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=device), global_rank=0)  # what setup reads
    dm.prepare_data()
    dm.setup("fit")
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    return _ms_per_batch(dm.train_dataloader(), lambda x: dm.transform_batch(x, training=True), count, sync=sync)


def per_sample_batch_ms(workers: int, batch_size: int = 128, count: int = 100) -> float:
    """ms per batch of torchvision's per-sample pipeline (transforms run inside the loader)."""
    from scripts.bench.per_sample_pipeline import per_sample_loader

    loader = per_sample_loader(str(ROOT / "data"), True, None, batch_size, workers, shuffle=True)
    return _ms_per_batch(loader, lambda x: x, count)


def ensure_data(workload: str = "mlp") -> None:
    """Extract Fashion-MNIST into ``data/`` (as ``src/train.py`` would) so the plain scripts find it; for the
    resnet18 workload, write the synthetic CIFAR-10 files (``make synthetic-cifar10``) if they are missing."""
    from src.data.mnist_datamodule import FashionMNISTDataModule

    FashionMNISTDataModule(data_dir=str(ROOT / "data"), system_dir="/usr/share/datasets/fashion-mnist").prepare_data()
    if workload == "resnet18" and not (SYNTHETIC_CIFAR10 / "cifar-10-batches-py").is_dir():
        import subprocess

        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_synthetic_cifar10.py"), "--out",
                        str(SYNTHETIC_CIFAR10)], check=True)


def in_threads(threads: int, fn, *args):
    """Run ``fn`` with ``torch.set_num_threads(threads)``, restoring the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)
