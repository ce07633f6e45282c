"""llmd's compiled parts: the KV index's core (llmd/kv/_kvnative.c), the simulated engine's block pool and CPU tier
(llmd/engines/sim/_blockpool.c) and the cluster simulator's token runs (llmd/sim/_tokens.c). Everything else is in
pyproject.toml.

`pip install -e .` builds them; without a compiler llmd still works on their pure-Python twins (llmd/kv/pyindex.py,
llmd/engines/sim/block_pool.py, llmd/sim/tokens.py)."""

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
        Extension(
            "llmd.sim._tokens",
            ["llmd/sim/_tokens.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wno-unused-function"],
            optional=True,
        ),
    ]
)
