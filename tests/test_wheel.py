"""The installed wheel: one import root, ``stallfree``, and nothing generic in
site-packages, so stallfree installs beside PyPI's own ``kernels`` (or
``core``, ``loadtest``, ...) without shadowing it or being shadowed; and the
dashboard inside it, served at ``/`` from where the package finds it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (
    "pyproject.toml",
    "README.md",
    "stallfree",
    "cli",
    "core",
    "gateway",
    "kernels",
    "loadtest",
    "scaleout",
    "web",
)


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of a copy of the sources (a build in the checkout would leave build/ there)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp_path / "dist", src],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("stallfree-*.whl")
    return wheel


@pytest.mark.slow
def test_the_wheel_installs_one_root_beside_another_kernels_package(tmp_path: Path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"stallfree", wheel.name.split("-py3")[0] + ".dist-info"}
    assert any(n.startswith("stallfree/kernels/csrc/") and n.endswith(".cpp") for n in names)
    assert {"stallfree/web/index.html", "stallfree/web/app.js", "stallfree/web/vendor/uplot.iife.min.js"} <= set(names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(python)]
    subprocess.run([*pip, "install", "--no-deps", "--no-index", wheel], check=True, capture_output=True)
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    other = site / "kernels"  # a package of that name from another distribution
    other.mkdir()
    (other / "__init__.py").write_text('WHO = "another distribution"\n')
    # stallfree's dependencies (torch, starlette, ...) from this environment, after the fresh one's own
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    probe = (
        "import kernels, stallfree.kernels, stallfree.gateway.app, stallfree.cli\n"
        "print(kernels.WHO)\n"
        "print(stallfree.kernels.__file__)\n"
        "print(stallfree.gateway.app.__file__)\n"
        # the directory create_app serves at /, as it serves it
        "from starlette.staticfiles import StaticFiles\n"
        "from starlette.testclient import TestClient\n"
        "from stallfree.gateway.observe.dashboard import WEB_DIR\n"
        "page = TestClient(StaticFiles(directory=WEB_DIR, html=True)).get('/')\n"
        "print(WEB_DIR, page.status_code, 'app.js' in page.text)\n"
    )
    out = subprocess.run([python, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    who, ours, app, dashboard = out.stdout.splitlines()
    assert who == "another distribution"
    assert ours == str(site / "stallfree" / "kernels" / "__init__.py")
    assert app == str(site / "stallfree" / "gateway" / "app.py")
    assert dashboard == f"{site / 'stallfree' / 'web'} 200 True"
    help_ = subprocess.run([venv / "bin" / "stallfree", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert help_.returncode == 0 and "serve" in help_.stdout, help_.stderr
