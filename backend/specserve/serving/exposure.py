"""What a server exposes and to whom: the address its endpoints bind, the admin key that Triton's
restricted APIs (model load/unload, shared memory, trace, logging) require, and whether its ports
are free. This module checks and describes; it starts nothing and authenticates no inference.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace

ALL_INTERFACES = "0.0.0.0"  # Triton's default address
ADMIN_KEY_ENV = "SPECSERVE_ADMIN_KEY"
ADMIN_HEADER = "specserve-admin-key"  # HTTP header of the admin key
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"  # gRPC metadata key (Triton adds the prefix)
# Triton's API groups that need the key; health, metadata, model-config, statistics, inference stay open
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
_KEY_CHARS = re.compile(r"[A-Za-z0-9._~+/-]{16,}")


def check_admin_key(key: str) -> str:
    """`key` if it can be the admin key: 16 or more characters of `A-Z a-z 0-9 . _ ~ + / -`."""
    if not _KEY_CHARS.fullmatch(key):
        raise ValueError("the admin key needs 16 or more characters, each a letter, a digit or . _ ~ + / -")
    return key


def check_host(host: str) -> str:
    """`host` if it is an IPv4 address the endpoints can bind (0.0.0.0: every interface)."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        raise ValueError(f"--host takes an IPv4 address such as 127.0.0.1 or 0.0.0.0, got {host!r}") from None


def port_problems(host: str, ports: Mapping[str, int]) -> list[str]:
    """Why each of `ports` ({"HTTP": 8000, ...}) cannot be bound on `host` now; [] when all can."""
    problems = []
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port in seen:
            problems.append(f"the {name} port {port} is also the {seen[port]} port")
            continue
        seen[port] = name
        if (error := _bind_error(host, port)) is not None:
            problems.append(f"the {name} port {port} on {host} is not free ({error})")
    return problems


def _bind_error(host: str, port: int) -> str | None:
    """The error binding host:port gives, or None. SO_REUSEADDR as servers set it: a port whose
    connections linger in TIME_WAIT counts as free, one another socket listens on does not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def client_host(host: str) -> str:
    """The address a client on this machine reaches endpoints bound to `host` at."""
    return "localhost" if host == ALL_INTERFACES else host


@dataclass(frozen=True)
class Exposure:
    """Where `specserve serve` listens and who may use its admin APIs."""

    host: str = ALL_INTERFACES
    admin_key: str | None = None  # None: a random one, printed once the server is ready
    open_admin_api: bool = False

    def check(self) -> Exposure:
        """This exposure with its host normalized; ValueError naming what is wrong."""
        if self.open_admin_api and self.admin_key is not None:
            raise ValueError(f"--open-admin-api and an admin key (--admin-key, {ADMIN_KEY_ENV}) exclude "
                             "each other")
        if self.admin_key is not None:
            check_admin_key(self.admin_key)
        return replace(self, host=check_host(self.host))
