"""Free ports for the test clusters' fixed Serve ports (HAProxy's stats page and exporter, the
fallback proxy), picked below Linux's ephemeral range.

A port the kernel hands out for `bind(0)` is an ephemeral one (32768 and up by default), which
any outgoing connection of the session may take between the pick and the bind: a run where a Ray
connection had taken one failed every HAProxy start after it ("cannot bind socket"; stop 56 in
tests/cluster/conftest.py's session ports, stop 57 in a simulated cluster's). These come from
20000-29999, clear of Ray's worker ports (10002-19999) and Serve's direct-ingress HTTP ports
(30000-31000), and none is given out twice by one process.
"""

from __future__ import annotations

import random
import socket

PORTS = range(20000, 30000)

_picked: set[int] = set()


def free_port() -> int:
    """A port free now on 127.0.0.1, from PORTS, not given out before in this process."""
    for port in random.sample(PORTS, 200):
        if port in _picked:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _picked.add(port)
        return port
    raise RuntimeError(f"no free port in {PORTS} for the test cluster's Serve ports")
