"""The simulated 3-node Ray cluster of this directory's tests and of bench/node_loss.py and
bench/autoscale.py (ray.cluster_utils.Cluster, one host): a head with no CPU to offer (Serve's
controller, the one proxy of `proxy_location: HeadOnly`) and two worker nodes with one CPU
each."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from workers.distributed import get_free_port


class Sim:
    """The simulated cluster and the app's URL."""

    def __init__(self, cluster: Any, url: str) -> None:
        self.cluster = cluster
        self.url = url


@contextlib.contextmanager
def simulated_cluster() -> Iterator[Sim]:
    """The head with no CPU (Serve's controller, the HeadOnly proxy) and two 1-CPU worker
    nodes, Serve started on a free port; all stopped on exit (bench/node_loss.py and
    bench/autoscale.py run on it too)."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        port = get_free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        yield Sim(cluster, f"http://127.0.0.1:{port}")
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
