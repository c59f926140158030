"""Connecting to a TLS cluster: every call carries the bearer token as its own metadata (no grpcio
call-credentials plugin, which starts a thread per call), and a wrong or missing token is refused
with PermissionDeniedError."""
import os
import shutil
import subprocess
import sys
import threading
import time

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


def _processes_naming(text):
    """pids of this host's processes whose command line contains `text`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(entry))
        except OSError:  # gone meanwhile
            pass
    return pids


def test_a_local_cluster_stops_when_the_process_that_started_it_is_killed(tmp_path):
    """SIGKILL gives local_cluster's `finally` no chance to run; `meshrun up` notices its stdin
    pipe close and stops the coordinator and workers, rather than leaving them running."""
    script = ("import sys, time, meshrun\n"
              "with meshrun.local_cluster('data=2') as c:\n"
              "    print(c.log_dir, flush=True)\n"
              "    time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    work = ""
    try:
        work = os.path.dirname(child.stdout.readline().strip())
        assert work, "the child printed no log directory"
        running = _processes_naming(work)
        assert len(running) == 4, running  # meshrun up, the coordinator, two workers (TLS dirs)
        child.kill()
        child.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _processes_naming(work) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_naming(work) == [], "the cluster outlived the process that started it"
    finally:
        if child.poll() is None:
            child.kill()
        if work:
            for pid in _processes_naming(work):
                os.kill(pid, 9)
            shutil.rmtree(work, ignore_errors=True)
