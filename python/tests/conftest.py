"""A real cluster for the SDK's tests: `meshrun up` with 8 worker processes on a 2x4 mesh, TLS on.
The binaries come from MESHRUN_BIN_DIR (CTest sets it to the build's bin/)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

import meshrun  # noqa: E402


@pytest.fixture(scope="session")
def cluster():
    with meshrun.local_cluster(mesh="data=2,model=4") as c:
        yield c
