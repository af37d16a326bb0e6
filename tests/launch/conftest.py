import pytest

from sshd_nodes import sshd_nodes


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Two sshd "nodes" (sshd_nodes.py) for a test module: started at its first use, stopped after its last test."""
    with sshd_nodes(tmp_path_factory.mktemp("sshd") / "ssh") as running:
        yield running
