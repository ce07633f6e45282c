"""llmd's compiled parts: the KV index's core (llmd/kv/_kvnative.c) and the simulated engine's GPU block pool
(llmd/engines/sim/_blockpool.c). Everything else is in pyproject.toml.

`pip install -e .` builds them; without a compiler llmd still works on their pure-Python twins (llmd/kv/pyindex.py,
llmd/engines/sim/block_pool.py)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "llmd.kv._kvnative",
            ["llmd/kv/_kvnative.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-function"],
            optional=True,
        ),
        Extension(
            "llmd.engines.sim._blockpool",
            ["llmd/engines/sim/_blockpool.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-function"],
            optional=True,
        ),
    ]
)
