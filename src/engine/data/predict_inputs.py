"""What ``src/predict.py`` runs a model on: a data module's split, a folder of images, or a tensor file.

Every form becomes the data module's own stored form (uint8 images ``(N, C, H, W)``, or its split as set
up), so the module's ``on_after_batch_transfer`` normalizes them exactly as in training. Each input keeps
a source name (a file name, or ``split[i]``) for the CSV, and its label where it has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from src.engine.data.in_memory import InMemoryDataset
from src.engine.utils.errors import DataError
from src.engine.utils.pylogger import RankedLogger

log = RankedLogger(__name__)

SPLITS = ("train", "val", "test")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
TENSOR_SUFFIXES = (".npy", ".pt")
NO_LABEL = -1


@dataclass
class PredictInputs:
    dataset: InMemoryDataset | None  # targets: the labels, or NO_LABEL (None: a user data module's own loader)
    sources: list[str]


USER_SPLITS = ("test", "predict")


def split_inputs(source: str, datamodule) -> PredictInputs:
    """The inputs of a data module that is not the project's: its own ``test`` or ``predict`` loader."""
    name = type(datamodule).__name__
    if source not in USER_SPLITS:
        raise DataError(f"input={source}: {name} is not a data module of this project, so only its own loaders can "
                        f"be predicted on; fix: input=test or input=predict")
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden(f"{source}_dataloader", datamodule):
        raise DataError(f"input={source}: {name} defines no {source}_dataloader; fix: define it, or pick the other "
                        f"of {', '.join(USER_SPLITS)}")
    datamodule.prepare_data()
    datamodule.setup(source)
    loader = getattr(datamodule, f"{source}_dataloader")()
    return PredictInputs(None, [f"{source}[{i}]" for i in range(len(loader.dataset))])


def predict_on_inputs(model) -> None:
    """A module without a ``predict_step`` of its own predicts ``forward(inputs)``: Lightning's default would pass
    the whole ``(inputs, labels)`` batch to ``forward``."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if is_overridden("predict_step", model):
        return
    if not is_overridden("forward", model):
        raise DataError(f"predict.py needs {type(model).__name__}.predict_step or forward, and it defines neither; "
                        "fix: define forward(inputs)")

    def predict_step(batch, batch_idx: int, dataloader_idx: int = 0):
        return model(batch[0] if isinstance(batch, (list, tuple)) else batch)

    model.predict_step = predict_step  # this instance only; the class is the user's


def load_inputs(source: str, datamodule, ckpt_path: str) -> PredictInputs:
    """``source``: ``train``/``val``/``test`` (a split of ``datamodule``), a folder of PNG/JPEG files, or a
    ``.npy``/``.pt`` file of images. ``train`` and ``val`` must be split as ``ckpt_path`` was trained."""
    if source in SPLITS:
        if source != "test":
            check_same_split(source, datamodule, ckpt_path)
        datamodule.prepare_data()
        datamodule.setup("predict")
        dataset = getattr(datamodule, f"data_{source}")
        return PredictInputs(dataset, [f"{source}[{i}]" for i in range(len(dataset))])
    path = Path(source)
    shape = datamodule.input_shape
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise DataError(f"input={source} holds no PNG or JPEG file; fix: point input= at a folder of images, a "
                            f".npy/.pt file, or one of {', '.join(SPLITS)}")
        images = torch.stack([read_image(p, shape) for p in files])
        return PredictInputs(unlabelled(images), [p.name for p in files])
    if path.suffix in TENSOR_SUFFIXES and path.is_file():
        images = check_images(read_tensor(path), shape, path)
        return PredictInputs(unlabelled(images), [f"{path.name}[{i}]" for i in range(len(images))])
    raise DataError(f"input={source} is not {', '.join(SPLITS)}, a folder of images or an existing .npy/.pt file; "
                    "fix: name one of those")


def check_same_split(source: str, datamodule, ckpt_path: str) -> None:
    """Refuse ``input=train``/``val`` when this config would split the data otherwise than the checkpoint's
    training run did (another seed, validation size or fold): its "validation" rows would hold samples the
    model trained on. A checkpoint that saved no data settings is predicted on this config's split."""
    from src.engine.checkpointing.start import saved_data_settings

    saved = saved_data_settings(ckpt_path)
    if saved is None or not hasattr(datamodule, "split_settings"):
        log.warning(f"{ckpt_path} records no data split: input={source} is split as this config says")
        return
    trained = datamodule.split_settings(saved)
    here = datamodule.split_settings(datamodule.hparams)
    if trained != here:
        fix = " ".join(f"data.{key}={'null' if value is None else value}" for key, value in trained.items()
                       if datamodule.hparams.get(key) != value)
        raise DataError(f"input={source}: {ckpt_path} was trained on the split of "
                        f"{', '.join(f'{k}={v}' for k, v in trained.items())}, and this config splits with "
                        f"{', '.join(f'{k}={v}' for k, v in here.items())}; fix: add {fix}")


def unlabelled(images: Tensor) -> InMemoryDataset:
    return InMemoryDataset(images, torch.full((len(images),), NO_LABEL, dtype=torch.long))


_converted: set[str] = set()


def read_image(path: Path, shape: tuple[int, ...]) -> Tensor:
    """One image file as uint8 ``(C, H, W)`` in the model's channels and size (each conversion said once)."""
    from torchvision.io import decode_image
    from torchvision.transforms.v2 import functional as F

    channels, height, width = shape
    try:
        image = decode_image(str(path))
    except (RuntimeError, ValueError) as err:
        raise DataError(f"cannot read the image {path} ({err}); fix: remove it or replace it with a PNG or JPEG "
                        "file") from None
    image = image[:3] if image.shape[0] == 4 else image  # drop an alpha channel
    if image.shape[0] != channels:
        image = F.rgb_to_grayscale(image) if channels == 1 else image.expand(3, -1, -1).contiguous()
        _say_once(f"images converted to {channels} channel(s), as the model takes them")
    if tuple(image.shape[1:]) != (height, width):
        image = F.resize(image, [height, width], antialias=True)
        _say_once(f"images resized to {height}x{width}, the size the model takes")
    return image


def read_tensor(path: Path) -> Tensor:
    try:
        if path.suffix == ".npy":
            import numpy as np

            return torch.from_numpy(np.load(path, allow_pickle=False))
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unreadable file: one line naming it
        raise DataError(f"cannot read the tensor file {path} ({type(err).__name__}: {err}); fix: save one tensor "
                        "with numpy.save or torch.save") from None
    if not isinstance(loaded, Tensor):
        raise DataError(f"{path} holds a {type(loaded).__name__}, not one tensor; fix: torch.save a single tensor")
    return loaded


def check_images(images: Tensor, shape: tuple[int, ...], path: Path) -> Tensor:
    """``(N, C, H, W)`` uint8 images (``(N, H, W)`` for one channel; floats in [0, 1] are scaled to uint8)."""
    if images.dim() == len(shape) and shape[0] == 1:
        images = images.unsqueeze(1)
    if images.dim() != len(shape) + 1 or tuple(images.shape[1:]) != tuple(shape):
        raise DataError(f"{path} holds a tensor of shape {tuple(images.shape)}; fix: give images of shape "
                        f"(N, {', '.join(map(str, shape))}), uint8 (0-255) or float (0-1)")
    if len(images) == 0:
        raise DataError(f"{path} holds no images (shape {tuple(images.shape)}); fix: give at least one image")
    if images.is_floating_point():
        images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    elif images.dtype != torch.uint8:
        raise DataError(f"{path} holds {images.dtype} values; fix: give uint8 (0-255) or float (0-1) images")
    return images


def _say_once(message: str) -> None:
    if message not in _converted:
        _converted.add(message)
        log.warning(message)
