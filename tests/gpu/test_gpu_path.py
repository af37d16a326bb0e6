"""The default path on a real cluster: CUDA + NCCL (+ Transformer Engine when installed). Skipped without CUDA."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_backend_is_cuda_nccl_and_installs_no_cpu_redirection():
    from toolkit import backend as backends
    from toolkit.backend import cpu

    backend = backends.current()
    assert (backend.name, backend.dist_backend, backend.batch_p2p_comm) == ("cuda", "nccl", True)
    assert not cpu.is_installed()


def test_verify_tp1_on_cuda(tmp_path):
    from toolkit.tiny import make_tiny_checkpoint
    from toolkit.verify.run import run_verify

    result = run_verify(checkpoint=make_tiny_checkpoint(tmp_path / "hf"), tp=1, pp=1)
    assert result["passed"], result
