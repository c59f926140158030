"""Connecting to a meshrun cluster, starting a local one, and moving arrays to and from it."""
import collections
import contextlib
import os
import pathlib
import queue
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import grpc
import numpy as np

from meshrun import _array, _sharding, errors
from meshrun._convert_random import is_key_dtype
from meshrun.v1 import coordinator_pb2, coordinator_pb2_grpc

NODE_NAME = "meshrun-node"  # the name every node certificate carries (net/credentials.h)
_MAX_MESSAGE = -1  # arrays travel whole in one message, as the C++ SDK sends them
# The largest array one PutArray carries: the cluster's 2 GiB message limit (protobuf's) less
# 1 MiB for the rest of the request (coordinator.proto's ArrayLimit, as the C++ SDK reads it).
MAX_ARRAY_BYTES = coordinator_pb2.MAX_ARRAY_MESSAGE_BYTES
# Seconds the release thread gathers garbage-collected arrays before it frees them in one call:
# a DeleteArray reaches every worker, which cost a 2x4 cluster's seed MLP step (45 ms, a batch
# put per step) 3 ms when each step's garbage went in a call of its own.
_RELEASE_WINDOW = 0.1


def _credentials(tls_dir, token, insecure):
    """(channel credentials, bearer token) as the CLI finds them: MESHRUN_INSECURE=1 (None, None),
    else MESHRUN_TLS_DIR, else ~/.meshrun/tls (ca.pem and token, written by `meshrun certs init` or
    `meshrun up`); the token is None where there is none."""
    if insecure is None:
        insecure = os.environ.get("MESHRUN_INSECURE") == "1"
    if insecure:
        return None, None
    tls_dir = pathlib.Path(tls_dir or os.environ.get("MESHRUN_TLS_DIR") or pathlib.Path.home() / ".meshrun" / "tls")
    ca = tls_dir / "ca.pem"
    if not ca.exists():
        raise errors.PermissionDeniedError(
            f"no cluster credentials: {ca} does not exist (pass tls_dir=, set MESHRUN_TLS_DIR, "
            "or insecure=True / MESHRUN_INSECURE=1 for a cluster run with --insecure)")
    if token is None:
        token_file = tls_dir / "token"
        token = token_file.read_text().strip() if token_file.exists() else None
    return grpc.ssl_channel_credentials(root_certificates=ca.read_bytes()), token or None


def _method_path(name):
    """The gRPC path of Coordinator method `name` ("/meshrun.v1.Coordinator/PutArray"), from the
    generated descriptor."""
    service = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]
    return f"/{service.full_name}/{service.methods_by_name[name].name}"


class Cluster:
    """A connection to a running cluster's coordinator. Thread-safe for concurrent calls (gRPC
    channels are); the jit caches are not (one thread per Cluster object for jit).

    Each Cluster is a client session (the ``meshrun-session`` metadata of its calls): the arrays
    it creates belong to it, and if the process dies or loses its connection without deleting
    them, the coordinator frees them once the session has been silent for its ``--client_lease``
    (60 s by default). A daemon thread sends ``KeepAlive`` every third of the lease until
    ``close()``."""

    def __init__(self, address, *, tls_dir=None, token=None, insecure=None, timeout=60.0):
        port = str(address).rpartition(":")[2]
        if ":" in str(address) and port.isdigit() and not 1 <= int(port) <= 65535:
            raise errors.InvalidArgumentError(
                f"coordinator address '{address}': port {port} is out of range; expected 1..65535")
        self.address = address
        self.timeout = float(timeout)  # seconds, for every control RPC
        options = [("grpc.max_receive_message_length", _MAX_MESSAGE),
                   ("grpc.max_send_message_length", _MAX_MESSAGE)]
        creds, token = _credentials(tls_dir, token, insecure)
        if creds is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            options.append(("grpc.ssl_target_name_override", NODE_NAME))
            self._channel = grpc.secure_channel(address, creds, options=options)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        # PutArray taking its request already serialised (Cluster._put builds the bytes), and
        # GetArray returning its response's bytes (Cluster._get reads the blocks in place).
        self._put_wire = self._channel.unary_unary(
            _method_path("PutArray"), request_serializer=None,
            response_deserializer=coordinator_pb2.PutArrayResponse.FromString)
        self._get_wire = self._channel.unary_unary(
            _method_path("GetArray"), request_serializer=coordinator_pb2.GetArrayRequest.SerializeToString,
            response_deserializer=None)
        self._metadata = (("meshrun-session", secrets.token_hex(16)),)
        if token is not None:
            # The token goes as each call's own metadata, only ever over this TLS channel. As call
            # credentials (grpc.access_token_call_credentials) grpcio would run its plugin on a new
            # thread for every call: about 0.2 ms of CPU per call on a 2-core machine.
            self._metadata += (("authorization", f"Bearer {token}"),)
        self._closed = threading.Event()
        # Ids of arrays garbage-collected (Array.__del__), freed on the cluster by a thread of
        # their own (_release_loop); SimpleQueue.put is safe to call from __del__.
        self._released = queue.SimpleQueue()
        self._eager_ops = collections.OrderedDict()  # meshrun._eager's jitted ops, by op
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise errors.ClusterConnectionError(
                f"cannot reach the meshrun coordinator at {address} within {self.timeout:g} s") from None
        status = self._call("GetStatus", coordinator_pb2.GetStatusRequest())
        self.mesh = _sharding.Mesh.from_proto(status.mesh)
        self._keepalive = threading.Thread(target=self._keep_alive, daemon=True,
                                           name="meshrun-keepalive")
        self._keepalive.start()
        self._releaser = threading.Thread(target=self._release_loop, daemon=True, name="meshrun-release")
        self._releaser.start()

    def _keep_alive(self):
        every = 5.0  # seconds, until the coordinator says its lease
        while not self._closed.wait(every):
            try:
                resp = self._stub.KeepAlive(coordinator_pb2.KeepAliveRequest(), timeout=5.0,
                                            metadata=self._metadata)
                if resp.lease_seconds > 0:
                    every = max(0.1, resp.lease_seconds / 3)
            except grpc.RpcError:
                pass  # the coordinator is away; the next call says so
            except ValueError:
                return  # the channel was closed

    def _call(self, method, request, timeout=None, stub=None):
        """`stub`: the callable to use instead of the generated stub's `method`."""
        try:
            call = stub or getattr(self._stub, method)
            return call(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, method) from None

    def _release(self, array_id):
        """Frees `array_id` on the cluster soon, from the release thread (Array.__del__)."""
        if not self._closed.is_set():
            self._released.put(array_id)

    def _release_loop(self):
        """Frees the arrays _release hands over, in batches: the ids that come within
        _RELEASE_WINDOW of the first go in one DeleteArray (each call reaches every worker).
        Errors are dropped: an id the coordinator no longer knows is already freed (a re-formed
        cluster, an expired session), and an array left by an unreachable coordinator goes with
        the session's lease. A threading.Event in the queue is set once the ids before it are
        freed (_wait_released); None stops the loop."""
        while True:
            items = [self._released.get()]
            if isinstance(items[0], str):
                time.sleep(_RELEASE_WINDOW)  # gathers a train loop's garbage of a few steps
            while True:
                try:
                    items.append(self._released.get_nowait())
                except queue.Empty:
                    break
            ids = [i for i in items if isinstance(i, str)]
            if ids:
                try:
                    self._stub.DeleteArray(coordinator_pb2.DeleteArrayRequest(ids=ids), timeout=self.timeout,
                                           metadata=self._metadata)
                except (grpc.RpcError, ValueError):  # ValueError: the channel was closed
                    pass
            for i in items:
                if isinstance(i, threading.Event):
                    i.set()
            if None in items:
                return

    def _wait_released(self, timeout=None):
        """Returns once the arrays garbage-collected so far are freed on the cluster (True), or
        after `timeout` seconds (False)."""
        done = threading.Event()
        self._released.put(done)
        return done.wait(timeout)

    def close(self):
        """Frees the arrays garbage-collected so far (waiting up to 5 s), then closes the
        channel. Arrays still referenced stay on the cluster until the session's lease ends."""
        if self._closed.is_set():
            return
        self._released.put(None)
        self._releaser.join(timeout=5.0)
        self._closed.set()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- arrays ---------------------------------------------------------------------------------

    def device_put(self, x, sharding=None):
        """jax.device_put onto the cluster: a pytree of arrays and a PartitionSpec/NamedSharding
        (or a pytree of them, a prefix of x's). Each worker receives only its own block. Returns
        the same pytree of meshrun.Array. Errors: InvalidArgumentError for a shape that the
        sharding does not divide or whose rank is under the sharding's length (as JAX, trailing
        Nones count), an unknown axis, an unsupported dtype (f32, bf16, i32, u32,
        u8; bool is stored as f32 0/1 and Python scalars as f32/i32; typed PRNG keys as their
        words, see meshrun.Array), or an array over MAX_ARRAY_BYTES (2 GiB - 1 MiB, as stored)."""
        from meshrun import _tree

        return _tree.map_with_prefix(self._put_value, sharding, x)

    def _put_value(self, leaf, spec):
        """One leaf (array, scalar or typed key array) put on the cluster laid out as `spec`."""
        if spec is not None:
            _sharding.check_rank(spec, np.shape(leaf), "device_put")
        if is_key_dtype(getattr(leaf, "dtype", None)):
            import jax

            a = self._put(np.asarray(jax.random.key_data(leaf)), spec)
            a.key_dtype = leaf.dtype
            return a
        return self._put(np.asarray(leaf), spec)

    def _put(self, x, spec):
        logical = np.bool_ if x.dtype == np.bool_ else None
        x = x.astype(_sharding.stored_dtype(x.dtype), copy=False)
        if x.nbytes > MAX_ARRAY_BYTES:
            raise errors.InvalidArgumentError(
                f"device_put: the array's {x.nbytes} bytes ({list(x.shape)} {x.dtype}) exceed the "
                f"{MAX_ARRAY_BYTES} bytes one PutArray message carries (protobuf's 2 GiB limit); put "
                "it in pieces and join them on the cluster (jnp.concatenate under cluster.jit)")
        entries = _sharding.normalize_spec(spec, self.mesh)
        # PutArrayRequest's wire bytes, x's data copied into them once (tensor_field_bytes).
        rest = coordinator_pb2.PutArrayRequest(spec=_sharding.spec_to_proto(entries))
        req = b"".join([rest.SerializeToString()] + _sharding.tensor_field_bytes(1, x))
        return _array.Array(self, self._call("PutArray", req, stub=self._put_wire).info, logical)

    def _get(self, array_id):
        got = self._call("GetArray", coordinator_pb2.GetArrayRequest(id=array_id), stub=self._get_wire)
        info, blocks, ranks = _sharding.get_array_blocks(got)
        shape = tuple(int(d) for d in info.shape.dims)
        out = np.empty(shape, dtype=_sharding.dtype_from_proto(info.dtype))
        entries = _sharding.spec_from_proto(info.sharding.spec)
        for b, rank in zip(blocks, ranks):  # each block copied once, into `out`
            index = _sharding.block_index(self.mesh, entries, rank, len(shape))
            out[tuple(slice(i * n, (i + 1) * n) for i, n in zip(index, b.shape))] = b
        return out

    def _delete(self, array_id):
        self._call("DeleteArray", coordinator_pb2.DeleteArrayRequest(ids=[array_id]))

    def visualize_array_sharding(self, a, file=None):
        """Prints which workers hold each block of a 1-D or 2-D array, as
        jax.debug.visualize_array_sharding draws it (one cell per block, its ranks inside)."""
        if a.ndim not in (1, 2):
            raise errors.InvalidArgumentError(f"visualize_array_sharding: rank {a.ndim}; expected 1 or 2")
        blocks = _sharding.blocks_per_dim(self.mesh, a._entries, a.ndim)
        rows, cols = (1, blocks[0]) if a.ndim == 1 else blocks
        cells = {}
        for rank in range(self.mesh.size):
            idx = _sharding.block_index(self.mesh, a._entries, rank, a.ndim)
            r, c = (0, idx[0]) if a.ndim == 1 else idx
            cells.setdefault((r, c), []).append(rank)
        texts = {k: "CPU " + ",".join(str(r) for r in v) for k, v in cells.items()}
        width = max(len(t) for t in texts.values()) + 4
        lines = ["┌" + "┬".join("─" * width for _ in range(cols)) + "┐"]
        for r in range(rows):
            lines.append("│" + "│".join(texts[(r, c)].center(width) for c in range(cols)) + "│")
            lines.append(("├" + "┼".join("─" * width for _ in range(cols)) + "┤") if r + 1 < rows
                         else ("└" + "┴".join("─" * width for _ in range(cols)) + "┘"))
        print("\n".join(lines), file=file)

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, ckpt_dir, target, step, *, keep=0):
        """Mirrors flax.training.checkpoints.save_checkpoint(ckpt_dir, target, step, keep=): saves
        a pytree of meshrun.Arrays as a sharded checkpoint, each worker writing only its own
        blocks (one replica of each) under `ckpt_dir`/step_<step>, committed atomically; keep > 0
        deletes all but the newest `keep` committed steps. `ckpt_dir` is a path the workers see,
        under the cluster's --checkpoint_root. Leaves are named by their tree path joined by "/"
        ("params/Dense_0/kernel"), so restore_checkpoint needs a target of the same structure.
        A step already committed there is replaced. Returns the committed directory. Errors:
        InvalidArgumentError for a leaf that is not a live meshrun.Array or a bad step / keep;
        PermissionDeniedError for a directory outside the root."""
        from meshrun import _checkpoint

        return _checkpoint.save(self, ckpt_dir, target, step, keep)

    def restore_checkpoint(self, path, target, shardings=None):
        """Mirrors flax.training.checkpoints.restore_checkpoint: the checkpoint committed at
        `path` (what save_checkpoint returned), in `target`'s pytree structure, each worker
        reading only the blocks of its own shards, laid out as `shardings` (a PartitionSpec or a
        pytree prefix of them, as device_put's) or, without it, as each target leaf (a
        meshrun.Array) is; the layout may differ from the saved one, and the cluster's mesh may
        differ from the saving one's. Target leaves may be meshrun.Arrays, numpy or jax arrays or
        jax.ShapeDtypeStructs: their shape and dtype must match the saved ones (bool and typed
        PRNG keys come back as such). Returns a pytree of new meshrun.Arrays. Errors:
        NotFoundError for a leaf name not in the checkpoint or no checkpoint at `path`;
        InvalidArgumentError for a shape or dtype that differs (nothing restored stays on the
        cluster) or a target without shardings whose leaves are not meshrun.Arrays."""
        from meshrun import _checkpoint

        return _checkpoint.restore(self, path, target, shardings)

    def jit(self, fun, in_shardings=None, out_shardings=None, static_argnums=(), donate_argnums=(),
            static_argnames=(), donate_argnames=(), while_trips=None):
        """jax.jit on the cluster; see meshrun._jit.Jitted."""
        from meshrun import _jit

        return _jit.Jitted(self, fun, in_shardings, out_shardings, static_argnums, donate_argnums,
                           static_argnames, donate_argnames, while_trips)


def connect(address, *, tls_dir=None, token=None, insecure=None, timeout=60.0) -> Cluster:
    """Connects to the coordinator at host:port. Credentials as the CLI finds them (see
    _credentials). Errors: ClusterConnectionError (a ConnectionError) if it cannot be reached
    within `timeout` seconds; PermissionDeniedError for missing or refused credentials."""
    return Cluster(address, tls_dir=tls_dir, token=token, insecure=insecure, timeout=timeout)


def _find_binary(bin_dir):
    for d in [bin_dir, os.environ.get("MESHRUN_BIN_DIR")]:
        if d and (pathlib.Path(d) / "meshrun").exists():
            return str(pathlib.Path(d) / "meshrun")
    found = shutil.which("meshrun")
    if not found:
        raise FileNotFoundError("the meshrun binary was not found: pass bin_dir=, set MESHRUN_BIN_DIR, or put it on PATH")
    return found


def _mesh_flag(mesh):
    """`meshrun up --mesh`'s value from "data=2,model=4" or {"data": 2, "model": 4}."""
    if isinstance(mesh, str):
        return mesh
    if isinstance(mesh, dict) and mesh and all(
            isinstance(k, str) and isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0
            for k, v in mesh.items()):
        return ",".join(f"{k}={int(v)}" for k, v in mesh.items())
    raise TypeError(f"mesh={mesh!r}: expected axis sizes as a string 'data=2,model=4' or a dict "
                    "{'data': 2, 'model': 4} of axis name to a positive int, in mesh order (row-major)")


@contextlib.contextmanager
def local_cluster(mesh="data=8", *, bin_dir=None, insecure=False, shm=True, start_timeout=120.0):
    """Starts a cluster on this machine (`meshrun up`: a coordinator and one worker process per
    mesh device), yields a connected Cluster, and stops every process on exit. `mesh` gives the
    axes and their sizes in order, as "data=2,model=4" or {"data": 2, "model": 4} (the devices laid
    out row-major, as jax.make_mesh((2, 4), ("data", "model"))). TLS and a token are on unless
    insecure=True: fresh credentials are made in a temporary directory. The cluster also stops
    when this process exits without leaving the block (killed, os._exit): `meshrun up` watches a
    pipe from it. Errors: TypeError for a
    `mesh` of another form; ClusterConnectionError if the cluster does not start (with `meshrun up`'s
    output)."""
    mesh = _mesh_flag(mesh)
    meshrun = _find_binary(bin_dir)
    work = tempfile.mkdtemp(prefix="meshrun-py-")
    # --stop-on-stdin-eof: the pipe to its standard input is the cluster's lifeline, closed by the
    # kernel when this process exits however it exits (SIGKILL too), so no cluster outlives it.
    cmd = [meshrun, "up", "--mesh", mesh, "--port", "0", "--log-dir", os.path.join(work, "logs"),
           "--stop-on-stdin-eof"]
    tls_dir = os.path.join(work, "tls")
    if insecure:
        cmd.append("--insecure")
    else:
        subprocess.run([meshrun, "certs", "init", tls_dir], check=True, stdout=subprocess.DEVNULL)
        cmd += ["--tls-dir", tls_dir]
    if not shm:
        cmd.append("--no-shm")
    out_path = os.path.join(work, "up.out")
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        address = None
        deadline = time.monotonic() + start_timeout
        while address is None:
            text = pathlib.Path(out_path).read_text()
            m = re.search(r"coordinator (\S+), \d+ workers", text)
            if m:
                address = m.group(1)
            elif proc.poll() is not None:
                raise errors.ClusterConnectionError(f"meshrun up exited with {proc.returncode}: {text.strip()}")
            elif time.monotonic() > deadline:
                raise errors.ClusterConnectionError(f"meshrun up did not start within {start_timeout:g} s: {text.strip()}")
            else:
                time.sleep(0.1)
        cluster = Cluster(address, tls_dir=None if insecure else tls_dir, insecure=insecure)
        cluster.log_dir = os.path.join(work, "logs")
        try:
            yield cluster
        finally:
            cluster.close()
    finally:
        proc.stdin.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)
