"""Files keepstep ships beside its code: example training scripts, chaos scenarios, the CRD.

Where it sits: `keepstep files` lists them and prints where one is (`keepstep run ...
$(keepstep files mlp)`, `kubectl apply -f $(keepstep files trainjob)`). A shipped file is
named by its path in the repository (`examples/mlp.py`), wherever it lies:

- installed from a wheel, under `keepstep/_data/` (pyproject.toml maps the folders there,
  keeping their repository paths), found with importlib.resources;
- run from a checkout (PYTHONPATH, as scripts/env sets it), in the repository itself.

Both keep the repository's layout, so a relative path inside a shipped file (a scenario's
`script: examples/mlp.py`) names the same file under `root()` in either case.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from keepstep.errors import ConfigError, KeepstepError

# (folder, pattern): what is shipped, by repository path. pyproject.toml's package-data
# says the same for the wheel; tests/test_wheel.py checks that the two agree.
SHIPPED: tuple[tuple[str, str], ...] = (
    ("examples", "*.py"),
    ("e2e/scenarios", "*.yaml"),
    ("manifests/crd", "*.yaml"),
)
INSTALLED_FOLDER = "_data"  # inside the installed `keepstep` package


def root() -> Path:
    """The folder that shipped files' repository paths are relative to."""
    installed = resources.files("keepstep") / INSTALLED_FOLDER
    if isinstance(installed, Path) and installed.is_dir():
        return installed
    # agent/keepstep/resources.py -> the repository holding agent/
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / SHIPPED[0][0]).is_dir():
        return checkout
    raise KeepstepError(
        f"keepstep's shipped files are missing: neither {installed} nor a checkout at "
        f"{checkout} holds them; reinstall keepstep"
    )


def listing() -> list[str]:
    """Every shipped file's repository path, sorted."""
    base = root()
    return sorted(
        path.relative_to(base).as_posix()
        for folder, pattern in SHIPPED
        for path in (base / folder).glob(pattern)
        if path.is_file()
    )


def find(name: str) -> Path:
    """The shipped file `name`: its repository path (`examples/mlp.py`), file name
    (`mlp.py`) or stem (`mlp`). Anything else is a ConfigError that lists the choices."""
    names = listing()
    if name in names:
        return root() / name
    matches = [n for n in names if name in (n.rpartition("/")[2], Path(n).stem)]
    if len(matches) == 1:
        return root() / matches[0]
    if matches:
        raise ConfigError(f"shipped file {name!r} is ambiguous: {', '.join(matches)}")
    raise ConfigError(f"no shipped file {name!r}; shipped: {', '.join(names)}")
