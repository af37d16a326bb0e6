"""Model folders that would need their own Python code: refused by name before transformers reads them.

transformers runs a folder's files (configuration_*.py, modeling_*.py, tokenization_*.py) when one of its configs
names them in `auto_map` and names no class transformers ships; without `trust_remote_code` it asks on stdin, and
a `y` (or a piped `yes`) ran them. dsmt passes trust_remote_code=False on every load, and this check names such a
folder first, in every command that reads one (check, plan, generate, train, convert, verify).

An `auto_map` beside a class transformers ships is not refused: transformers then uses its own class and runs
nothing (Phi-3 and DeepSeek-V3 as published keep an auto_map from before transformers shipped them).
"""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.errors import RuleError

# (file, the keys naming the class it makes): the configs transformers' Auto classes read an auto_map from.
CODE_CONFIGS = (
    ("config.json", ("model_type",)),
    ("tokenizer_config.json", ("tokenizer_class",)),
    ("preprocessor_config.json", ("image_processor_type", "feature_extractor_type", "processor_class")),
    ("processor_config.json", ("processor_class",)),
)


class RemoteCodeRefused(RuleError):
    """A model folder whose configs would make transformers import Python files from it (rule
    `remote_code_refused`)."""

    def __init__(self, message: str, *, fix: str):
        super().__init__(message, rule="remote_code_refused", fix=fix)


def refuse_remote_code(model_dir: str | Path, *, only: tuple[str, ...] | None = None) -> None:
    """Raise RemoteCodeRefused when a config of `model_dir` has an `auto_map` and names no class transformers ships.
    `only`: the config files the caller's load reads (the model's config.json for a model: a folder's custom
    tokenizer is refused where a tokenizer is loaded from it, not when only its weights are read). Unreadable or
    absent configs pass: the loaders name those."""
    model_dir = Path(model_dir)
    for file_name, class_keys in CODE_CONFIGS:
        if only is not None and file_name not in only:
            continue
        config = _json_dict(model_dir / file_name)
        auto_map = config.get("auto_map")
        if not auto_map:
            continue
        names = {key: config[key] for key in class_keys if isinstance(config.get(key), str)}
        if any(_shipped(key, name) for key, name in names.items()):
            continue
        import transformers

        version = f"transformers {transformers.__version__}"
        named = ", ".join(f"{key} {name!r}" for key, name in names.items())
        said = f"{named}, which {version} does not ship" if named else f"no {' / '.join(class_keys)} ({version})"
        raise RemoteCodeRefused(
            f"{model_dir / file_name} has auto_map ({', '.join(_code_files(auto_map))}) and {said}: dsmt never "
            "runs code from a model folder",
            fix="use a checkpoint whose architecture transformers ships (config.json model_type such as llama, "
                "qwen2, mistral, gemma, phi3; tokenizer_class such as PreTrainedTokenizerFast), e.g. the model's "
                "release converted to transformers' own classes")


def _json_dict(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _shipped(key: str, name: str) -> bool:
    """Whether transformers has the class `name` (for `model_type`: a config class registered under it)."""
    import transformers

    if key == "model_type":
        return name in transformers.CONFIG_MAPPING
    # tokenizer_config.json may say "LlamaTokenizerFast" where transformers 5 has LlamaTokenizer, or the reverse
    return any(getattr(transformers, candidate, None) is not None
               for candidate in (name, name.removesuffix("Fast"), f"{name}Fast"))


def _code_files(auto_map) -> list[str]:
    """The files an auto_map points at: "configuration_x.XConfig" -> configuration_x.py, "org/repo--mod.Cls" ->
    "org/repo: mod.py"; one entry per file."""
    refs = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    flat = [ref for value in refs for ref in (value if isinstance(value, (list, tuple)) else [value])
            if isinstance(ref, str)]
    files = []
    for ref in flat:
        repo, _, module_ref = ref.rpartition("--")
        module = module_ref.rpartition(".")[0]
        file = f"{module}.py" if module else module_ref  # no module: a repository's name ("Xenova/gpt-4o")
        files.append(f"{repo}: {file}" if repo else file)
    return sorted(set(files)) or [str(auto_map)]
