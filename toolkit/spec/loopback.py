"""The loopback rule for multi-node host lists: a pure function of the hosts and a resolver.

Distinct loopback addresses as nodes (127.0.0.1 and 127.0.0.2, or names that resolve to them through /etc/hosts)
are a deliberate simulation of several nodes on one machine: a warning. A loopback host next to real ones, or
two hosts on the same loopback address (`localhost` twice), is an error: the ranks would not reach each other.
A name that does not resolve here is not a loopback: on a head node the cluster's names often resolve elsewhere.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Callable, Sequence

from toolkit.errors import Problem

Resolver = Callable[[Sequence[str]], dict[str, str | None]]
RESOLVE_TIMEOUT_S = 2.0  # for all names together: a slow DNS must not hold up `dsmt check`
_LOCALHOST = {"localhost": "127.0.0.1", "localhost.localdomain": "127.0.0.1", "ip6-localhost": "::1"}


def resolve_addresses(names: Sequence[str], *, timeout_s: float = RESOLVE_TIMEOUT_S) -> dict[str, str | None]:
    """name -> its first address, or None when it does not resolve within `timeout_s` (all names in parallel)."""
    found: dict[str, str | None] = {}

    def lookup(name: str) -> None:
        try:
            found[name] = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
        except (OSError, UnicodeError):
            found[name] = None

    threads = [threading.Thread(target=lookup, args=(name,), daemon=True) for name in dict.fromkeys(names)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return {name: found.get(name) for name in names}


def loopback_address(host: str, *, resolved: dict[str, str | None]) -> str | None:
    """The loopback address `host` stands for, or None (not loopback, or unresolved)."""
    address = _LOCALHOST.get(host.lower(), None)
    if address is None:
        try:
            address = str(ipaddress.ip_address(host))
        except ValueError:
            address = resolved.get(host)
    if address is None:
        return None
    try:
        return address if ipaddress.ip_address(address).is_loopback else None
    except ValueError:
        return None


def _needs_lookup(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return False
    except ValueError:
        return host.lower() not in _LOCALHOST


def loopback_problems(*, nodes: int, hosts: list[str] | None, master_addr: str | None,
                      resolve: Resolver = resolve_addresses) -> list[Problem]:
    """Problems of rule `loopback_multi_node` for a spec with `nodes` nodes listed in `hosts`."""
    if nodes <= 1:
        return []
    hosts = hosts or []
    lookups = [h for h in hosts + ([master_addr] if master_addr else []) if _needs_lookup(h)]
    resolved = resolve(lookups) if lookups else {}
    addresses = [loopback_address(host, resolved=resolved) for host in hosts]  # a list: a host may repeat
    looped = [host for host, address in zip(hosts, addresses) if address is not None]
    simulation = bool(looped) and len(looped) == len(hosts) and len(set(addresses)) == len(hosts)
    pairs = ", ".join(f"{host}->{address}" for host, address in zip(hosts, addresses) if address is not None)
    if looped and len(looped) < len(hosts):
        real = [host for host, address in zip(hosts, addresses) if address is None]
        return [Problem("error", "loopback_multi_node",
                        f"nodes={nodes}: hosts {looped} are loopback ({pairs}) "
                        f"but {real} are not: the other nodes cannot reach a loopback address",
                        "list each node's reachable host name (or only distinct 127.x addresses to simulate "
                        "nodes on one machine)")]
    if looped and not simulation:
        return [Problem("error", "loopback_multi_node",
                        f"nodes={nodes} but hosts resolve to the same loopback address ({pairs}): one machine, "
                        "not several nodes", "list each node's reachable host name, or to simulate nodes on one "
                        "machine use distinct loopback addresses (127.0.0.1, 127.0.0.2, or /etc/hosts names)")]
    if simulation:
        return [Problem("warning", "loopback_multi_node",
                        f"nodes={nodes} on distinct loopback addresses ({pairs}): a simulation of {nodes} nodes on "
                        "this machine", "fine for a test; list the real nodes' names for a cluster run")]
    if master_addr is not None and loopback_address(master_addr, resolved=resolved) is not None:
        return [Problem("error", "loopback_multi_node", f"master_addr={master_addr} with nodes={nodes}",
                        "use the first node's reachable address, or leave master_addr unset")]
    return []
