"""A newcomer's first steps outside the happy path: the Docker image's file set
starts a server, and serving without the optional Ray extra says what to install."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from bench.servers import StallfreeServer

ROOT = Path(__file__).resolve().parent.parent
WITHOUT_RAY = "import sys; sys.modules['ray'] = None; from cli import main; sys.exit(main(sys.argv[1:]))"


def test_replicas_without_ray_say_which_extra_to_install():
    for flags in (["--replicas", "2"], ["--disaggregate", "1:1"]):
        out = subprocess.run(
            [sys.executable, "-c", WITHOUT_RAY, "serve", "--sim", *flags],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert out.returncode == 2, out.stderr
        assert "pip install 'stallfree[scale]'" in out.stderr and "Traceback" not in out.stderr


def test_a_single_machine_server_needs_no_ray():
    out = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['ray'] = None; import cli, gateway.app, core.build"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in dependencies if d.startswith("ray")]


def copied_paths(dockerfile: str) -> list[str]:
    """Every source of the Dockerfile's COPY lines."""
    paths = []
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            paths += line.split()[1:-1]
    return paths


def test_the_image_copies_every_package_and_can_build_the_kernels():
    dockerfile = (ROOT / "Dockerfile").read_text()
    copied = copied_paths(dockerfile)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # the wheel's one root and the folders it links (stallfree/cli -> ../cli, ...)
    (root,) = (p.rstrip("*") for p in config["tool"]["setuptools"]["packages"]["find"]["include"])
    packages = [root, *sorted(p.name for p in (ROOT / root).iterdir() if p.is_symlink())]
    entry = config["project"]["scripts"]["stallfree"].split(":")[0].removeprefix(root + ".").split(".")[0]
    assert entry in packages
    assert set(packages) | {"web", "pyproject.toml", "README.md"} <= set(copied), copied
    assert re.search(r"apt-get install[^\n]*\bg\+\+", dockerfile), "the CPU kernels need a C++ compiler"


def dockerignored(directory: str, names: list[str]) -> set[str]:
    """The names .dockerignore leaves out of directory (its patterns: paths, and **/name)."""
    patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    relative = Path(directory).relative_to(ROOT)
    return {
        name
        for name in names
        for pattern in patterns
        if fnmatch.fnmatch(str(relative / name), pattern) or fnmatch.fnmatch(name, pattern.removeprefix("**/"))
    }


@pytest.mark.slow
def test_the_image_file_set_starts_a_server(tmp_path):
    """What the image copies, alone in a directory, serves a completion (no Docker engine runs here)."""
    for path in copied_paths((ROOT / "Dockerfile").read_text()):
        source = ROOT / path
        if source.is_dir():
            shutil.copytree(source, tmp_path / path, ignore=dockerignored, symlinks=True)
        else:
            shutil.copy(source, tmp_path / path)
    assert not (tmp_path / "bench" / "peers").exists()
    server = StallfreeServer("--sim", checkout=tmp_path)
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(server.url + "/", timeout=10).status_code == 200  # the dashboard, from web/
    finally:
        server.stop()
    where = "import stallfree.cli as a, stallfree.core as b, stallfree.gateway as c, stallfree.kernels as d\n"
    where += "print(a.__file__, b.__file__, c.__file__, d.__file__)"
    files = subprocess.run([sys.executable, "-c", where], capture_output=True, text=True, cwd=tmp_path).stdout.split()
    assert len(files) == 4 and all(f.startswith(str(tmp_path)) for f in files), files  # not this checkout's


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--disaggregate", "1:1"], "--replicas and --disaggregate are exclusive"),
        # --token-budget auto measures this process's model: with replicas it is refused, not ignored
        (["--token-budget", "auto"], "need a local engine"),
    ],
)
def test_replicas_refuse_what_they_cannot_serve(flags, why):
    out = subprocess.run(
        [sys.executable, "-m", "stallfree.cli", "serve", "--sim", "--replicas", "2", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 2 and why in out.stderr, out.stderr
