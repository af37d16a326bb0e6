"""The `write_spec` fixture: write a raw spec dict as YAML and return its path."""

import pytest
import yaml


@pytest.fixture
def write_spec(tmp_path):
    def write(raw: dict, *, name: str = "job.yaml") -> str:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw))
        return str(path)
    return write
