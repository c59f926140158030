"""Builds the meshrun package. Its gRPC stubs (meshrun/v1/*_pb2*.py) are generated here from the
repository's proto/ with grpcio-tools, never edited by hand (MESHRUN_PROTO_DIR overrides where the
.proto files are)."""
import os
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        from grpc_tools import protoc  # a build requirement (pyproject.toml)
        import grpc_tools

        proto_dir = pathlib.Path(os.environ.get("MESHRUN_PROTO_DIR", HERE.parent / "proto"))
        sources = sorted(str(p) for p in (proto_dir / "meshrun" / "v1").glob("*.proto"))
        if not sources:
            raise RuntimeError(f"no .proto files under {proto_dir}/meshrun/v1 (MESHRUN_PROTO_DIR)")
        out = pathlib.Path(self.build_lib)
        (out / "meshrun" / "v1").mkdir(parents=True, exist_ok=True)
        (out / "meshrun" / "v1" / "__init__.py").write_text('"""Generated gRPC stubs."""\n')
        well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
        args = ["grpc_tools.protoc", f"-I{proto_dir}", f"-I{well_known}",
                f"--python_out={out}", f"--grpc_python_out={out}", *sources]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on " + " ".join(sources))


setup(cmdclass={"build_py": BuildWithStubs})
