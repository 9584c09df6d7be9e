"""Plain PyTorch training of the Fashion-MNIST MLP: the baseline the project is measured against.

    python -m scripts.bench.plain_loop --epochs 3                      # in-memory batches
    python -m scripts.bench.plain_loop --data per_sample --workers 2   # torchvision per-sample pipeline
    python -m scripts.bench.plain_loop --accelerator gpu --precision bf16-mixed
    python -m scripts.bench.plain_loop --workload resnet18 --batch-size 256 --accelerator gpu --precision bf16-mixed

Same work as ``python src/train.py``: the same 55,000/5,000 train/val split (same seeded
permutation), MLP 784-512-256-10 with dropout 0.1, fused Adam (lr 1e-3), batch 128 with the last
incomplete batch dropped, validation and a checkpoint (model and optimizer state, ``torch.save``)
after every epoch, test at the end. Batches are ``index_select`` on the in-memory uint8 tensors, read
from the IDX files by a few lines of numpy (torchvision is imported only for ``--data per_sample``).
The data set is normalized once, before training. Train loss/accuracy are accumulated on tensors (no
host sync per step), as careful plain code would.

On a GPU (``--accelerator gpu``) the model lives on the device and so does the whole data set (moved as
uint8, normalized there), so a batch is one index op on the device, with the shuffle drawn there too;
the per-sample pipeline's batches come from pinned memory with non-blocking copies. Timers are read after
``torch.cuda.synchronize()``. ``--precision bf16-mixed`` runs forward and loss (training and
evaluation) under ``torch.autocast(device_type, dtype=torch.bfloat16)``, as Lightning's bf16-mixed does.

``--workload resnet18``: the project's ResNet18 on CIFAR-10-shaped data (``data/synthetic_cifar10``, read
with ``pickle`` as the CIFAR-10 page shows), normalized once, with a random crop (padding 4) and flip of
each training batch on its device, and ``model=resnet18``'s SGD (lr 0.1, momentum 0.9, fused).
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scripts.bench.contenders import ACCELERATORS, PRECISIONS, SYNTHETIC_CIFAR10, WORKLOADS
from scripts.bench.per_sample_pipeline import FASHION_MEAN, FASHION_STD
from scripts.bench.timeline import Timeline, rank_path

ROOT = Path(__file__).resolve().parents[2]
Autocast = Callable[[], AbstractContextManager]  # a fresh autocast context for each step


def torch_device(accelerator: str) -> torch.device:
    return torch.device("cuda" if accelerator == "gpu" else "cpu")


def autocast_for(device: torch.device, precision: str) -> Autocast | None:
    """What wraps forward + loss for ``precision``: ``None`` for 32-true, else a bf16 autocast factory."""
    if precision == "32-true":
        return None
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def require_device(accelerator: str, precision: str) -> str | None:
    """Why ``accelerator``/``precision`` cannot run on this machine (one line), or ``None`` if they can."""
    if accelerator != "gpu":
        return None
    if not torch.cuda.is_available():
        return (f"--accelerator gpu needs CUDA, but torch {torch.__version__} sees no CUDA device here "
                f"(built with CUDA {torch.version.cuda or 'none'}); run on a GPU machine or use --accelerator cpu")
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        return (f"--precision bf16-mixed needs a GPU with bfloat16 support; {torch.cuda.get_device_name()} has none: "
                "use --precision 32-true")
    return None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA only), so that a timer read next is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_IDX_TYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> Tensor:
    """One IDX file (the MNIST format: 2 zero bytes, a type code, the rank, big-endian int32 sizes, data).

    The data is read straight into its array (one allocation); multi-byte types end up in native order.
    """
    with open(path, "rb") as f:
        magic = f.read(4)
        if len(magic) < 4 or magic[:2] != b"\0\0" or magic[2] not in _IDX_TYPES:
            raise ValueError(f"{path}: not an IDX file (magic {magic.hex()})")
        shape = tuple(int(d) for d in np.frombuffer(f.read(4 * magic[3]), ">i4"))
        count = int(np.prod(shape))
        data = np.fromfile(f, np.dtype(_IDX_TYPES[magic[2]]), count)
        if data.size != count or f.read(1):
            raise ValueError(f"{path}: size does not match its shape {shape}")
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("="))
    return torch.from_numpy(data.reshape(shape))


def load_split(data_dir: str, train: bool) -> tuple[Tensor, Tensor]:
    """uint8 images ``(N, 1, 28, 28)`` and int64 labels from the IDX files the project extracts."""
    raw = Path(data_dir) / "FashionMNIST" / "raw"
    prefix = "train" if train else "t10k"
    images = read_idx(raw / f"{prefix}-images-idx3-ubyte").unsqueeze(1)
    labels = read_idx(raw / f"{prefix}-labels-idx1-ubyte").long()
    return images, labels


def train_val_indices(n: int, val_size: int, seed: int) -> tuple[Tensor, Tensor]:
    """The project's split: a permutation seeded with ``seed``; the first ``val_size`` are validation."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[val_size:], order[:val_size]


def train_val_split(data_dir: str, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The project's training set and split: ``(images, labels, train_idx, val_idx)``."""
    x, y = load_split(data_dir, train=True)
    return x, y, *train_val_indices(len(x), 5000, seed)


def train_step(net: nn.Module, optimizer: torch.optim.Optimizer, xb: Tensor, yb: Tensor,
               autocast: Autocast | None = None) -> tuple[Tensor, Tensor]:
    """One plain training step; returns the batch's loss sum and correct count (tensors: no host sync)."""
    if autocast is None:
        out = net(xb)
        loss = F.cross_entropy(out, yb)
    else:
        with autocast():
            out = net(xb)
            loss = F.cross_entropy(out, yb)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach().double() * len(yb), (out.detach().argmax(1) == yb).sum()


def build_mlp(hidden: tuple[int, ...] = (512, 256), dropout: float = 0.1, classes: int = 10) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Flatten()]
    width = 28 * 28
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU(inplace=True), nn.Dropout(dropout)]
        width = size
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def normalize(images: Tensor) -> Tensor:
    """uint8 images to normalized float32, once for the whole data set."""
    return (images.float().div_(255.0) - FASHION_MEAN[0]) / FASHION_STD[0]


def in_memory_batches(x: Tensor, y: Tensor, batch: int, shuffle: bool, drop_last: bool,
                      augment: Callable[[Tensor], Tensor] | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """Whole batches by one ``index_select`` on the stored (normalized) tensors, on their device."""
    order = torch.randperm(len(x), device=x.device) if shuffle else torch.arange(len(x), device=x.device)
    stop = len(x) - len(x) % batch if drop_last else len(x)
    for start in range(0, stop, batch):
        idx = order[start:start + batch]
        xb = x.index_select(0, idx)
        yield (augment(xb) if augment else xb), y.index_select(0, idx)


CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)


def read_cifar10(data_dir: str, train: bool) -> tuple[Tensor, Tensor]:
    """uint8 images ``(N, 3, 32, 32)`` and int64 labels from ``data_dir/cifar-10-batches-py``."""
    folder = Path(data_dir) / "cifar-10-batches-py"
    images, labels = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]:
        with open(folder / name, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        images.append(entry["data"])
        labels += entry["labels"]
    return torch.from_numpy(np.concatenate(images).reshape(-1, 3, 32, 32)), torch.tensor(labels)


def resnet18_workload(data_dir: str, seed: int, device: torch.device):
    """The ResNet18 work: the net, normalized splits on ``device``, and the training-batch augmentation."""
    from src.engine.data.batch_transforms import random_crop, random_hflip  # the project's batch-wise ops
    from src.models.components.resnet18 import ResNet18  # the same architecture as model=resnet18

    mean = torch.tensor(CIFAR10_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD, device=device).view(1, 3, 1, 1)
    x, y = read_cifar10(data_dir, train=True)
    train_idx, val_idx = train_val_indices(len(x), 5000, seed)
    x_test, y_test = read_cifar10(data_dir, train=False)
    splits = [(x[train_idx], y[train_idx]), (x[val_idx], y[val_idx]), (x_test, y_test)]
    splits = [((t.to(device).float() / 255 - mean) / std, labels.to(device)) for t, labels in splits]
    black, generator = (0 - mean) / std, torch.Generator(device=device).manual_seed(seed)

    def augment(images: Tensor) -> Tensor:
        return random_hflip(random_crop(images, 4, generator, fill=black), generator=generator)

    return ResNet18(in_channels=3, num_classes=10).to(device), splits, augment


@torch.no_grad()
def evaluate(net: nn.Module, batches, device: torch.device | None = None,
             autocast: Autocast | None = None) -> tuple[float, float]:
    """(mean loss, accuracy) over all samples of ``batches``."""
    net.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct, count = torch.zeros((), dtype=torch.long, device=device), 0
    for xb, yb in batches:
        if autocast is None:
            out = net(xb)
            batch_loss = F.cross_entropy(out, yb, reduction="sum")
        else:
            with autocast():
                out = net(xb)
                batch_loss = F.cross_entropy(out, yb, reduction="sum")
        loss_sum += batch_loss.double()
        correct += (out.argmax(1) == yb).sum()
        count += len(yb)
    net.train()
    return float(loss_sum / count), float(correct) / count


def make_batches(args, x: Tensor, y: Tensor, train: bool, dataset_train: bool, indices: Tensor | None,
                 device: torch.device | None = None, augment: Callable[[Tensor], Tensor] | None = None):
    """A fresh iterable of batches for one pass, from memory or from the per-sample pipeline.

    In memory, batches are made where ``x`` and ``y`` are; per-sample batches are copied to ``device``
    (from pinned memory when it is a GPU).
    """
    if args.data == "per_sample":
        from scripts.bench.per_sample_pipeline import per_sample_loader  # imports torchvision

        cuda = device is not None and device.type == "cuda"
        loader = per_sample_loader(args.data_dir, dataset_train, None if indices is None else indices.tolist(),
                                   args.batch_size, args.workers, shuffle=train, pin_memory=cuda)
        return _ToDevice(loader, device) if cuda else loader
    steps = len(x) // args.batch_size if train else -(-len(x) // args.batch_size)
    return _Reiterable(lambda: in_memory_batches(x, y, args.batch_size, shuffle=train, drop_last=train,
                                                 augment=augment), steps)


class _Reiterable:
    def __init__(self, make, length: int) -> None:
        self.make, self.length = make, length

    def __iter__(self):
        return self.make()

    def __len__(self) -> int:
        return self.length


class _ToDevice:
    """A loader's batches, copied to ``device`` without blocking (the loader pins them)."""

    def __init__(self, loader, device: torch.device) -> None:
        self.loader, self.device = loader, device

    def __iter__(self):
        for xb, yb in self.loader:
            yield xb.to(self.device, non_blocking=True), yb.to(self.device, non_blocking=True)

    def __len__(self) -> int:
        return len(self.loader)


def work_arguments(description: str) -> argparse.ArgumentParser:
    """The options every plain/bare contender shares: the work to do and where to record its timeline."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch (split across DDP ranks)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--limit-train-batches", type=int, default=0, help="steps per epoch (0 = whole epoch)")
    parser.add_argument("--data-dir", default=str(ROOT / "data"))
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--timeline", default=None, help="write bench timelines to <prefix>.rank<r>.json")
    parser.add_argument("--checkpoint", default=None,
                        help="file saved after every epoch (default logs/<script>/last.pt)")
    return parser


def checkpoint_file(args: argparse.Namespace, script: str) -> Path:
    """Where the per-epoch checkpoint goes (its folder created)."""
    path = Path(args.checkpoint) if args.checkpoint else ROOT / "logs" / script / "last.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def save_checkpoint(path: Path, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What resuming needs, as ``python src/train.py`` saves it every epoch: model and optimizer state."""
    torch.save({"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def device_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--accelerator`` and ``--precision``, with Lightning's names for them."""
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="cpu", help="gpu: CUDA device 0")
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true",
                        help="bf16-mixed: forward and loss under torch.autocast(dtype=torch.bfloat16)")
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="mlp",
                        help="mlp (Fashion-MNIST) or resnet18 (synthetic CIFAR-10 files in data/synthetic_cifar10)")
    return parser


def refuse_unavailable(args: argparse.Namespace) -> None:
    """Exit 2 with one line on stderr when this machine cannot run ``args.accelerator``/``args.precision``."""
    reason = require_device(args.accelerator, args.precision)
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> dict:
    parser = work_arguments(__doc__.split("\n")[0])
    parser.add_argument("--data", choices=("in_memory", "per_sample"), default="in_memory")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers of the per-sample pipeline")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch's default)")
    args = device_arguments(parser).parse_args(argv)
    refuse_unavailable(args)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch_device(args.accelerator)
    autocast = autocast_for(device, args.precision)
    timeline = Timeline(rank_path(args.timeline, 0), cuda=device.type == "cuda") if args.timeline else None
    torch.manual_seed(args.seed)
    augment, train_idx, val_idx = None, None, None
    if args.workload == "resnet18":
        net, splits, augment = resnet18_workload(str(SYNTHETIC_CIFAR10), args.seed, device)
        (x_train, y_train), (x_val, y_val), (x_test, y_test) = splits
    else:
        x, y, train_idx, val_idx = train_val_split(args.data_dir, args.seed)
        x_train, y_train, x_val, y_val = x[train_idx], y[train_idx], x[val_idx], y[val_idx]
        x_test, y_test = load_split(args.data_dir, train=False)
        if args.data == "in_memory":  # the whole data set on the training device, normalized there once
            x_train, x_val, x_test = (normalize(t.to(device)) for t in (x_train, x_val, x_test))
            y_train, y_val, y_test = (t.to(device) for t in (y_train, y_val, y_test))
        net = build_mlp().to(device)

    if args.workload == "resnet18":  # configs/model/resnet18.yaml's optimizer
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-5, fused=True)
    else:
        optimizer = torch.optim.Adam(net.parameters(), lr=args.lr, fused=True)
    checkpoint = checkpoint_file(args, "plain_loop")
    train_batches = make_batches(args, x_train, y_train, True, True, train_idx, device, augment)
    val_batches = make_batches(args, x_val, y_val, False, True, val_idx, device)
    steps = min(len(train_batches), args.limit_train_batches or len(train_batches))
    for epoch in range(args.epochs):
        if timeline:
            timeline.epoch_start()
        synchronize(device)
        start = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct, seen = torch.zeros((), dtype=torch.long, device=device), 0
        for step, (xb, yb) in enumerate(train_batches):
            if args.limit_train_batches and step == args.limit_train_batches:
                break
            batch_loss, batch_correct = train_step(net, optimizer, xb, yb, autocast)
            loss_sum += batch_loss
            correct += batch_correct
            seen += len(yb)
            if timeline:
                timeline.step_end(len(yb), last=step + 1 == steps)
        synchronize(device)
        seconds = time.perf_counter() - start
        val_loss, val_acc = evaluate(net, val_batches, device, autocast)
        save_checkpoint(checkpoint, epoch, net, optimizer)
        if timeline:
            timeline.epoch_end()
        print(f"epoch {epoch}: training {seconds:.2f} s, {seen / seconds:,.0f} samples/s, with validation and "
              f"checkpoint {time.perf_counter() - start:.2f} s  train/loss={float(loss_sum) / seen:.4f}"
              f"  train/acc={float(correct) / seen:.4f}  val/loss={val_loss:.4f}  val/acc={val_acc:.4f}", flush=True)
    test_loss, test_acc = evaluate(net, make_batches(args, x_test, y_test, False, False, None, device), device,
                                   autocast)
    print(f"test/loss={test_loss:.4f}  test/acc={test_acc:.4f}", flush=True)
    result = {"test/loss": test_loss, "test/acc": test_acc}
    if timeline:
        timeline.meta["test_metrics"] = result
    return result


if __name__ == "__main__":
    main()
