"""Shared by the SDK's tests: the arrays a cluster holds."""
import gc

from meshrun.v1 import coordinator_pb2


def listed(cluster):
    """The ids of the arrays on the cluster, once the arrays garbage-collected so far are freed
    (meshrun.Array.__del__ hands them to the cluster's release thread)."""
    gc.collect()
    assert cluster._wait_released(timeout=30)
    return {a.id for a in cluster._call("ListArrays", coordinator_pb2.ListArraysRequest()).arrays}
