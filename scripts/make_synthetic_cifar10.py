"""Write SYNTHETIC CIFAR-10 files in the exact on-disk format of ``cifar-10-python.tar.gz``.

CIFAR-10 cannot be downloaded on an offline machine; these files let the real loading
code run end to end. Images are class-coloured noise so a model can fit them, but any
accuracy on them is meaningless: never report it as CIFAR-10 accuracy. By default the files hold
CIFAR-10's own counts (5 x 10,000 training images, 10,000 test), so every config that fits the real
set (`data.val_size=5000`) fits these too.

    python scripts/make_synthetic_cifar10.py --out data/synthetic_cifar10     # `make synthetic-cifar10`
    python scripts/make_synthetic_cifar10.py --out /tmp/cifar --per-batch 200 --test 200   # small, for tests
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import numpy as np

LABEL_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def make_batch(n: int, rng: np.random.Generator, label: str) -> dict:
    labels = rng.integers(0, 10, size=n)
    palette = rng.integers(40, 216, size=(10, 3))  # one base colour per class
    pixels = palette[labels][:, :, None] + rng.normal(0, 40, size=(n, 3, 1024))
    data = np.clip(pixels, 0, 255).astype(np.uint8).reshape(n, 3072)  # row-major R, G, B planes
    return {
        "batch_label": label,
        "labels": labels.tolist(),
        "data": data,
        "filenames": [f"synthetic_{label.replace(' ', '_')}_{i}.png" for i in range(n)],
    }


def write(out: Path, per_batch: int, test: int, seed: int) -> Path:
    folder = out / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(1, 6):
        _dump(folder / f"data_batch_{i}", make_batch(per_batch, rng, f"training batch {i} of 5"))
    _dump(folder / "test_batch", make_batch(test, rng, "testing batch 1 of 1"))
    _dump(folder / "batches.meta", {"num_cases_per_batch": per_batch, "label_names": LABEL_NAMES, "num_vis": 3072})
    return folder


def _dump(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/synthetic_cifar10"))
    parser.add_argument("--per-batch", type=int, default=10_000, help="images in each of the 5 training batches")
    parser.add_argument("--test", type=int, default=10_000, help="images in the test batch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"wrote SYNTHETIC CIFAR-10 to {write(args.out, args.per_batch, args.test, args.seed)}")


if __name__ == "__main__":
    main()
