"""A Ray cluster of several nodes on this machine: a head and worker nodes, each its own raylet (Ray's own cluster
utilities, ray.cluster_utils), all on 127.0.0.1. It is what `kvrag bench cluster --nodes` and tests/test_ray_serve.py
serve on: replicas spread over nodes, and a node that can be killed (its raylet and every worker on it, as a machine
lost) while the head, where Serve's proxy and kvrag's front run, goes on.

    with LoopbackCluster(nodes=2, cpus=2) as cluster:        # the head and one worker node, 2 CPUs each
        ClusterServer(..., ClusterSettings(address=cluster.address, replicas=4, ...))
        cluster.kill(1)                                      # the worker node, at once (no graceful exit)
"""

from __future__ import annotations

from contextlib import suppress

OBJECT_STORE = 128 << 20  # each node's shared-memory object store: kvrag passes only requests and responses through it


class LoopbackCluster:
    def __init__(self, nodes: int = 2, cpus: float = 2.0):
        if nodes < 1:
            raise ValueError(f"a cluster has at least one node, got {nodes}")
        self.n_nodes, self.cpus = nodes, cpus
        self.cluster = None
        self.nodes: list = []  # ray._private.node.Node, the head first

    def __enter__(self) -> LoopbackCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return self.cluster.address

    def start(self) -> None:
        from ray.cluster_utils import Cluster

        args = dict(num_cpus=self.cpus, object_store_memory=OBJECT_STORE)
        self.cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
        self.nodes = [self.cluster.head_node]
        for _ in range(self.n_nodes - 1):
            self.nodes.append(self.cluster.add_node(**args))
        self.cluster.wait_for_nodes()

    def node_id(self, index: int) -> str:
        return self.nodes[index].node_id

    def kill(self, index: int) -> None:
        """Node `index` (not the head: it holds the cluster's control store) killed at once, as a machine lost."""
        if index == 0:
            raise ValueError("the head node holds the cluster; kill a worker node (1 or more)")
        self.cluster.remove_node(self.nodes[index], allow_graceful=False)

    def stop(self) -> None:
        if self.cluster is not None:
            with suppress(Exception):
                self.cluster.shutdown()
            self.cluster = None
