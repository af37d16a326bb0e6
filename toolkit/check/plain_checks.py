"""`dsmt check` for the data of a model without a megatron-core adapter (toolkit/train/plain/engine.py): what can be
told cheaply from config.json, a directory listing, small image folders and jsonl files read with `json`. The
rest (tokenising, large folders' images, other formats) is checked by `toolkit.data.tasks` when training starts,
before anything is written."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import DsmtError, Problem
from toolkit.spec.schema import DATA_SOURCE_FIX, JobSpec

CHEAP_SCAN_BYTES = 64 * 2**20  # jsonl files up to this size have their labels checked by `dsmt check`
CHEAP_SCAN_FILES = 2000  # image folders up to this many files are decoded by `dsmt check`


def check_plain_model_data(*, spec: JobSpec, model_type: str) -> list[Problem]:
    """What can be told cheaply (config.json, a directory listing, small image folders, a jsonl read with `json`)
    about the data of a model without an adapter; the rest is checked when training starts (toolkit/data/tasks.py)."""
    import json

    from toolkit.data.tasks import task_of

    config = json.loads((Path(spec.model.path) / "config.json").read_text())
    problems = _sync_batchnorm_problems(spec=spec)
    try:
        task = task_of(_ConfigFacts(config))
    except DsmtError as err:
        return problems + [Problem("error", "plain_model_task", str(err))]  # the message lists the heads
    if spec.data.synthetic:
        return problems + [Problem("info", "synthetic_data", f"data.synthetic=true: {task} on synthetic inputs")]
    from toolkit.check.data_checks import megatron_rows_only_problems

    refused = megatron_rows_only_problems(data=spec.data, trainer=f"{task} with DeepSpeed alone (model_type "
                                          f"{model_type} has no megatron-core adapter)", record_types=False)
    if refused:
        return problems + refused
    if spec.data.path is None:
        return problems + [Problem("error", "data_source", f"data.path is unset and data.synthetic=false: there "
                                   f"is no data for {task}", DATA_SOURCE_FIX)]
    path = Path(spec.data.path).expanduser()
    if not path.exists():
        return problems + [Problem("warning", "data_path_missing", f"data.path={spec.data.path} does not exist on "
                                   "this machine", "fine if it exists on the cluster; otherwise fix the path")]
    problems.append(Problem("info", "plain_model_data", f"model_type {model_type}: task {task} (from architectures="
                            f"{config.get('architectures')}) on data.path={spec.data.path}"))
    if task == "image_classification":
        return problems + _image_folder_problems(path=path, spec=spec, config=config)
    if task == "sequence_classification" and path.suffix == ".jsonl" and path.stat().st_size <= CHEAP_SCAN_BYTES:
        return problems + _jsonl_label_problems(path=path, spec=spec, config=config)
    return problems


class _ConfigFacts:
    """The config.json fields the task and label rules read, without importing transformers."""

    def __init__(self, config: dict):
        self.architectures = config.get("architectures")
        self.model_type = config.get("model_type")
        id2label = config.get("id2label") or {}
        self.num_labels = int(config.get("num_labels") or len(id2label) or 2)  # HF's default: 2
        self.label2id = config.get("label2id") or {}


def _sync_batchnorm_problems(*, spec: JobSpec) -> list[Problem]:
    if spec.training.sync_batchnorm and spec.cluster.device == "cpu":
        return [Problem("error", "sync_batchnorm_on_cpu", "training.sync_batchnorm=true with cluster.device=cpu: "
                        "torch.nn.SyncBatchNorm runs on GPU/XPU only",
                        "set training.sync_batchnorm: false (BatchNorm statistics per rank, as DDP) or train on cuda")]
    return []


def _image_folder_problems(*, path: Path, spec: JobSpec, config: dict) -> list[Problem]:
    if not path.is_dir():
        return [Problem("error", "image_data", f"data.path={spec.data.path} is a file: image classification reads "
                        "an image folder (one sub-folder per class) or a save_to_disk directory",
                        "point data.path at the folder")]
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return []  # a save_to_disk dataset: its columns are checked when training starts
    classes = sorted(p.name for p in path.iterdir() if p.is_dir() and any(f.is_file() for f in p.iterdir()))
    if len(classes) < 2:
        return [Problem("error", "image_folder_classes", f"image folder data.path={spec.data.path} has "
                        f"{len(classes)} class sub-folder(s) ({', '.join(classes) or 'none'})",
                        "lay it out as DIR/<class>/<image>, at least two classes")]
    from toolkit.data.labels import named_labels

    facts, problems = _ConfigFacts(config), []
    if named_labels(facts) is None:  # classes are the sorted sub-folders, ids 0 .. len - 1
        if len(classes) > facts.num_labels:
            problems.append(Problem("error", "num_labels", f"image folder data.path={spec.data.path} has "
                                    f"{len(classes)} classes ({', '.join(classes)}) but the model has num_labels="
                                    f"{facts.num_labels}", f"re-save the model with num_labels={len(classes)}"))
    from PIL import Image

    from toolkit.data.images import decode_image

    extensions = Image.registered_extensions()  # the files datasets' imagefolder builder would read
    files = sorted(f for c in classes for f in (path / c).iterdir() if f.is_file() and f.suffix.lower() in extensions)
    if len(files) <= CHEAP_SCAN_FILES:
        for file in files:  # decoding tiny folders is cheap; larger ones are checked when training starts
            try:
                decode_image({"path": str(file), "bytes": None})
            except DsmtError as err:
                problems.append(Problem("error", "unreadable_image", str(err)))
    return problems


def _jsonl_label_problems(*, path: Path, spec: JobSpec, config: dict) -> list[Problem]:
    """The label rules of toolkit/data/tasks.py `class_labels`, on the records read with `json`."""
    import json

    from toolkit.data.tasks import class_labels

    data = spec.data
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []  # not plain JSON lines: `datasets` decides when training starts
    if not records or not all(isinstance(r, dict) for r in records):
        return []
    fields = list(records[0])
    missing_text = next((i for i, r in enumerate(records) if data.text_field not in r), None)
    if missing_text is not None:
        return [Problem("error", "text_field", f"record {missing_text} of data.path={data.path} has no field "
                        f"{data.text_field!r} (data.text_field); fields found: {', '.join(records[missing_text])}",
                        "set data.text_field to the field holding the text")]
    values = [r.get(data.label_field) for r in records] if any(data.label_field in r for r in records) else None
    try:
        class_labels(values=values, model_config=_ConfigFacts(config), data=data, fields=fields)
    except DsmtError as err:
        return [Problem("error", getattr(err, "rule", "labels"), str(err))]
    return []
