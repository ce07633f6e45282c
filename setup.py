"""llmd's compiled parts: the KV index's core (llmd/kv/_kvnative.c), the block hasher's pickle
(llmd/kv/_blockpickle.c), the simulated engine's block pool and CPU tier (llmd/engines/sim/_blockpool.c) and its decode
planner's pass over the steps (llmd/engines/sim/_decodeplan.c), the router's chain sets and scoring pass
(llmd/router/scheduling/_chains.c, _fused.c), the cluster simulator's token runs and event loop (llmd/sim/_tokens.c,
llmd/sim/_loop.c) and its heap in huge pages (llmd/sim/_hugepages.c, nothing in its place where it is not built), and
the simulated engine's core compiled from its Python source by mypyc (llmd/compiled.py: which modules, and when their
source runs instead). Everything else is in pyproject.toml.

`pip install -e .` builds them; without a compiler (or mypy) llmd still works on their pure-Python twins
(llmd/kv/pyindex.py, pickle in llmd/kv/hashing.py, llmd/engines/sim/block_pool.py, plan_steps in
llmd/engines/sim/decode_run.py, llmd/router/scheduling/chains.py and fused.py, llmd/sim/tokens.py, llmd/sim/loop.py)
and the engine core's source.
LLMD_PURE_PYTHON=1 at build time skips the mypyc compile.
"""

import json
import os
import runpy
import sys
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent
C_FLAGS = ["-O3", "-std=c11", "-Wall", "-Wno-unused-function"]
# setup.py commands that build extensions (PEP 517's build_wheel / build_editable run bdist_wheel / editable_wheel).
_BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}


def mypyc_extensions() -> list[Extension]:
    """The engine core's modules as mypyc extensions, and the digests of the sources they are built from; none where
    mypyc is missing or refuses the source (a type error): the Python source then runs, as before."""
    if not set(sys.argv[1:]) & _BUILDS:
        return []  # metadata only (pip's egg_info / dist_info hooks): the compile takes minutes, so only when it builds
    compiled = runpy.run_path(str(ROOT / "llmd" / "compiled.py"))
    why = ""
    if os.environ.get("LLMD_PURE_PYTHON") == "1":
        why = "LLMD_PURE_PYTHON=1"
    else:
        try:
            from mypyc.build import mypycify
        except ImportError:
            why = "mypyc not found"
    if not why:
        paths = [m.replace(".", "/") + ".py" for m in compiled["MODULES"]]
        try:
            exts = mypycify(
                ["--follow-imports=silent", "--ignore-missing-imports", *paths],
                opt_level="3",
                group_name=compiled["GROUP"],
            )
        except SystemExit as e:  # mypy's type errors end the compile with a message of their own
            why = f"mypyc did not compile it ({e})"
    if why:
        print(f"setup.py: {why}; the engine core runs from its Python source", file=sys.stderr)
        # An earlier build's extensions left in place (pip install -e . builds in the tree) would be its old code.
        for name in (*compiled["MODULES"], compiled["GROUP"] + "__mypyc"):
            base = ROOT / name.replace(".", "/")
            for suffix in compiled["_SUFFIXES"]:
                base.with_name(base.name + suffix).unlink(missing_ok=True)
        (ROOT / compiled["MANIFEST"]).unlink(missing_ok=True)
        return []
    for ext in exts:
        ext.optional = True  # a C compile that fails leaves the group incomplete: llmd.compiled runs the source
    # What they are built from, for llmd.compiled to tell an extension from an edited source.
    (ROOT / compiled["MANIFEST"]).write_text(json.dumps(compiled["digests"](), indent=1) + "\n")
    return exts


setup(
    ext_modules=[
        Extension("llmd.kv._kvnative", ["llmd/kv/_kvnative.c"], extra_compile_args=C_FLAGS, optional=True),
        Extension("llmd.kv._blockpickle", ["llmd/kv/_blockpickle.c"], extra_compile_args=C_FLAGS, optional=True),
        Extension(
            "llmd.engines.sim._blockpool", ["llmd/engines/sim/_blockpool.c"], extra_compile_args=C_FLAGS, optional=True
        ),
        Extension(
            "llmd.engines.sim._decodeplan",
            ["llmd/engines/sim/_decodeplan.c"],
            # line_times must round as Python does: no fused multiply-adds.
            extra_compile_args=[*C_FLAGS, "-ffp-contract=off"],
            optional=True,
        ),
        Extension("llmd.sim._tokens", ["llmd/sim/_tokens.c"], extra_compile_args=C_FLAGS, optional=True),
        Extension(
            "llmd.router.scheduling._chains",
            ["llmd/router/scheduling/_chains.c"],
            extra_compile_args=C_FLAGS,
            optional=True,
        ),
        Extension(
            "llmd.router.scheduling._fused",
            ["llmd/router/scheduling/_fused.c"],
            # The same floats as fused.py's numpy: no fused multiply-adds.
            extra_compile_args=[*C_FLAGS, "-ffp-contract=off"],
            optional=True,
        ),
        Extension("llmd.sim._loop", ["llmd/sim/_loop.c"], extra_compile_args=C_FLAGS, optional=True),
        Extension("llmd.sim._hugepages", ["llmd/sim/_hugepages.c"], extra_compile_args=C_FLAGS, optional=True),
        *mypyc_extensions(),
    ]
)
