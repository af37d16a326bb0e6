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

from toolkit.errors import DsmtError, Problem, Report, SpecError
from toolkit.adapters.model_shape import load_model_shape, shape_from_config
from toolkit.models.shapes import BUILTIN_SHAPES, ModelShape, ModelShapeError
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


SPEC_MAX_BYTES = 1 << 20  # 1 MiB; the specs in configs/ are under 2 KB: a larger file is not a job spec


class _AliasRefused(Exception):
    def __init__(self, alias: str, line: int):
        super().__init__(alias)
        self.alias, self.line = alias, line


class _NoAliasLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses aliases. `*a` stands for the whole value anchored `&a`; aliases nested a few
    levels deep ("billion laughs": a 1 KB file) stand for billions of values, and validating or printing them took
    minutes and gigabytes. A job spec has no use for them."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasRefused(event.anchor, event.start_mark.line + 1)
        return super().compose_node(parent, index)


def parse_spec_yaml(text: str | bytes, *, source: str) -> Any:
    """The plain data of a YAML (or JSON) text, read without aliases; raises DsmtError naming `source`."""
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # JSON is YAML
    except _AliasRefused as err:
        raise DsmtError(f"[yaml_alias] {source} line {err.line}: alias *{err.alias} repeats the value anchored "
                        f"&{err.alias}; dsmt reads job specs without YAML aliases (nested ones expand a small file "
                        f"into billions of values)\nfix: write the values out where *{err.alias} stands") from None
    except yaml.YAMLError as err:
        raise DsmtError(f"{source} is not valid YAML/JSON: {err}") from err
    except RecursionError:  # PyYAML composes nested collections recursively
        raise DsmtError(f"[spec_too_deep] {source} nests lists or mappings hundreds of levels deep\nfix: a job spec "
                        "has sections of settings, a few levels deep: write it as configs/tiny-cpu.yaml does") from None


def read_spec_file(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            data = file.read(SPEC_MAX_BYTES + 1)  # never more: a huge or endless file (/dev/zero) is refused
    except OSError as err:
        raise DsmtError(f"cannot read job spec {path}: {err.strerror}") from err
    if len(data) > SPEC_MAX_BYTES:
        raise DsmtError(f"[spec_too_large] job spec {path} is larger than {SPEC_MAX_BYTES:,} bytes (1 MiB, the "
                        "most dsmt reads of a spec)\nfix: a spec holds settings: put data in files it names "
                        "(data.path), and check that you passed the spec you meant")
    raw = parse_spec_yaml(data, source=str(path))
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
        node[parts[-1]] = parse_spec_yaml(text, source=f"--set {item!r}") if text.strip() else None
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
    return Problem("error", "bad_value", f"{dotted}={_shown(error.get('input'))}: {error['msg']}", "")


def _shown(value: Any, *, max_chars: int = 200) -> str:
    """`repr(value)`, cut: a wrong value may be a whole list of data, and the report line names it, not prints it."""
    text = repr(value)
    return text if len(text) <= max_chars else f"{text[:max_chars]}... ({len(text):,} characters)"


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
    return yaml.dump(spec.model_dump(mode="json"), Dumper=_NoAliasDumper, sort_keys=False)


class _NoAliasDumper(yaml.SafeDumper):
    """Writes a value met twice out twice: the spec files dsmt writes are read back without aliases."""

    def ignore_aliases(self, data) -> bool:
        return True
