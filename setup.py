"""Generates the gRPC stubs from protos/*.proto at build time (also for editable installs)."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent.resolve()


def generate_grpc_stubs() -> None:
    from grpc_tools import protoc
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").glob("*.proto"))
    args = ["grpc_tools.protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={ROOT}",
            f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + " ".join(protos))


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_grpc_stubs()
        super().run()


if __name__ == "__main__":   # setuptools runs it so; scripts/gpu_check.sh imports generate_grpc_stubs alone
    setup(cmdclass={"build_py": BuildPyWithProtos})
