"""A script launched on another process count than its spec's cluster (toolkit/spec/launched.py): the launch wins,
rank 0 says so in one line naming the spec's fields, and the checks run on the launched cluster."""

from __future__ import annotations

from toolkit import api
from toolkit.spec.launched import fit_to_launch, launched_world

SPEC = {"model": {"builtin": "tiny-llama"}, "data": {"synthetic": True},
        "cluster": {"gpus_per_node": 2, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
        "parallel": {"pp": 2},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 32, "precision": "fp32"}}


def test_the_launchers_variables():
    assert launched_world({}) is None
    assert launched_world({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}) == (4, 4)  # torchrun
    assert launched_world({"WORLD_SIZE": "16", "LOCAL_SIZE": "8"}) == (16, 8)  # the deepspeed launcher
    assert launched_world({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == (8, 4)  # mpirun
    assert launched_world({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}) == (6, 6)  # uneven nodes: one group
    assert launched_world({"SLURM_NTASKS": "8"}) is None  # an allocation is no launch


def test_torchrun_with_four_processes_and_a_spec_of_two():
    """What a user did: `torchrun --nproc_per_node 4 examples/own_loop.py --set parallel.pp=2` (spec: 1 x 2)."""
    spec = api.job_spec(SPEC)
    fitted, line = fit_to_launch(spec, environ={"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "RANK": "0"})
    assert (fitted.cluster.nodes, fitted.cluster.gpus_per_node) == (1, 4)
    assert "started 4 processes" in line and "cluster.gpus_per_node" in line and "1 x 2 = 2" in line
    assert "\n" not in line
    assert api.check(fitted).ok, api.check(fitted).to_text()  # dp 2 x pp 2: the batch still divides
    same, nothing = fit_to_launch(spec, environ={"WORLD_SIZE": "2"})
    assert same is spec and nothing is None
