"""The one compiled part of llmd: the KV index's core (llmd/kv/_kvnative.c). Everything else is in pyproject.toml.

`pip install -e .` builds it; without a compiler llmd still works on the pure-Python index (llmd/kv/pyindex.py)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "llmd.kv._kvnative",
            ["llmd/kv/_kvnative.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-function"],
            optional=True,
        )
    ]
)
