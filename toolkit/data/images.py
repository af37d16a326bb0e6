"""Image-classification examples: `pixel_values` and `labels` for an HF `*ForImageClassification` model.

Sources (`data.path`, a directory):
  * an image folder, one sub-folder per class (`datasets`' imagefolder builder): class names are the sub-folder
    names, class ids their sorted order (the builder's ClassLabel), unless config.json's label2id names the
    classes, then the names map through it;
  * a `datasets.save_to_disk` directory with an image column (feature `datasets.Image`) and `data.label_field`
    (ClassLabel or int ids, or names when label2id names the classes).
Examples are ordered by the image's path relative to `data.path` (sorted as strings; save_to_disk datasets keep
their row order), so the order does not depend on how the builder lists files.

Decoding is lazy: the files are only opened (header read, `PIL.Image.open`) when the examples are built, to name an
unreadable file before training starts; pixels are decoded per batch.

Transform: the checkpoint's image processor (`AutoImageProcessor`) when its directory has
`preprocessor_config.json`; else `DEFAULT_TRANSFORM`: convert to RGB, resize to S x S with bilinear filtering
(PIL `Image.resize`, S = config.image_size, 224 when the config has none), scale to [0, 1], normalise with the
ImageNet mean/std per channel, `[3, S, S]` float32.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.data.labels import TaskExamples, check_num_labels, named_labels
from toolkit.errors import DsmtError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_IMAGE_SIZE = 224  # ImageNet's, when config.json has no image_size (ResNet configs have none)
DEFAULT_TRANSFORM = ("default image transform (no preprocessor_config.json in {where}): RGB, bilinear resize to "
                     "{size}x{size}, /255, normalise with ImageNet mean {mean} std {std}")


class ImageFolderError(DsmtError):
    """An image folder that cannot be a classification dataset (fewer than two classes)."""


class UnreadableImageError(DsmtError):
    """An image file PIL cannot open or decode."""


@dataclass
class ImageExamples(TaskExamples):
    """N images (file paths or encoded bytes) with int64 class ids; decoded and transformed per batch."""

    sources: list[dict]  # {"path": str | None, "bytes": bytes | None}, as datasets.Image(decode=False) gives
    labels: torch.Tensor
    transform: object  # callable: list[PIL.Image] -> pixel_values [n, C, H, W]
    description: str
    task: str = "image_classification"

    def __len__(self) -> int:
        return len(self.sources)

    def batch(self, *, indices: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        images = [decode_image(self.sources[i]) for i in indices.tolist()]
        return {"pixel_values": self.transform(images), "labels": self.labels[indices]}


def decode_image(source: dict):
    """The PIL image of a `{"path", "bytes"}` source, fully decoded; UnreadableImageError names the file."""
    from PIL import Image

    name = source.get("path") or "<image bytes>"
    try:
        image = Image.open(io.BytesIO(source["bytes"]) if source.get("bytes") else source["path"])
        image.load()
        return image
    except (OSError, SyntaxError, ValueError) as err:  # PIL raises OSError / UnidentifiedImageError for bad data
        raise UnreadableImageError(f"image {name} cannot be read ({type(err).__name__}: {err}); replace or "
                                   f"remove the file") from err


def _check_readable(sources: list[dict]) -> None:
    from PIL import Image

    for source in sources:
        name = source.get("path") or "<image bytes>"
        try:
            with Image.open(io.BytesIO(source["bytes"]) if source.get("bytes") else source["path"]):
                pass
        except (OSError, SyntaxError, ValueError) as err:
            raise UnreadableImageError(f"image {name} cannot be read ({type(err).__name__}: {err}); replace or "
                                       f"remove the file") from err


def image_examples(*, data, model_config, processor_path: str, cache_dir: str | None = None) -> ImageExamples:
    """`data.path` (an image folder or a save_to_disk directory) as `ImageExamples` for `model_config`."""
    root = Path(data.path).expanduser()
    if not root.is_dir():
        raise DsmtError(f"data.path={data.path!r} is not a directory: image classification reads an image folder "
                        f"(one sub-folder per class) or a datasets.save_to_disk directory")
    if _is_saved_dataset(root):
        sources, raw_labels = _saved_dataset(root=root, data=data)
    else:
        sources, raw_labels = _image_folder(root=root, data=data, cache_dir=cache_dir)
    labels = _label_ids(raw_labels=raw_labels, model_config=model_config, data=data)
    _check_readable(sources)
    transform, description = image_transform(model_config=model_config, processor_path=processor_path)
    return ImageExamples(sources=sources, labels=labels, transform=transform, description=description)


def _is_saved_dataset(root: Path) -> bool:
    return (root / "dataset_dict.json").is_file() or (root / "state.json").is_file()


def _image_folder(*, root: Path, data, cache_dir: str | None) -> tuple[list[dict], list[str]]:
    """(sources sorted by relative path, class name of each) through datasets' imagefolder builder."""
    import datasets

    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and any(f.is_file() for f in p.iterdir()))
    if len(classes) < 2:
        found = ", ".join(classes) or "none"
        raise ImageFolderError(
            f"image folder data.path={data.path!r} has {len(classes)} class sub-folder(s) ({found}); "
            f"classification needs one sub-folder per class (DIR/<class>/<image>) and at least two classes")
    try:
        folder = datasets.load_dataset("imagefolder", data_dir=str(root), split=data.split, cache_dir=cache_dir)
    except Exception as err:  # the builder raises its own types for an empty or odd folder
        raise DsmtError(f"data.path={data.path!r}: datasets' imagefolder builder failed ({type(err).__name__}: "
                        f"{err}); lay it out as DIR/<class>/<image file>") from err
    folder = folder.cast_column("image", datasets.Image(decode=False))
    names = folder.features["label"].names
    rows = sorted(zip(folder["image"], folder["label"]), key=lambda row: str(Path(row[0]["path"]).relative_to(root)))
    return [image for image, _ in rows], [names[label] for _, label in rows]


def _saved_dataset(*, root: Path, data) -> tuple[list[dict], list]:
    """(sources in row order, label of each) from a save_to_disk directory with an Image column."""
    import datasets

    from toolkit.data.labels import LabelFieldMissingError

    loaded = datasets.load_from_disk(str(root))
    if isinstance(loaded, datasets.DatasetDict):
        if data.split not in loaded:
            raise DsmtError(f"data.split={data.split!r} is not in {str(root)!r}; available splits: {', '.join(loaded)}")
        loaded = loaded[data.split]
    image_columns = [name for name, feature in loaded.features.items() if isinstance(feature, datasets.Image)]
    if not image_columns:
        raise DsmtError(f"data.path={data.path!r} has no image column (feature datasets.Image) among "
                        f"{', '.join(loaded.column_names)}; cast one with dataset.cast_column(name, datasets.Image())")
    if data.label_field not in loaded.column_names:
        raise LabelFieldMissingError(
            f"record 0 of data.path={data.path!r} has no field {data.label_field!r} (data.label_field); fields "
            f"found: {', '.join(loaded.column_names)}; set data.label_field to the column holding the labels")
    loaded = loaded.cast_column(image_columns[0], datasets.Image(decode=False))
    feature = loaded.features[data.label_field]
    labels = list(loaded[data.label_field])
    if isinstance(feature, datasets.ClassLabel):
        labels = [feature.names[label] for label in labels]
    return list(loaded[image_columns[0]]), labels


def _label_ids(*, raw_labels: list, model_config, data) -> torch.Tensor:
    """Class names or ids -> int64 ids: names through config.label2id when it names the classes, else folder /
    ClassLabel names by their sorted order, ints as they are."""
    from toolkit.data.labels import LabelTypeError

    names = named_labels(model_config)
    if names is None:  # ClassLabel names (or folder names) in sorted order
        string_names = sorted({label for label in raw_labels if isinstance(label, str)})
        names = {name: i for i, name in enumerate(string_names)}
    ids = []
    for index, label in enumerate(raw_labels):
        if isinstance(label, str) and label in names:
            ids.append(names[label])
        elif isinstance(label, int) and not isinstance(label, bool):
            ids.append(label)
        else:
            raise LabelTypeError(f"record {index + 1} of data.path={data.path!r}: label {label!r} is not a class id "
                                 f"or a class name of config.label2id ({', '.join(names)}); fix the data or label2id")
    check_num_labels(label_ids=ids, num_labels=int(model_config.num_labels), what=f"data.path={data.path!r}")
    return torch.tensor(ids, dtype=torch.int64)


def image_transform(*, model_config, processor_path: str):
    """(transform, description): the checkpoint's image processor, else the default of the module docstring."""
    if (Path(processor_path) / "preprocessor_config.json").is_file():
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(processor_path, trust_remote_code=False)
        return (lambda images: processor(images=images, return_tensors="pt")["pixel_values"],
                f"image processor {type(processor).__name__} from {processor_path}/preprocessor_config.json")
    size = int(getattr(model_config, "image_size", None) or DEFAULT_IMAGE_SIZE)
    channels = int(getattr(model_config, "num_channels", 3))
    if channels != 3:
        raise DsmtError(f"config.num_channels={channels}: the default image transform makes RGB (3 channels); "
                        f"add a preprocessor_config.json (an HF image processor) to {processor_path}")
    description = DEFAULT_TRANSFORM.format(where=processor_path, size=size, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    return (lambda images: torch.stack([default_transform(image, size=size) for image in images]), description)


def default_transform(image, *, size: int) -> torch.Tensor:
    """`DEFAULT_TRANSFORM` of one PIL image -> float32 `[3, size, size]`."""
    import numpy as np
    from PIL import Image

    resized = image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    pixels = torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return (pixels - mean) / std
