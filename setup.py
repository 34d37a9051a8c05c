"""The one part of the build that pyproject.toml does not declare: the workers' store's
compiled engine (``src/elastrun/store/torchwire/wirecore.c``; epoll, so Linux only).

It is optional: where it cannot be built (no C compiler, another system) the install
goes on, and ``TorchWireServer`` serves the same protocol from Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "elastrun.store.torchwire.wirecore",
            sources=["src/elastrun/store/torchwire/wirecore.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        )
    ]
)
