"""The one build step pyproject.toml cannot declare: `keepstep`'s own modules span folders.

Where it sits: `pip wheel .` runs setuptools with the package map of pyproject.toml, where
the package `keepstep` is elastic/keepstep (its `__init__.py` and `errors.py`). Its other
top-level modules (`cli.py`, `__main__.py`, `resources.py`) live in agent/keepstep, and
setuptools maps a package to one folder, so `build_py` adds them here. Two modules of the
same name in two folders would make the wheel depend on order: that fails the build.
tests/test_wheel.py checks the wheel's contents against the source tree.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# The other folders that hold top-level modules of the `keepstep` package.
SPLIT_PACKAGE = "keepstep"
MORE_FOLDERS = ("agent/keepstep", "operator/keepstep")


class BuildPy(build_py):
    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules: list[tuple[str, str, str]] = super().find_package_modules(package, package_dir)
        if package != SPLIT_PACKAGE:
            return modules
        seen = {module: path for _, module, path in modules}
        for folder in MORE_FOLDERS:
            for path in sorted(Path(folder).glob("*.py")):
                if path.stem in seen:
                    raise RuntimeError(
                        f"module {package}.{path.stem} is both {seen[path.stem]} and {path}"
                    )
                seen[path.stem] = str(path)
                modules.append((package, path.stem, str(path)))
        return modules


setup(cmdclass={"build_py": BuildPy})
