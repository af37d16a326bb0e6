"""The CPU backend: what it redirects when CUDA is absent, and that it touches nothing when CUDA is present."""

import pytest
import torch

from toolkit import backend as backends
from toolkit.backend import cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend is only active without CUDA")


def test_megatron_forward_runs_and_the_redirected_sites_are_listed(tmp_path):
    from megatron.core import parallel_state

    from toolkit.adapters.build import build_model_chunks
    from toolkit.adapters.hf_config import model_settings
    from toolkit.launch.local import single_process_group
    from toolkit.parallel.groups import Layout
    from toolkit.models.tiny import tiny_config

    backend = backends.current()
    assert (backend.name, backend.dist_backend, backend.use_transformer_engine) == ("cpu", "gloo", False)
    assert cpu.is_installed()
    cpu.redirected_sites.clear()
    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(1, 1)
        backend.seed(0)
        (model,) = build_model_chunks(settings=model_settings(tiny_config("llama")), layout=Layout(), init_weights=True)
        tokens = torch.randint(0, 250, (1, 16))
        logits = model(tokens, torch.arange(16).unsqueeze(0), None)
    assert logits.shape == (1, 16, 256) and logits.device.type == "cpu" and torch.isfinite(logits[..., :250]).all()
    assert torch.isneginf(logits[..., 250:]).all()  # the padded vocabulary (toolkit/adapters/vocab_mask.py)
    sites = {site for site in cpu.redirected_sites}
    print("redirected:", sorted(sites))
    # The CUDA assumptions a megatron-core forward hits (0.16.1 line numbers move; match files and APIs).
    expected = {
        ("torch.ones", "megatron/core/transformer/utils.py"),  # causal mask, device="cuda"
        ("Tensor.to", "megatron/core/models/common/embeddings/rotary_pos_embedding.py"),  # inv_freq to GPU
        ("torch.empty", "megatron/core/utils.py"),  # GlobalMemoryBuffer for attention
    }
    seen = {(api, path.rsplit(":", 1)[0]) for api, path in sites}
    assert expected <= seen, seen


def test_install_changes_nothing_when_cuda_is_present(monkeypatch):
    cpu.uninstall()
    originals = (torch.empty, torch.zeros, torch.Tensor.to, torch.cuda.current_device, torch.cuda.synchronize)
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert cpu.install() is False
        assert (torch.empty, torch.zeros, torch.Tensor.to, torch.cuda.current_device, torch.cuda.synchronize) == originals
        assert not cpu.is_installed()
    finally:
        monkeypatch.undo()
        assert cpu.install() is True  # restore for the rest of the session
    assert torch.empty is not originals[0]
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device="cpu").device.type == "cpu"


def test_cuda_requests_become_cpu_and_others_pass_through():
    backends.current()
    assert torch.empty(3, device=0).device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.ones(2).to(torch.float64).dtype == torch.float64  # non-device arguments untouched
    assert torch.ones(2).cuda().device.type == "cpu"
    torch.cuda.synchronize()
    torch.cuda.current_stream().wait_stream(None)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_activation_recompute_runs_on_cpu_and_matches(recompute):
    """megatron's recompute saves/restores the CUDA RNG state; the backend points it at the CPU generator."""
    from megatron.core import parallel_state

    from toolkit.adapters.build import build_model_chunks
    from toolkit.adapters.hf_config import model_settings
    from toolkit.launch.local import single_process_group
    from toolkit.parallel.groups import Layout
    from toolkit.models.tiny import tiny_config

    backend = backends.current()
    settings = model_settings(tiny_config("llama"))
    tokens, positions = torch.randint(0, 250, (2, 16)), torch.arange(16).unsqueeze(0)
    grads = {}
    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(1, 1)
        for mode in ("none", recompute):
            backend.seed(0)
            cpu.redirected_sites.clear()
            (model,) = build_model_chunks(settings=settings, layout=Layout(), init_weights=True, recompute=mode)
            model(tokens, positions, None)[..., :250].float().pow(2).mean().backward()  # 250: the real vocab
            grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
            apis = {api for api, _ in cpu.redirected_sites}
            assert ("megatron _get_cuda_rng_state" in apis) == (mode != "none"), apis
    assert torch.allclose(grads["none"], grads[recompute], atol=1e-6)


def test_reapply_puts_back_what_a_zero_init_restored():
    """DeepSpeed's zero.Init restores at exit the torch factories DeepSpeed saw at its import: torch's own, where it
    was imported before the CPU backend (a test session, a user's script). `reapply` (called after every zero.Init
    of toolkit/adapters/zero3.py) puts the redirections back; nothing else changes."""
    assert cpu.install() is True
    ours, raw = torch.empty, cpu._originals["torch:empty"]
    torch.empty = raw  # what zero.Init's exit leaves behind
    try:
        assert cpu.reapply() == ["torch:empty"]
        assert torch.empty is ours and torch.empty(2, device=0).device.type == "cpu"
        assert cpu.reapply() == []
    finally:
        torch.empty = ours
