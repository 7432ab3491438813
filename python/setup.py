"""Builds the residentd package, generating its gRPC modules from the
repository's proto/ (grpcio-tools, a build requirement) into the build.

The generated modules import each other as top-level modules and name
their own module as one; both are rewritten, so they live inside the
package (and its messages pickle).
"""

import pathlib
import re

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
PROTO_DIR = HERE.parent / "proto" / "resident" / "v1"
PROTO = PROTO_DIR / "node_agent.proto"


class BuildWithProtos(build_py):
    def run(self):
        super().run()
        from grpc_tools import protoc

        if not PROTO.exists():
            raise SystemExit(f"{PROTO} not found: build the package from the residentd repository (pip install ./python)")
        out = pathlib.Path(self.build_lib) / "residentd" / "_proto"
        out.mkdir(parents=True, exist_ok=True)
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--grpc_python_out={out}",
                f"--pyi_out={out}", str(PROTO)]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {PROTO}")
        # The messages' module is this package's, so that they pickle
        # (Ray carries them between processes) and print as such.
        messages = out / "node_agent_pb2.py"
        text = messages.read_text()
        text = text.replace("'node_agent_pb2'", "'residentd._proto.node_agent_pb2'")
        messages.write_text(text)
        grpc_module = out / "node_agent_pb2_grpc.py"
        text = grpc_module.read_text()
        text = re.sub(r"^import node_agent_pb2 as", "from . import node_agent_pb2 as", text, flags=re.M)
        grpc_module.write_text(text)
        (out / "__init__.py").write_text('"""Generated from proto/resident/v1/node_agent.proto at build time."""\n')


setup(cmdclass={"build_py": BuildWithProtos})
