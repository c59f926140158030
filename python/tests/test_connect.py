"""Connecting to a TLS cluster: every call carries the bearer token as its own metadata (no grpcio
call-credentials plugin, which starts a thread per call), and a wrong or missing token is refused
with PermissionDeniedError."""
import os
import shutil
import threading

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import meshrun
from meshrun.v1 import coordinator_pb2


def tls_dir_of(cluster):  # local_cluster keeps its credentials beside its logs
    return os.path.join(os.path.dirname(cluster.log_dir), "tls")


def test_calls_with_the_token_work_without_a_thread_per_call(cluster, monkeypatch):
    c = meshrun.Cluster(cluster.address, tls_dir=tls_dir_of(cluster))
    try:
        x = np.arange(16, dtype=np.float32).reshape(8, 2)
        started = []
        start = threading.Thread.start
        monkeypatch.setattr(threading.Thread, "start", lambda t: (started.append(t.name), start(t))[1])
        for _ in range(20):
            c._call("GetStatus", coordinator_pb2.GetStatusRequest())
        got = np.asarray(c.jit(lambda a: a * 2.0, in_shardings=(P("data"),), out_shardings=P())(
            c.device_put(x, P("data"))))
        monkeypatch.undo()
        np.testing.assert_array_equal(got, x * 2.0)
        assert started == [], started
    finally:
        c.close()


def test_a_wrong_or_missing_token_is_refused(cluster, tmp_path):
    with pytest.raises(meshrun.errors.PermissionDeniedError):
        meshrun.Cluster(cluster.address, tls_dir=tls_dir_of(cluster), token="not-the-cluster-token")
    shutil.copy(os.path.join(tls_dir_of(cluster), "ca.pem"), tmp_path / "ca.pem")  # no token file
    with pytest.raises(meshrun.errors.PermissionDeniedError):
        meshrun.Cluster(cluster.address, tls_dir=tmp_path)


def test_local_cluster_takes_the_mesh_as_a_dict_and_names_a_mesh_of_another_form():
    with meshrun.local_cluster({"data": 1, "model": 2}, insecure=True) as c:
        assert (c.mesh.axis_names, c.mesh.shape) == (("data", "model"), {"data": 1, "model": 2})
        x = np.arange(6, dtype=np.float32).reshape(3, 2)
        np.testing.assert_array_equal(np.asarray(c.device_put(x, P(None, "model"))), x)
    for bad in [{"data": 0}, {"data": 2.0}, {}, ("data", 2), 8]:
        with pytest.raises(TypeError, match=r"mesh=.*expected axis sizes"):
            with meshrun.local_cluster(bad, insecure=True):
                pass
