"""Rule loopback_multi_node: distinct loopback nodes simulate a cluster (warning); shared or mixed: an error."""

import time

import pytest

from spec_helpers import tiny_spec
from toolkit.check.checks import run_checks
from toolkit.spec.load import validate_spec
from toolkit.spec.loopback import loopback_problems, resolve_addresses

# what /etc/hosts would say on a machine simulating nodes; "gpu-b" does not resolve (a cluster name on a head node)
FAKE_HOSTS = {"node-a": "127.0.0.1", "node-b": "127.0.0.2", "node-a2": "127.0.0.1", "gpu-a": "10.0.0.5", "gpu-b": None}


def fake_resolve(names):
    return {name: FAKE_HOSTS.get(name) for name in names}


def _problems(hosts, master_addr=None):
    return loopback_problems(nodes=len(hosts), hosts=hosts, master_addr=master_addr, resolve=fake_resolve)


@pytest.mark.parametrize("hosts", [["127.0.0.1", "127.0.0.2"], ["node-a", "node-b"], ["node-a", "127.0.0.2"]])
def test_distinct_loopback_addresses_are_a_simulation_warning(hosts):
    [problem] = _problems(hosts)
    assert (problem.severity, problem.rule) == ("warning", "loopback_multi_node")
    assert "127.0.0.1" in problem.message and "127.0.0.2" in problem.message and "simulation" in problem.message


@pytest.mark.parametrize("hosts", [["localhost", "gpu-a"], ["127.0.0.1", "gpu-b"], ["node-a", "gpu-a", "node-b"]])
def test_loopback_mixed_with_real_hosts_is_an_error(hosts):
    [problem] = _problems(hosts)
    assert (problem.severity, problem.rule) == ("error", "loopback_multi_node")
    assert "gpu-" in problem.message and "cannot reach a loopback address" in problem.message


@pytest.mark.parametrize("hosts", [["localhost", "localhost"], ["node-a", "node-a2"], ["localhost", "127.0.0.1"],
                                   ["node-a", "node-b", "node-a2"]])
def test_hosts_on_the_same_loopback_address_are_an_error(hosts):
    [problem] = _problems(hosts)
    assert (problem.severity, problem.rule) == ("error", "loopback_multi_node")
    assert "same loopback address" in problem.message and "distinct loopback addresses" in problem.fix


def test_real_or_unresolved_hosts_pass_and_loopback_master_addr_is_an_error():
    assert _problems(["gpu-a", "gpu-b"]) == []
    [problem] = _problems(["gpu-a", "gpu-b"], master_addr="127.0.0.1")
    assert problem.severity == "error" and "master_addr=127.0.0.1" in problem.message
    assert _problems(["127.0.0.1", "127.0.0.2"], master_addr="127.0.0.1")[0].severity == "warning"
    assert loopback_problems(nodes=1, hosts=["localhost"], master_addr=None, resolve=fake_resolve) == []


def test_resolution_is_bounded_and_tolerates_unknown_names():
    start = time.monotonic()
    found = resolve_addresses(["localhost", "dsmt-no-such-host.invalid"], timeout_s=3.0)
    assert time.monotonic() - start < 4.0
    assert found["dsmt-no-such-host.invalid"] is None and found["localhost"] in ("127.0.0.1", "::1")


@pytest.mark.parametrize("hosts, severity", [(["127.0.0.1", "127.0.0.2"], "warning"),
                                             (["localhost", "127.0.0.1"], "error"),
                                             (["127.0.0.1", "dsmt-no-such-host.invalid"], "error")])
def test_dsmt_check_applies_the_rule_with_the_real_resolver(hosts, severity):
    spec = validate_spec(tiny_spec(cluster={"nodes": 2, "hosts": hosts}), source="loopback")
    found = [p for p in run_checks(spec=spec).problems if p.rule == "loopback_multi_node"]
    assert [p.severity for p in found] == [severity]
