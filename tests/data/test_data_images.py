"""toolkit/data/images.py: image folders and save_to_disk image datasets as pixel_values / labels, the stated
default transform, the checkpoint's image processor, and the named errors for bad folders and files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.data.images import (IMAGENET_MEAN, IMAGENET_STD, ImageFolderError, UnreadableImageError,
                                 default_transform)
from toolkit.data.labels import LabelFieldMissingError, NumLabelsMismatchError
from toolkit.data.tasks import task_examples
from toolkit.spec.schema import DataSpec

CLASSES = ("cat", "dog", "fox")


def write_folder(root: Path, *, classes=CLASSES, per_class: int = 3, size: int = 16) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def resnet_config(**fields):
    from transformers import ResNetConfig

    return ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
                        architectures=["ResNetForImageClassification"], **fields)


def load(folder, *, config=None, processor_path="/nonexistent", tmp_path=None, **data):
    return task_examples(data=DataSpec(path=str(folder), **data), model_config=config or resnet_config(image_size=8),
                         tokenizer_path=str(processor_path), seq_length=1, seed=0,
                         cache_dir=str(tmp_path / "cache") if tmp_path else None)


def test_image_folder_gives_sorted_examples_with_folder_class_ids(tmp_path, capsys):
    folder = write_folder(tmp_path / "images")
    examples = load(folder, tmp_path=tmp_path)
    assert "default image transform" in capsys.readouterr().out  # stated once, here (no process group: rank 0)
    assert len(examples) == 9 and examples.labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [Path(s["path"]).relative_to(folder).as_posix() for s in examples.sources][:4] == \
        ["cat/0.png", "cat/1.png", "cat/2.png", "dog/0.png"]
    batch = examples.batch(indices=torch.tensor([4, 0]), positions=torch.tensor([0, 1]))
    assert batch["pixel_values"].shape == (2, 3, 8, 8) and batch["pixel_values"].dtype == torch.float32
    assert batch["labels"].tolist() == [1, 0]


def test_default_transform_is_bilinear_resize_and_imagenet_normalisation():
    from PIL import Image

    image = Image.fromarray(np.full((4, 6, 3), (255, 0, 128), dtype=np.uint8))
    pixels = default_transform(image, size=5)
    expected = [(v / 255 - m) / s for v, m, s in zip((255, 0, 128), IMAGENET_MEAN, IMAGENET_STD)]
    assert pixels.shape == (3, 5, 5)
    assert torch.allclose(pixels.mean(dim=(1, 2)), torch.tensor(expected), atol=1e-6)
    gray = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8), mode="L")  # converted to RGB
    resized = np.asarray(gray.convert("RGB").resize((4, 4), Image.Resampling.BILINEAR), dtype=np.float32) / 255
    assert torch.allclose(default_transform(gray, size=4)[0], (torch.from_numpy(resized[..., 0]) - 0.485) / 0.229)


def test_checkpoint_image_processor_wins_over_the_default(tmp_path):
    from transformers import ViTImageProcessor

    ViTImageProcessor(size={"height": 12, "width": 12}).save_pretrained(tmp_path / "model")
    examples = load(write_folder(tmp_path / "images"), processor_path=tmp_path / "model", tmp_path=tmp_path)
    assert "ViTImageProcessor" in examples.description
    assert examples.batch(indices=torch.tensor([0]), positions=torch.tensor([0]))["pixel_values"].shape[-1] == 12


def test_save_to_disk_dataset_with_image_and_label_columns(tmp_path):
    import datasets

    folder = write_folder(tmp_path / "images", per_class=2)
    files = sorted(folder.rglob("*.png"))
    records = datasets.Dataset.from_dict({"img": [str(f) for f in files], "target": [2, 2, 1, 1, 0, 0]})
    records.cast_column("img", datasets.Image()).save_to_disk(tmp_path / "saved")
    examples = load(tmp_path / "saved", label_field="target", tmp_path=tmp_path)
    assert examples.labels.tolist() == [2, 2, 1, 1, 0, 0]
    assert examples.batch(indices=torch.tensor([1]), positions=torch.tensor([0]))["pixel_values"].shape == (1, 3, 8, 8)
    with pytest.raises(LabelFieldMissingError, match="no field 'label' .*fields found: img, target"):
        load(tmp_path / "saved", tmp_path=tmp_path)


def test_one_class_folder_is_refused(tmp_path):
    with pytest.raises(ImageFolderError, match=r"1 class sub-folder\(s\) \(cat\).*at least two classes"):
        load(write_folder(tmp_path / "images", classes=("cat",)), tmp_path=tmp_path)


def test_more_classes_than_num_labels_is_refused(tmp_path):
    folder = write_folder(tmp_path / "images", classes=("a", "b", "c", "d", "e"), per_class=1)
    with pytest.raises(NumLabelsMismatchError, match=r"\{0, 1, 2, 3, 4\} but the model has num_labels=3"):
        load(folder, tmp_path=tmp_path)


def test_corrupt_image_is_named(tmp_path):
    folder = write_folder(tmp_path / "images")
    (folder / "dog" / "1.png").write_bytes(b"\x89PNG not really an image")
    with pytest.raises(UnreadableImageError) as err:
        load(folder, tmp_path=tmp_path)
    assert "dog/1.png cannot be read" in str(err.value) and "replace or remove the file" in str(err.value)
