import os

# One BLAS thread per process: tests start several ranks on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed JIT-builds ops into a cache keyed by op name only and shared between venvs: keep ours apart.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(__import__("pathlib").Path(__file__).parents[1] / ".torch_extensions"))
