"""The wheel: `pip wheel .` holds the whole source tree, installs with its extras into clean
virtual environments, and works there without the checkout.

The fast tests read pyproject.toml against the source tree, so a package added to a folder
but not to the package map (or a shipped file kind missing from the package data) fails
in milliseconds. The slow ones build the wheel from a copy of the sources (the checkout
gets no build/ or egg-info), compare its files with the source tree, and install it into
virtual environments outside the checkout, each run from another directory with
PYTHONPATH unset:

- `[operator]`: installed for real from the index, pinned by requirements/lock.txt (kopf,
  kubernetes, etcd-sdk-python, protobuf); the operator's entry point imports, torch does not.
- `[train]`: every requirement installed for real from the lock except torch's own closure
  (torch, its CUDA libraries, triton, sympy, ...), which the environment sees through a .pth
  file of links to the dev environment's copies. That closure is ~4 GB unpacked: installing
  it again would take minutes and that much disk on every CI run, while what this test is
  about -- that the `[train]` extra names every other module keepstep imports -- holds the
  same. pip still checks torch's version against the extra and the lock. Then a 2-node
  `keepstep run` with a killed worker trains an example script shipped in the wheel.

pip reuses its cache (~/.cache/pip, filled when scripts/env built the dev environment), so
a warm machine downloads nothing; the slow tests take about two minutes in all.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from keepstep import resources

REPO = Path(__file__).resolve().parents[1]
CODE_ROOTS = ("elastic", "agent", "operator")  # each holds a keepstep/ folder
DATA = f"keepstep.{resources.INSTALLED_FOLDER}."
PIP_WHEEL = (sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation")
INSTALL = REPO / "scripts" / "install-locked"  # pip install -c requirements/lock.txt
LINKS = "torch-from-the-dev-environment"
SITE = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"


def setuptools_table() -> dict[str, object]:
    table: dict[str, object] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"][
        "setuptools"
    ]
    return table


def package_folder(package: str, package_dir: dict[str, str]) -> Path:
    """The folder setuptools builds `package` from: its nearest mapped ancestor's folder."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        mapped = package_dir.get(".".join(parts[:cut]))
        if mapped is not None:
            return REPO / mapped / Path(*parts[cut:])
    return REPO / Path(*parts)


def source_packages() -> set[str]:
    """Every folder of the three code trees (a package, or package data such as static/)."""
    found = {"keepstep"}
    for root in CODE_ROOTS:
        base = REPO / root
        for folder in (base / "keepstep").rglob("*"):
            if folder.is_dir() and folder.name != "__pycache__":
                found.add(".".join(folder.relative_to(base).parts))
    return found


def more_folders() -> set[str]:
    """setup.py's MORE_FOLDERS, read without running setup()."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MORE_FOLDERS":
            return set(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no MORE_FOLDERS")


def test_every_package_of_the_source_tree_is_in_the_package_map() -> None:
    table = setuptools_table()
    packages, package_dir = table["packages"], table["package-dir"]
    assert isinstance(packages, list) and isinstance(package_dir, dict)
    code = {p for p in packages if not p.startswith(DATA)}
    assert code == source_packages(), "pyproject.toml [tool.setuptools] packages is stale"
    for package in packages:
        assert package_folder(package, package_dir).is_dir(), package
    # `keepstep` itself is one folder in the map; setup.py adds the modules of the others.
    top = package_dir["keepstep"]
    assert more_folders() == {f"{root}/keepstep" for root in CODE_ROOTS} - {top}


def test_every_kind_of_shipped_file_is_package_data() -> None:
    table = setuptools_table()
    packages, package_dir, package_data = (
        table["packages"],
        table["package-dir"],
        table["package-data"],
    )
    assert isinstance(packages, list)
    assert isinstance(package_dir, dict) and isinstance(package_data, dict)
    shipped = {
        DATA + folder.replace("/", "."): (folder, glob) for folder, glob in resources.SHIPPED
    }
    assert {p for p in packages if p.startswith(DATA)} == set(shipped)
    for package, (folder, glob) in shipped.items():
        assert package_dir[package] == folder
        # Modules of a listed package are built without a package-data entry.
        assert glob == "*.py" or glob in package_data[package], package
    assert "examples/mlp.py" in resources.listing()
    assert resources.find("mlp") == resources.root() / "examples" / "mlp.py"


def expected_wheel_files() -> set[str]:
    """The source tree as the wheel must hold it: every file of the three code trees, and
    the shipped files under keepstep/_data/."""
    files = set()
    for root in CODE_ROOTS:
        base = REPO / root
        for path in (base / "keepstep").rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                files.add(path.relative_to(base).as_posix())
    data = f"keepstep/{resources.INSTALLED_FOLDER}"
    return files | {f"{data}/{name}" for name in resources.listing()}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built by pip from a copy of what pyproject.toml and setup.py name."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    table = setuptools_table()
    package_dir = table["package-dir"]
    assert isinstance(package_dir, dict)
    tops = {str(v).split("/")[0] for v in package_dir.values()} | set(CODE_ROOTS)
    for top in sorted(tops):
        shutil.copytree(REPO / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    # No build isolation: the dev environment's setuptools (pinned in the lock, and new
    # enough for pyproject.toml's build requirement) builds it, with nothing downloaded.
    subprocess.run(
        [*PIP_WHEEL, "-w", str(tmp / "dist"), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = (tmp / "dist").glob("keepstep-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_holds_the_source_tree(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        meta = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    files = {n for n in names if ".dist-info/" not in n}
    expected = expected_wheel_files()
    assert sorted(expected - files) == [], "missing from the wheel"
    assert sorted(files - expected) == [], "in the wheel but not in the source tree"
    text = meta.decode()
    assert "License-Expression: Apache-2.0" in text
    for extra in ("train", "operator", "dashboard"):
        assert f"Provides-Extra: {extra}" in text
    assert 'protobuf>=5.27.2; extra == "operator"' in text


def clean_env(venv: Path, **extra: str) -> dict[str, str]:
    """The environment of a user's shell with only `venv` active: no PYTHONPATH, nothing of
    the checkout or the dev environment on PATH."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    inside = (str(REPO), sys.prefix)
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not p.startswith(inside)]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    env["VIRTUAL_ENV"] = str(venv)
    env.update(extra)
    return env


def make_venv(where: Path) -> Path:
    """An empty virtual environment. This environment's pip installs into it (`pip
    --python`): no pip of its own to set up first, which took ~10 s."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120
    )
    return where


def pip_install(venv: Path, req: str, cwd: Path) -> None:
    """`req` into `venv` by the images' own install command (this environment's pip)."""
    env = clean_env(venv, PYTHON=sys.executable, PIP_PYTHON=str(venv / "bin" / "python"))
    done = subprocess.run(
        [str(INSTALL), req, "-q"],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=cwd,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def in_venv(
    venv: Path, cwd: Path, *argv: str, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=clean_env(venv, **env),
    )


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A working directory outside the checkout."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    assert not cwd.resolve().is_relative_to(REPO)
    return cwd


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_operator_extra_installs_without_torch(
    wheel: Path, tmp_path: Path, elsewhere: Path
) -> None:
    venv = make_venv(tmp_path / "venv")
    pip_install(venv, f"{wheel}[operator]", elsewhere)
    done = in_venv(venv, elsewhere, "python", "-c", "import keepstep.operator.__main__")
    assert done.returncode == 0, done.stderr
    probe = "import importlib.util as u; print(u.find_spec('torch') is None)"
    assert in_venv(venv, elsewhere, "python", "-c", probe).stdout.strip() == "True"
    version = in_venv(venv, elsewhere, "keepstep", "--version")
    assert version.stdout.strip() == f"keepstep {metadata_version(wheel)}", version.stderr
    crd = in_venv(venv, elsewhere, "keepstep", "files", "trainjob").stdout.strip()
    assert crd.startswith(str(venv)) and "kind: CustomResourceDefinition" in Path(crd).read_text()
    # A command that needs the train extra says which extra, instead of a traceback.
    run = in_venv(venv, elsewhere, "keepstep", "selfcheck", "--ranks", "1", "--steps", "1")
    assert run.returncode == 1 and "pip install 'keepstep[train]'" in run.stderr, run.stderr


def metadata_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def torch_closure() -> list[metadata.Distribution]:
    """torch and everything it requires (extras and markers applied), from this
    environment."""
    found: dict[str, metadata.Distribution] = {}
    todo = [Requirement("torch")]
    while todo:
        req = todo.pop()
        key = canonicalize_name(req.name)
        if key in found and not req.extras:
            continue
        dist = found.setdefault(key, metadata.distribution(req.name))
        for text in dist.requires or ():
            sub = Requirement(text)
            extras = {""} | set(req.extras)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return list(found.values())


def link_torch(venv: Path) -> None:
    """Show the venv torch's closure from this environment: links in a folder that a .pth
    file puts on its path (see the module docstring for why it is not installed again)."""
    site = venv / SITE
    present = {
        canonicalize_name(d.metadata["Name"]) for d in metadata.distributions(path=[str(site)])
    }
    links = venv / LINKS
    links.mkdir()
    for dist in torch_closure():
        if canonicalize_name(dist.metadata["Name"]) in present:
            continue
        for top in {f.parts[0] for f in dist.files or () if f.parts[0] != ".."}:
            if top == "__pycache__" or top.endswith(".pth") or (links / top).exists():
                continue
            (links / top).symlink_to(Path(str(dist.locate_file(top))).resolve())
    (site / "keepstep-test-torch.pth").write_text(f"{links}\n")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_train_extra_runs_a_job_with_a_fault(
    wheel: Path, tmp_path: Path, elsewhere: Path, etcd_binary: str
) -> None:
    venv = make_venv(tmp_path / "venv")
    link_torch(venv)
    pip_install(venv, f"{wheel}[train]", elsewhere)
    where = in_venv(venv, elsewhere, "python", "-c", "import keepstep; print(keepstep.__file__)")
    assert where.stdout.startswith(str(venv / SITE)), where.stdout + where.stderr
    torch = "import importlib.util as u; print(u.find_spec('torch').origin)"
    linked = in_venv(venv, elsewhere, "python", "-c", torch).stdout
    assert linked.startswith(str(venv / LINKS)), linked  # pip did not install torch again
    assert in_venv(venv, elsewhere, "keepstep", "--version").stdout.startswith("keepstep 0.")
    script = in_venv(venv, elsewhere, "keepstep", "files", "examples/mlp.py").stdout.strip()
    assert script.startswith(str(venv / SITE))
    run_dir = elsewhere / "run"
    run = in_venv(
        venv,
        elsewhere,
        "keepstep",
        "run",
        "--nnodes",
        "2",
        "--global-batch",
        "16",
        "--micro-batch",
        "4",
        "--steps",
        "12",
        "--fault",
        "kill-worker:1@step=4",
        "--run-dir",
        str(run_dir),
        "--timeout",
        "150",
        script,
        "--sleep",
        "0.05",
        timeout=180,
        KEEPSTEP_ETCD_BIN=etcd_binary,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["params_sha256"]
    assert [r["cause"] for r in summary["recoveries"]][:1] == ["kill-worker"]
    assert summary["samples"]["lost"] == 0 and summary["samples"]["duplicated"] == 0


def build_inputs() -> set[str]:
    """What `pip install .` reads: the build files and every folder of the package map."""
    table = setuptools_table()
    package_dir = table["package-dir"]
    assert isinstance(package_dir, dict)
    folders = {str(v) for v in package_dir.values()} | more_folders()
    inputs = {"pyproject.toml", "setup.py", "README.md", "requirements/lock.txt"}
    return inputs | {"scripts/install-locked"} | {f.split("/keepstep")[0] for f in folders}


@pytest.mark.parametrize("name", ["agent.Dockerfile", "operator.Dockerfile"])
def test_the_images_copy_what_the_build_reads(name: str) -> None:
    lines = (REPO / "manifests" / "docker" / name).read_text().splitlines()
    install = next(
        i for i, line in enumerate(lines) if "install-locked" in line and "COPY" not in line
    )
    copied = {
        src.rstrip("/")
        for line in lines[:install]
        if line.startswith("COPY ")
        for src in line.split()[1:-1]
    }
    missing = {
        p for p in build_inputs() if not any(p == c or p.startswith(c + "/") for c in copied)
    }
    assert missing == set()


def test_the_images_start_from_one_base_pinned_by_digest() -> None:
    bases = set()
    for name in ("agent.Dockerfile", "operator.Dockerfile"):
        text = (REPO / "manifests" / "docker" / name).read_text()
        pins = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.MULTILINE)
        assert len(pins) == 1 and "FROM ${PYTHON_IMAGE}" in text.splitlines(), name
        assert re.fullmatch(r"python:[\w.-]+@sha256:[0-9a-f]{64}", pins[0]), pins[0]
        assert not [ln for ln in text.splitlines() if ln.startswith("RUN pip install")], name
        bases.add(pins[0])
    assert len(bases) == 1, bases
