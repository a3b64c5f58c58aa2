"""The build's one hook: a built package carries the kernel sources and the benchmark script.

``kernels_cu/`` and ``benchmarks/bench.py`` live at the top of the repository, where a checkout and
an editable install read them (``cupyflash._compile.kernel_dir``, ``cupyflash.__main__.BENCH_SCRIPTS``).
A wheel gets copies inside the package, at ``cupyflash/kernels_cu/`` and
``cupyflash/benchmarks/bench.py``. They are not declared as packages mapped from those folders
(``package_dir``): with a mapping, setuptools installs an editable checkout through an import hook
that Python consults after the current folder, so ``python -m cupyflash`` run beside a checkout
named ``cupyflash`` would import that folder as an empty namespace package. Without one the
editable install is a plain path entry to the checkout. Everything else is in setup.cfg.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# (folder in the repository, the files taken from it, their folder in the built package)
SHIPPED = (("kernels_cu", ("*.cu", "*.cuh"), "cupyflash/kernels_cu"),
           ("benchmarks", ("bench.py",), "cupyflash/benchmarks"))


class BuildPyWithSources(build_py):
    """``build_py``, then the ``SHIPPED`` files copied into the build (not for an editable install,
    which reads them in the checkout)."""

    def run(self):
        super().run()
        if self.editable_mode:
            return
        for folder, patterns, target in SHIPPED:
            sources = sorted(p for pattern in patterns for p in (ROOT / folder).glob(pattern))
            if not sources:
                raise FileNotFoundError(f"no {' or '.join(patterns)} in {ROOT / folder}: the package would ship "
                                        f"without {target}")
            self.mkpath(str(Path(self.build_lib, target)))
            for source in sources:
                self.copy_file(str(source), str(Path(self.build_lib, target, source.name)))


setup(cmdclass={"build_py": BuildPyWithSources})
