"""The collectives megatron-core's sequence parallelism calls, on gloo under the CPU backend (2 ranks).

megatron binds `torch.distributed.reduce_scatter_tensor` / `all_gather_into_tensor` to module attributes
(`dist_reduce_scatter_func` / `dist_all_gather_func` in tensor_parallel/mappings.py and layers.py) at import, and
calls them with and without `async_op`. gloo implements both since torch 2.3 (reduce-scatter as an all-reduce then
a slice), so the CPU backend redirects none of them; it only redirects the `torch.cuda.current_device()` buffers
around them. This launch checks that premise against a reference (all_reduce then slice; all_gather then cat) for
every bound function, sync and async, fp32 and bf16, and megatron's sequence-parallel autograd mappings forward and
backward. This file is also the per-rank worker: `torchrun --nproc_per_node=2 test_cpu_sp_collectives.py OUT`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

SHAPE = (4, 3, 5)  # [sequence, batch, hidden]: megatron splits and gathers along the first dimension


def reference_reduce_scatter(x: torch.Tensor, *, group) -> torch.Tensor:
    import torch.distributed as dist

    total = x.clone()
    dist.all_reduce(total, group=group)
    return total.chunk(dist.get_world_size(group))[dist.get_rank(group)]


def reference_all_gather(x: torch.Tensor, *, group) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts)


def bound_function_checks(*, group, rank: int) -> dict[str, bool]:
    """megatron's bound collectives against the references: equal to the last bit."""
    from megatron.core.tensor_parallel import layers, mappings

    results = {}
    for module in (mappings, layers):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(rank)).to(dtype)
            for async_op in (False, True):
                key = f"{module.__name__.rsplit('.', 1)[1]}-{dtype}-{'async' if async_op else 'sync'}"
                scattered = torch.empty((SHAPE[0] // 2, *SHAPE[1:]), dtype=dtype)
                work = module.dist_reduce_scatter_func(scattered, x, group=group, async_op=async_op)
                if async_op:
                    work.wait()
                results[f"reduce_scatter-{key}"] = torch.equal(scattered, reference_reduce_scatter(x, group=group))
                gathered = torch.empty((SHAPE[0] * 2, *SHAPE[1:]), dtype=dtype)
                work = module.dist_all_gather_func(gathered, x, group=group, async_op=async_op)
                if async_op:
                    work.wait()
                results[f"all_gather-{key}"] = torch.equal(gathered, reference_all_gather(x, group=group))
    return results


def autograd_mapping_checks(*, group, rank: int) -> dict[str, bool]:
    """megatron's sequence-parallel regions, forward and backward (their buffers come from the CPU backend)."""
    from megatron.core.tensor_parallel import mappings

    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)
    upstream = torch.randn((SHAPE[0] // 2, *SHAPE[1:]), generator=torch.Generator().manual_seed(20 + rank))
    out = mappings.reduce_scatter_to_sequence_parallel_region(x)
    out.backward(upstream)
    results = {"reduce_scatter_region-forward": torch.equal(out, reference_reduce_scatter(x.detach(), group=group)),
               "reduce_scatter_region-backward": torch.equal(x.grad, reference_all_gather(upstream, group=group))}
    y = torch.randn((SHAPE[0] // 2, *SHAPE[1:]), generator=torch.Generator().manual_seed(30 + rank),
                    requires_grad=True)
    upstream = torch.randn(SHAPE, generator=torch.Generator().manual_seed(40 + rank))
    out = mappings.gather_from_sequence_parallel_region(y, tensor_parallel_output_grad=True)
    out.backward(upstream)
    results["gather_region-forward"] = torch.equal(out, reference_all_gather(y.detach(), group=group))
    results["gather_region-backward"] = torch.equal(y.grad, reference_reduce_scatter(upstream, group=group))
    return results


def worker(out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.backend import cpu

    backends.current()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    group, rank = parallel_state.get_tensor_model_parallel_group(), dist.get_rank()
    cpu.redirected_sites.clear()
    results = {**bound_function_checks(group=group, rank=rank), **autograd_mapping_checks(group=group, rank=rank)}
    report = {"checks": results, "sites": sorted({f"{api} {site.rsplit(':', 1)[0]}" for api, site in
                                                  cpu.redirected_sites})}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend is only active without CUDA")
def test_sequence_parallel_collectives_on_gloo_equal_the_reference(tmp_path):
    from ranks import run_on_ranks

    run_on_ranks(__file__, tmp_path, nprocs=2, timeout=300)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        failed = [name for name, ok in report["checks"].items() if not ok]
        assert not failed, failed
        assert len(report["checks"]) == 2 * 2 * 2 * 2 + 4  # (rs, ag) x (mappings, layers) x dtypes x sync/async
        # The buffers megatron allocates around them on `torch.cuda.current_device()` are the backend's part.
        assert "torch.cuda.current_device megatron/core/tensor_parallel/mappings.py" in report["sites"], report


if __name__ == "__main__":
    worker(sys.argv[1])
