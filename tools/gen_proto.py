"""Regenerate the Python gRPC modules in daemon/_generated from the .proto files in proto/.

Run it after editing a .proto file: ``python tools/gen_proto.py``. The output is committed so
that the daemon and its .deb need no protoc at run time; ``tests/test_proto_generated.py``
regenerates into a temporary directory and fails when the committed files differ.

protoc's virtual include path (``-Idaemon/_generated=proto``) makes the generated modules import
each other as ``daemon._generated....``, and registers the two ``api.proto`` files under distinct
names, which Python's descriptor pool needs.
"""

from __future__ import annotations

import pathlib
import sys

from grpc_tools import protoc

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "proto"
PACKAGE = "daemon/_generated"


def generate(output_root: pathlib.Path) -> list[pathlib.Path]:
    """Write the generated modules under ``output_root/daemon/_generated``; return their paths."""
    proto_files = sorted(PROTO_DIR.rglob("*.proto"))
    virtual_names = [f"{PACKAGE}/{path.relative_to(PROTO_DIR).as_posix()}" for path in proto_files]
    include = str(pathlib.Path(protoc.__file__).parent / "_proto")
    status = protoc.main(
        [
            "protoc",
            f"-I{PACKAGE}={PROTO_DIR}",
            f"-I{include}",
            f"--python_out={output_root}",
            f"--pyi_out={output_root}",
            f"--grpc_python_out={output_root}",
            *virtual_names,
        ]
    )
    if status != 0:
        raise SystemExit(f"protoc failed with status {status}")
    generated_root = output_root / PACKAGE
    for directory in [generated_root, *[p for p in generated_root.rglob("*") if p.is_dir()]]:
        (directory / "__init__.py").touch()
    return sorted(p for p in generated_root.rglob("*") if p.is_file())


if __name__ == "__main__":
    written = generate(REPO_ROOT)
    sys.stdout.write("".join(f"{path.relative_to(REPO_ROOT)}\n" for path in written))
