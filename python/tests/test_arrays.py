"""device_put / fetch / delete / visualize, and the errors a user meets first."""
import copy
import io
import os
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import meshrun
from clusterutil import listed


def test_mesh_is_the_clusters(cluster):
    assert cluster.mesh.shape == {"data": 2, "model": 4}
    assert cluster.mesh.axis_names == ("data", "model")


@pytest.mark.parametrize("spec", [P(), P("data"), P(None, "model"), P("data", "model"),
                                  P(("data", "model")), P("model", "data")])
def test_device_put_then_fetch_returns_the_array(cluster, spec):
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) * 0.5 - 3
    a = cluster.device_put(x, spec)
    assert a.shape == (8, 16) and a.dtype == np.float32
    assert a.sharding.spec == spec
    np.testing.assert_array_equal(np.asarray(a), x)
    a.delete()
    with pytest.raises(RuntimeError):
        np.asarray(a)


def test_pytrees_and_dtypes_round_trip(cluster):
    tree = {"w": np.ones((4, 8), np.float32), "n": np.array(7, np.int32),
            "h": (np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16),)}
    specs = {"w": P("data", "model"), "n": P(), "h": (P("model"),)}
    put = cluster.device_put(tree, specs)
    got = jax.tree_util.tree_map(np.asarray, put)
    assert got["n"].dtype == np.int32 and int(got["n"]) == 7
    assert got["h"][0].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["h"][0].astype(np.float32), np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(got["w"], tree["w"])


def test_the_jax_array_conveniences_seed_code_calls_work(cluster):
    """Seeds 000 and 003 time steps with jax.tree_util.tree_map(lambda x: x.block_until_ready(),
    xs); train loops print f"{loss:.4f}" and float(loss); all fetch (or return) the array."""
    xs = cluster.device_put({"w": np.arange(8, dtype=np.float32).reshape(2, 4), "m": np.array([True, False])},
                            {"w": P("data"), "m": P()})
    assert jax.tree_util.tree_map(lambda x: x.block_until_ready(), xs)["w"] is xs["w"]
    loss = cluster.jit(lambda s: jax.numpy.sum(s["w"]) / 8)(xs)
    assert f"{loss:.3f}" == "3.500" and float(loss) == 3.5 and loss.item() == 3.5 and int(loss) == 3
    assert xs["w"].tolist() == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    assert xs["w"][1, 2] == 6.0 and xs["m"][1].item() is False
    assert (xs["w"].nbytes, xs["w"].itemsize, xs["m"].nbytes) == (32, 4, 2)
    assert f"{xs['w']}".startswith("meshrun.Array(")  # no format spec: the repr, nothing fetched
    loss.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        loss.block_until_ready()


def test_visualize_array_sharding_draws_the_blocks(cluster):
    a = cluster.device_put(np.zeros((4, 8), np.float32), P("data", "model"))
    out = io.StringIO()
    cluster.visualize_array_sharding(a, file=out)
    text = out.getvalue()
    assert text.count("CPU") == 8, text
    assert "CPU 0" in text and "CPU 7" in text
    first_row = text.splitlines()[1]
    assert first_row.count("CPU") == 4, text


def test_a_shape_the_mesh_does_not_divide_is_a_value_error(cluster):
    with pytest.raises(ValueError) as e:
        cluster.device_put(np.zeros((6, 6), np.float32), P("model"))
    assert isinstance(e.value, meshrun.errors.InvalidArgumentError)
    assert "6" in str(e.value) and "model" in str(e.value)


def test_arrays_over_the_old_256_mib_message_limit_round_trip(cluster):
    """Messages up to protobuf's 2 GiB: a 288 MiB array (over gRPC's 256 MiB the cluster used to
    allow) goes to the workers and comes back whole."""
    x = np.arange(72 << 20, dtype=np.uint32).reshape(8, 9 << 20)
    a = cluster.device_put(x, P("data"))
    np.testing.assert_array_equal(np.asarray(a), x)
    a.delete()


@pytest.mark.parametrize("shape, dtype, spec", [
    ((600, 512), np.float32, P()),                    # the first dim splits over all 8 holders
    ((8, 5, 60000), np.uint8, P("data")),             # each half among its 4 'model' holders
    ((3, 2000, 400), ml_dtypes.bfloat16, P(None, None, "model")),  # split along dim 1
    ((3, 5, 30000), np.int32, P()),                   # along the last dim
    ((3, 5, 100003), np.float32, P()),                # no dim divides by 8: each holder sent all
])
def test_a_block_several_workers_hold_is_put_once_and_gathered_by_them(cluster, shape, dtype, spec):
    """A put of a block of 1 MiB or more that several workers hold sends each 1/k of it and has
    them all-gather it: the array is the one put, laid out as asked, and no pieces are left."""
    before = listed(cluster)
    x = (np.arange(np.prod(shape), dtype=np.int64) % 251).astype(dtype).reshape(shape)
    a = cluster.device_put(x, spec)
    assert a.sharding.spec == spec and a.dtype == np.dtype(dtype) and a.shape == shape
    np.testing.assert_array_equal(np.asarray(a), x)
    assert listed(cluster) == before | {a.id}


@pytest.mark.parametrize("x", [np.float32(2.5), np.zeros((0, 3), np.int32),
                               np.arange(40, dtype=np.uint8),  # lengths under one varint byte
                               np.arange(5000, dtype=np.float32).reshape(50, 100)[:, ::2],
                               np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)])
def test_put_requests_wire_bytes_parse_as_the_message_they_replace(x):
    """device_put writes PutArrayRequest's wire format itself (the array's bytes copied once);
    protobuf must read it as the message built field by field."""
    from meshrun import _sharding
    from meshrun.v1 import common_pb2, coordinator_pb2
    spec = _sharding.spec_to_proto([("data",)] if x.ndim else [])
    wire = b"".join([coordinator_pb2.PutArrayRequest(spec=spec).SerializeToString()]
                    + _sharding.tensor_field_bytes(1, x))
    want = coordinator_pb2.PutArrayRequest(spec=spec, array=common_pb2.Tensor(
        dtype=_sharding.dtype_to_proto(x.dtype), shape=common_pb2.Shape(dims=x.shape),
        data=np.ascontiguousarray(x).tobytes()))
    assert coordinator_pb2.PutArrayRequest.FromString(wire) == want


def _tensor(x):
    from meshrun import _sharding
    from meshrun.v1 import common_pb2
    return common_pb2.Tensor(dtype=_sharding.dtype_to_proto(x.dtype), shape=common_pb2.Shape(dims=x.shape),
                             data=np.ascontiguousarray(x).tobytes())


def test_get_responses_are_read_in_place_as_protobuf_reads_them():
    """device_get reads GetArrayResponse's wire bytes itself (the blocks are views of them, not
    copied by a parse): it must see what protobuf sees, whatever the field order, packed or not,
    with fields it does not know; and refuse bytes that are not such a message."""
    from meshrun import _sharding, errors
    from meshrun.v1 import coordinator_pb2
    blocks = [np.float32(2.5).reshape(()), np.zeros((0, 3), np.int32), np.arange(40, dtype=np.uint8),
              np.arange(5000, dtype=np.float32).reshape(50, 100),
              np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16)]
    ranks = [0, 3, 200, 7, 1]  # 200: a two-byte varint
    info = coordinator_pb2.ArrayInfo(id="x", dtype=1, bytes_per_worker=12)
    msg = coordinator_pb2.GetArrayResponse(info=info, blocks=[_tensor(b) for b in blocks], block_ranks=ranks)
    canonical = msg.SerializeToString()
    # Reordered: the ranks first and unpacked, an unknown varint and string field between, the info last.
    v = _sharding._varint
    shuffled = b"".join([v(3 << 3 | 0) + v(r) for r in ranks]
                        + [v(9 << 3 | 0) + v(5), v(10 << 3 | 2) + v(3) + b"abc"]
                        + [v(2 << 3 | 2) + v(len(t)) + t for t in (_tensor(b).SerializeToString() for b in blocks)]
                        + [v(1 << 3 | 2) + v(len(info.SerializeToString())) + info.SerializeToString()])
    parsed = coordinator_pb2.GetArrayResponse.FromString(shuffled)
    parsed.DiscardUnknownFields()
    assert parsed == msg
    for wire in (canonical, shuffled):
        got_info, got_blocks, got_ranks = _sharding.get_array_blocks(wire)
        assert got_info == info and got_ranks == ranks
        for got, want in zip(got_blocks, blocks, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
    for bad in (canonical[:-1], canonical + b"\x12\x05ab", b"\xff" * 11):
        with pytest.raises(errors.InternalError):
            _sharding.get_array_blocks(bad)


def test_a_big_endian_array_is_put_as_its_values(cluster):
    x = np.arange(32, dtype=">f4").reshape(4, 8) - 7.5  # as jnp.asarray takes it
    a = cluster.device_put(x, P("data", "model"))
    assert a.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(a), x)


def test_an_array_over_the_message_limit_is_refused_before_it_is_sent(cluster):
    x = np.zeros((2**29 + 1,), np.float32)  # 2 GiB + 4 bytes; zeros are not touched until read
    with pytest.raises(meshrun.errors.InvalidArgumentError, match=r"2147483652 bytes \(\[536870913\] float32\) exceed"):
        cluster.device_put(x, P())


@pytest.mark.parametrize("spec", [P(None, None, None), P("data", None, None)])
def test_a_sharding_longer_than_the_rank_is_refused_as_jax_refuses_it(cluster, spec):
    x = np.zeros((8, 4), np.float32)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    with pytest.raises(ValueError, match="rank at least 3"):
        jax.device_put(x, NamedSharding(mesh, spec))
    with pytest.raises(meshrun.errors.InvalidArgumentError,
                       match=r"device_put: PartitionSpec .* has 3 entries but the value has rank 2 "
                             r"\(shape \[8, 4\]\)"):
        cluster.device_put(x, spec)
    a = cluster.device_put(x, P("data", None))  # as long as the rank: trailing None dropped
    assert a.sharding.spec == P("data")


def test_a_sharding_over_another_mesh_is_refused(cluster):
    other = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    with pytest.raises(ValueError, match="differs from the cluster's mesh"):
        cluster.device_put(np.zeros((8, 8), np.float32), NamedSharding(other, P("data")))
    same = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    a = cluster.device_put(np.ones((8, 8), np.float32), NamedSharding(same, P("data", "model")))
    assert a.sharding.spec == P("data", "model")


def test_an_unknown_array_is_a_key_error(cluster):
    with pytest.raises(KeyError):
        cluster._get("no-such-array")


def test_a_port_out_of_range_is_refused_at_once():
    with pytest.raises(ValueError, match=r"port 99999 is out of range; expected 1..65535"):
        meshrun.connect("127.0.0.1:99999", insecure=True)


def test_a_dead_cluster_is_a_connection_error_not_a_hang():
    start = time.monotonic()
    with pytest.raises(ConnectionError):
        meshrun.connect("127.0.0.1:1", insecure=True, timeout=2)
    assert time.monotonic() - start < 10


def test_arrays_belong_to_the_clients_session(cluster):
    """Each Cluster is a session: what it puts is listed with it as owner (a second connection
    has another), so the coordinator frees it if the process dies (--client_lease)."""
    from meshrun.v1 import coordinator_pb2
    mine = cluster.device_put(np.ones((8, 8), np.float32), P("data"))
    tls_dir = os.path.join(os.path.dirname(cluster.log_dir), "tls")  # local_cluster's
    other = meshrun.connect(cluster.address, tls_dir=tls_dir)
    try:
        theirs = other.device_put(np.zeros((8, 8), np.float32), P())
        listed = {a.id: a.owner for a in
                  other._call("ListArrays", coordinator_pb2.ListArraysRequest()).arrays}
        assert listed[mine.id] == dict(cluster._metadata)["meshrun-session"]
        assert listed[theirs.id] == dict(other._metadata)["meshrun-session"]
        assert listed[mine.id] != listed[theirs.id]
        lease = other._stub.KeepAlive(coordinator_pb2.KeepAliveRequest(),
                                      metadata=other._metadata)
        assert lease.lease_seconds > 0 and lease.owned_arrays == 1
        theirs.delete()
    finally:
        other.close()
        mine.delete()


def test_arrays_a_train_loop_drops_are_freed_on_the_cluster_as_jax_frees_them(cluster):
    """A loop that puts a batch per step and keeps the last loss holds only those on the cluster:
    a meshrun.Array garbage-collected is freed there, as a jax.Array's buffers are (before, every
    batch and loss stayed until the session ended: 40 arrays after this loop). A jitted function's
    constants live as long as the function."""
    offsets = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)  # a constant
    step = cluster.jit(lambda w, x: jax.numpy.sum(w * x + offsets), in_shardings=(P(), P("data")),
                       out_shardings=P())
    w = cluster.device_put(np.full((64,), 0.5, np.float32), P())
    before = listed(cluster)
    for i in range(20):
        x = cluster.device_put(np.full((8, 64), i, np.float32), P("data"))
        loss = step(w, x)
    np.testing.assert_allclose(float(loss), 19 * 0.5 * 8 * 64 + offsets.sum(), rtol=1e-5)
    consts = {a.id for c in step._cache.values() for a in c.consts}
    assert len(consts) == 1
    assert listed(cluster) - before == {x.id, loss.id} | consts
    assert float(step(w, x)) == float(loss)  # the constant is still there
    del x, loss
    assert listed(cluster) - before == consts
    del step
    assert listed(cluster) == before
    # Donated arguments are the cluster's: dropping them frees nothing twice.
    inc = cluster.jit(lambda v: v + 1.0, in_shardings=P(), out_shardings=P(), donate_argnums=0)
    for _ in range(3):
        w = inc(w)
    assert listed(cluster) == before and float(np.asarray(w)[0]) == 3.5
    assert copy.copy(w) is w and copy.deepcopy({"w": w})["w"] is w  # immutable: no second owner


def test_operators_and_methods_run_on_the_cluster_as_a_jax_arrays_do(cluster):
    """loss + 1, total += loss, a * 2, a > 0, a.T, a.sum(axis=0)...: each runs on the cluster
    and gives a meshrun.Array laid out as jax.jit lays it out, with JAX's values and dtypes."""
    x = np.arange(32, dtype=np.float32).reshape(8, 4) - 10.0
    a = cluster.device_put(x, P("model"))
    losses = [cluster.device_put(np.float32(v), P()) for v in (0.5, 1.25, 2.0)]
    total = 0
    for loss in losses:  # a train loop's running loss stays on the cluster
        total += loss
    assert isinstance(total, meshrun.Array) and float(total) == 3.75
    cases = {
        "a * 2": (a * 2, x * 2, P("model")),
        "1.0 - a": (1.0 - a, 1.0 - x, P("model")),
        "a / a.sum()": (a / a.sum(), x / x.sum(), P("model")),
        "a > 0": (a > 0, x > 0, P("model")),
        "-abs(a)": (-abs(a), -np.abs(x), P("model")),
        "a.T": (a.T, x.T, P(None, "model")),
        "a.sum(axis=0)": (a.sum(axis=0), x.sum(axis=0), P()),
        "a.reshape(4, 8)": (a.reshape(4, 8), x.reshape(4, 8), P("model")),
        "a.astype(int32) // 3": (a.astype(jnp.int32) // 3, x.astype(np.int32) // 3, P("model")),
        "a @ a.T": (a @ a.T, x @ x.T, None),
        "a.max()": (a.max(), x.max(), P()),
    }
    for name, (got, want, spec) in cases.items():
        assert isinstance(got, meshrun.Array), name
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, err_msg=name)
        if spec is not None:
            assert got.sharding.spec == spec, (name, got.sharding.spec)
    # A Python scalar is weakly typed (bf16 stays bf16); a numpy one is not.
    b = cluster.device_put(np.ones(8, jnp.bfloat16), P())
    assert (b * 2.0).dtype == jnp.bfloat16 and (b * np.float32(2.0)).dtype == np.float32
    assert bool(total > 3) and not bool(total < 3) and len(a) == 8
    with pytest.raises(ValueError, match="ambiguous"):  # as numpy (and jax.Array) say
        bool(a > 0)
    with pytest.raises(TypeError, match="unsized"):
        len(total)
    np.testing.assert_array_equal([row for row in a], x)  # rows of one fetch
    with pytest.raises(TypeError, match="0-d"):
        iter(total)
    assert not a.is_fully_replicated and total.is_fully_replicated
    # Each op and its constants are traced once; later calls reuse the jitted op.
    traced = len(cluster._eager_ops)
    for loss in losses:
        total = total + loss * 3
    assert len(cluster._eager_ops) == traced + 1  # array + array is reused; times 3 is new
    assert float(total) == 3.75 * 4
