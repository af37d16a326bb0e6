"""Read a job spec (YAML or JSON), apply `--set a.b=value` overrides, validate it into a `JobSpec`.

Every schema problem is reported at once; an unknown key comes with the nearest valid name. A relative path
written in the file is taken against the file's folder, one given with `--set` against the working directory
(toolkit/spec/paths.py); `absolutize_paths` pins the defaults (output_dir) before a spec is copied into a run
directory.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import pydantic
import yaml

from toolkit.errors import DsmtError
from toolkit.models.shapes import BUILTIN_SHAPES, ModelShape, ModelShapeError, load_model_shape, shape_from_config
from toolkit.spec.report import Problem, Report, SpecError
from toolkit.spec.schema import SCHEMA_RULES, JobSpec, ModelSpec

def load_spec(path: str | Path, *, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """The validated spec in `path` with `overrides` applied; raises SpecError listing every problem."""
    return validate_spec(read_spec(path, overrides=overrides), source=str(path))


def read_spec(path: str | Path, *, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The raw mapping of `path` with `overrides` applied and every relative path pinned: the file's against its
    folder, the overrides' against the working directory. Raises SpecError (an ambiguous model.path)."""
    from toolkit.spec.paths import pin_spec_paths

    raw = pin_spec_paths(read_spec_file(path), base_dir=Path(path).expanduser().absolute().parent, source=str(path))
    return pin_spec_paths(apply_overrides(raw, overrides=overrides), base_dir=Path.cwd(), source=str(path))


def read_spec_file(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise DsmtError(f"cannot read job spec {path}: {err.strerror}") from err
    try:
        raw = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as err:
        raise DsmtError(f"{path} is not valid YAML/JSON: {err}") from err
    if not isinstance(raw, dict):
        raise DsmtError(f"{path}: a job spec is a mapping with sections model, cluster, parallel, training, ...")
    return raw


def apply_overrides(raw: dict[str, Any], *, overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """A copy of `raw` with each `dotted.key=value` set; the value is parsed as YAML (`4`, `true`, `[a, b]`)."""
    result = yaml.safe_load(yaml.safe_dump(raw))  # deep copy of plain data
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise DsmtError(f"--set {item!r}: expected section.key=value, e.g. --set parallel.tp=4")
        node = result
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise DsmtError(f"--set {item!r}: {part!r} holds a value, not a section")
            node = child
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
    return result


def validate_spec(raw: dict[str, Any], *, source: str) -> JobSpec:
    try:
        return JobSpec.model_validate(raw)
    except pydantic.ValidationError as err:
        problems = tuple(_problem_from(error) for error in err.errors())
        raise SpecError(Report(source=source, problems=problems)) from None


def _problem_from(error: dict) -> Problem:
    loc = tuple(str(part) for part in error["loc"])
    dotted = ".".join(loc) or "(top level)"
    kind = error["type"]
    if kind == "extra_forbidden":
        valid = _field_names(loc[:-1])
        near = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        hint = f"did you mean {'.'.join((*loc[:-1], near[0]))!r}? " if near else ""
        return Problem("error", "unknown_key", f"unknown key {dotted!r}", f"{hint}valid keys here: {', '.join(valid)}")
    if kind == "missing":
        return Problem("error", "missing_key", f"{dotted} is required", "")
    if kind in SCHEMA_RULES:  # raised by a section's own validator
        return Problem("error", kind, f"{dotted}: {error['msg']}", "")
    return Problem("error", "bad_value", f"{dotted}={error.get('input')!r}: {error['msg']}", "")


def _field_names(loc: tuple[str, ...]) -> list[str]:
    model: type[pydantic.BaseModel] = JobSpec
    for part in loc:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def model_shape(model: ModelSpec) -> ModelShape:
    """The shape of the spec's model; raises ModelShapeError naming the cause."""
    if model.config is not None:
        return shape_from_config(model.config, name="inline config")
    if model.builtin in BUILTIN_SHAPES:  # said to be the built-in shape: no folder of that name is consulted
        return BUILTIN_SHAPES[model.builtin]
    return load_model_shape(model.builtin if model.builtin is not None else model.path)


def shape_problem(err: ModelShapeError) -> Problem:
    return Problem("error", "model_shape", str(err), "point model.path at an HF checkpoint folder (config.json "
                   "beside the weights, as save_pretrained writes it), or use model.builtin or model.config")


def absolutize_paths(spec: JobSpec, *, base_dir: Path) -> JobSpec:
    """The spec with every relative path (defaults included: output_dir) made absolute against `base_dir`, for a
    copy written elsewhere (a run directory, the spec `toolkit.api.train` hands its ranks)."""
    from toolkit.spec.paths import pin_spec_paths

    raw = pin_spec_paths(spec.model_dump(mode="json"), base_dir=base_dir, source="job spec")
    return validate_spec(raw, source="job spec")


def dump_spec(spec: JobSpec) -> str:
    """The spec as YAML with every default written out (what the run directory's job.resolved.yaml holds)."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
