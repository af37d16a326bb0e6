"""dsmt's megatron checkpoint directory, and writing any output directory atomically.

    <dir>/dsmt_checkpoint.json   what wrote it, for which model; read first, so foreign checkpoints fail clearly
    <dir>/hf/                    the source's config.json, generation config and tokenizer files
    <dir>/model/                 megatron-core dist_checkpointing (torch_dist): loads at any TP x PP (resharding)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import torch

from toolkit import __version__
from toolkit.errors import DsmtError

FORMAT_NAME = "dsmt-mcore"
FORMAT_VERSION = 1
METADATA_FILE = "dsmt_checkpoint.json"
# Files of an HF checkpoint that are not weights and travel with it both ways.
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                 "chat_template.jinja", "chat_template.json")


class CheckpointError(DsmtError):
    """A checkpoint directory that is not what the command expects."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_metadata(directory: Path, *, model_type: str, padded_vocab_size: int, vocab_pad_multiple: int,
                   params_dtype: torch.dtype, source: str, hf_tensor_dtypes: dict[str, str]) -> None:
    import megatron.core

    metadata = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "dsmt_version": __version__,
        "megatron_core_version": megatron.core.__version__, "model_type": model_type,
        "params_dtype": dtype_name(params_dtype), "padded_vocab_size": padded_vocab_size,
        "vocab_pad_multiple": vocab_pad_multiple, "source": source,
        # Per HF tensor, so export restores each dtype exactly (megatron keeps e.g. torch-fallback norms in fp32).
        "hf_tensor_dtypes": hf_tensor_dtypes,
    }
    (directory / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")


def read_metadata(directory: Path) -> dict:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"megatron checkpoint {directory} does not exist")
    path = directory / METADATA_FILE
    if not path.is_file():
        hint = ""
        if (directory / "latest_checkpointed_iteration.txt").exists() or (directory / "metadata.json").exists():
            hint = " It looks like a Megatron-LM / dist_checkpointing checkpoint written by another tool."
        raise CheckpointError(
            f"{directory} has no {METADATA_FILE}, so it was not written by `dsmt convert hf-to-mcore`.{hint} "
            "Convert the original HF checkpoint with `dsmt convert hf-to-mcore HF_DIR OUT_DIR`."
        )
    try:
        metadata = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not readable JSON ({err})") from err
    if metadata.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} has format {metadata.get('format')!r}, expected {FORMAT_NAME!r}")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} is format_version {metadata.get('format_version')!r} (written by dsmt "
            f"{metadata.get('dsmt_version')}); this dsmt {__version__} reads version {FORMAT_VERSION}: use a matching dsmt"
        )
    return metadata


def copy_side_files(source_dir: Path, target_dir: Path) -> list[str]:
    target_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in HF_SIDE_FILES:
        if (Path(source_dir) / name).is_file():
            shutil.copy2(Path(source_dir) / name, target_dir / name)
            copied.append(name)
    return copied


def refuse_existing(out_dir: Path, *, overwrite: bool) -> None:
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise DsmtError(f"output directory {out_dir} already exists; choose another path or pass --overwrite")


@contextlib.contextmanager
def atomic_output_dir(out_dir: Path, *, overwrite: bool):
    """Yield a temporary sibling of `out_dir`; it replaces `out_dir` only if the block completes."""
    out_dir = Path(out_dir)
    refuse_existing(out_dir, overwrite=overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp_dir = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(temp_dir, ignore_errors=True)
    temp_dir.mkdir()
    try:
        yield temp_dir
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        out_dir.rename(old)
        temp_dir.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        temp_dir.rename(out_dir)
