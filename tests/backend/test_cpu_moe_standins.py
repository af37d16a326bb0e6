"""The CPU backend's stand-ins for megatron-core's MoE layers (toolkit/backend/cpu_moe.py), each against what it
replaces; the uneven all_gather on 2 gloo ranks. This file is also the per-rank worker:
`torchrun --nproc_per_node=2 test_cpu_moe_standins.py OUT`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from toolkit.backend import cpu_moe


def test_stream_stand_in_is_a_class_whose_events_are_done():
    class Null:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    stream_class = cpu_moe.stream_class(Null)
    assert isinstance(stream_class, type)  # transformers evaluates `torch.cuda.Stream | None`
    stream_class | None  # noqa: B018  (would raise TypeError for a function)
    event = stream_class(priority=-1).record_event()
    assert event.synchronize() is None and event.query() is True


def test_split_sizes_become_numpy_as_on_cuda():
    move = cpu_moe.wrap_split_sizes(lambda tensor, as_numpy=False, record_stream=False: "original")
    sizes = move(torch.tensor([3, 1]), as_numpy=True)
    assert sizes.tolist() == [3, 1] and type(sizes).__module__ == "numpy"
    assert move(torch.tensor([3, 1])) == "original"  # not asked for numpy: megatron's own function


def test_new_empty_on_the_cuda_device_lands_on_the_cpu():
    from toolkit.backend import cpu

    cpu.redirected_sites.clear()
    new_empty = cpu._wrap_factory(torch.Tensor.new_empty, "Tensor.new_empty")  # what install() puts in place
    out = new_empty(torch.zeros(2), (3, 4), dtype=torch.float64, device=0)
    assert out.shape == (3, 4) and out.dtype == torch.float64 and out.device.type == "cpu"
    assert [api for api, _ in cpu.redirected_sites] == ["Tensor.new_empty"]


def worker(out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gather = cpu_moe.wrap_uneven_all_gather(dist.all_gather)
    rows = [3, 5]  # each rank's own count: gloo alone refuses lists of different sizes
    mine = torch.full((rows[rank], 2), float(rank + 1))
    parts = [torch.empty(n, 2) for n in rows]
    gather(parts, mine)
    even = [torch.empty(2, 2) for _ in rows]
    gather(even, torch.full((2, 2), float(rank)))  # equal sizes: gloo's own all_gather
    checks = {"uneven": all(torch.equal(parts[r], torch.full((rows[r], 2), float(r + 1))) for r in range(2)),
              "even": all(torch.equal(even[r], torch.full((2, 2), float(r))) for r in range(2))}
    try:
        dist.all_gather([torch.empty(n, 2) for n in rows], mine)
        checks["gloo_refuses_uneven"] = False
    except RuntimeError:
        checks["gloo_refuses_uneven"] = True  # the premise: without the stand-in the dispatcher fails here
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(checks))
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_uneven_all_gather_on_gloo(tmp_path):
    from ranks import run_on_ranks

    run_on_ranks(__file__, tmp_path, nprocs=2, timeout=120)
    for rank in range(2):
        checks = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert all(checks.values()), checks


if __name__ == "__main__":
    worker(sys.argv[1])
