"""Who may import whom, checked in fresh interpreters.

The rules: ``kernels`` imports only torch and triton; ``core`` may import
``kernels``, but ``core.sched``, ``core.analysis`` and ``core.cluster`` import
no torch; ``gateway`` may import ``core``; nothing imports ``gateway`` but
``cli`` and ``scaleout``; ``stallfree plan`` and ``simulate`` run without torch.
Modules are named here without their ``stallfree.`` root.

Each check imports a module in a new subprocess with an import hook that
records which of our modules first pulled in a forbidden package, so a
violation names its culprit: the scheduler decides and never loads torch,
the gateway's app never loads torch, ``kernels`` never loads core or the
gateway, and ``stallfree plan``/``simulate`` run without torch.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs in the subprocess: import (or run) the target, then print every
# forbidden package that got imported and the first of our modules on the
# stack when it did.
_PROBE = """
import importlib, inspect, sys
forbidden, targets, argv = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3:]
culprits = {}
current = None
def short(name):
    return name.removeprefix("stallfree.")
class Watch:
    def find_spec(self, name, path=None, target_=None):
        top = short(name).split(".")[0]
        if top in forbidden and top not in culprits:
            ours = [short(f.frame.f_globals.get("__name__", "")) for f in inspect.stack()]
            ours = [m for m in ours if m.split(".")[0] in ("core", "gateway", "kernels", "cli", "bench")]
            culprits[top] = (current, ours[0] if ours else "?")
        return None
sys.meta_path.insert(0, Watch())
for current in targets:
    module = importlib.import_module("stallfree." + current)
if argv:
    assert module.main(argv) == 0
for name, (target, who) in sorted(culprits.items()):
    print(f"layering: {target} -> {name} (imported by {who})")
"""


def violations(
    targets: str | list[str], forbidden: tuple[str, ...], argv: tuple[str, ...] = (), root: Path = ROOT
) -> list[str]:
    """Forbidden packages that importing the targets in turn (then the last one's
    ``main(argv)``) loads, in one fresh interpreter: none for all of them means
    none for each; a hit names the target being imported and our module that did it."""
    targets = [targets] if isinstance(targets, str) else targets
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(forbidden), ",".join(targets), *argv],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return [line.removeprefix("layering: ") for line in out.stdout.splitlines() if line.startswith("layering: ")]


def modules(package: str, root: Path = ROOT) -> list[str]:
    folder = root / package.replace(".", "/")
    return sorted(
        ".".join(p.relative_to(root).with_suffix("").parts) for p in folder.rglob("*.py") if p.name != "__init__.py"
    )


def test_scheduler_package_imports_no_torch_and_no_gateway():
    assert violations(modules("core.sched"), ("torch", "gateway", "kernels")) == []


def test_analysis_package_imports_no_torch():
    """The planner, simulator and cost model run where torch is not installed."""
    assert violations(modules("core.analysis"), ("torch", "gateway")) == []


def test_routers_import_no_torch_and_no_ray():
    """The routers run in the simulator and in the gateway process alike."""
    assert violations(modules("core.cluster"), ("torch", "ray", "gateway", "kernels")) == []


def test_plan_and_simulate_commands_run_without_torch():
    assert violations("cli", ("torch",), ("plan", "--json")) == []
    assert violations("cli", ("torch",), ("plan", "--disaggregate", "1:1", "--json")) == []
    assert violations("cli", ("torch",), ("simulate", "--scenario", "burst", "--json")) == []
    assert violations("cli", ("torch",), ("simulate", "--replicas", "2", "--conversations", "2", "--json")) == []
    assert violations("cli", ("torch",), ("simulate", "--disaggregate", "1:1", "--json")) == []


def test_scaleout_imports_no_torch_until_a_replica_builds_its_engine():
    """The gateway's side of scale-out (router, board, remote) runs in the torch-free gateway."""
    assert violations(modules("scaleout"), ("torch", "kernels")) == []


def test_gateway_app_imports_no_torch():
    """Nor does the gateway's process when the engine runs in its own: it loads the tokenizer alone."""
    targets = ["gateway.app", "gateway.engine.client", "gateway.engine.process", "core.model.embedded", "cli.serve"]
    assert violations(targets, ("torch", "kernels")) == []


def test_kernels_import_neither_core_nor_gateway():
    assert violations("kernels", ("core", "gateway", "cli")) == []


def absolute_imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every absolute import in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def test_core_imports_no_gateway_and_no_event_loop():
    """Core runs on the step thread: no module of it imports asyncio or anyio
    itself (libraries such as structlog may), nor anything of the gateway."""
    for path in sorted((ROOT / "core").rglob("*.py")):
        for _, name in absolute_imports(path):
            name = name.removeprefix("stallfree.")
            assert name.split(".")[0] not in ("asyncio", "anyio", "gateway", "cli"), f"{path}: imports {name}"
    assert violations("core.build", ("gateway", "cli")) == []


def test_the_check_catches_torch_added_to_the_scheduler(tmp_path: Path):
    """What a maintainer adding ``import torch`` to the scheduler would see."""
    for package in ("core", "kernels"):
        shutil.copytree(ROOT / package, tmp_path / "stallfree" / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "stallfree" / "__init__.py", tmp_path / "stallfree")
    scheduler = tmp_path / "stallfree" / "core" / "sched" / "scheduler.py"
    scheduler.write_text(scheduler.read_text().replace("import itertools\n", "import itertools\n\nimport torch\n", 1))
    found = violations("core.sched.engine", ("torch",), root=tmp_path)
    assert found == ["core.sched.engine -> torch (imported by core.sched.scheduler)"]


# The scheduler alone changes a request's progress (as in vLLM v1).
PROGRESS = {"num_computed_tokens", "status", "finish_reason", "output_token_ids"}
PROGRESS_WRITERS = {
    "core/sched/scheduler.py": "the scheduler",
    "core/sched/append.py": "the scheduler's appending of drawn tokens (Scheduler.update calls it, nothing else)",
    "core/analysis/profiler.py": "requests built only to time the runner, never scheduled",
    "scaleout/remote.py": "the gateway's stand-in for engines on replicas ends what a lost replica held",
}


def progress_writes(root: Path, packages: tuple[str, ...]) -> list[str]:
    """file:line of every write to a request's progress fields (by the names requests go by)."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign):
                    targets = [t for target in node.targets for t in getattr(target, "elts", [target])]
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    targets = [node.target]
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("append", "extend", "pop", "clear")
                ):
                    targets = [node.func.value]
                if any(isinstance(t, ast.Attribute) and t.attr in PROGRESS and _a_request(t.value) for t in targets):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def _a_request(node: ast.expr) -> bool:
    """``req``, ``request`` or ``<x>.request``: how the code names a Request (a Delta's
    or a RequestOutput's finish_reason is no request's progress)."""
    if isinstance(node, ast.Name):
        return node.id in ("req", "request")
    return isinstance(node, ast.Attribute) and node.attr == "request"


def test_only_the_scheduler_changes_a_requests_progress():
    packages = ("core", "gateway", "scaleout", "cli", "loadtest", "kernels")
    writes = progress_writes(ROOT, packages)
    assert {w.split(":")[0] for w in writes} <= set(PROGRESS_WRITERS), writes


def test_the_progress_check_catches_a_runner_that_advances_a_request(tmp_path: Path):
    runner = tmp_path / "core" / "model" / "runner.py"
    runner.parent.mkdir(parents=True)
    runner.write_text("def execute(item):\n    item.request.num_computed_tokens += item.num_tokens\n")
    assert progress_writes(tmp_path, ("core",)) == ["core/model/runner.py:2"]


def short_imports(root: Path, folders: tuple[str, ...]) -> list[str]:
    """file:line of every import of ours by a name outside the ``stallfree`` root
    (``import kernels``, ``from core.sched ...``): in a checkout it would load the
    module a second time under another name; installed, it would find another
    distribution's package of that name."""
    return [
        f"{path.relative_to(root)}:{line}"
        for folder in folders
        for path in sorted((root / folder).rglob("*.py"))
        for line, name in absolute_imports(path)
        if name.split(".")[0] in ROOTED
    ]


ROOTED = ("cli", "core", "gateway", "kernels", "loadtest", "scaleout")


def test_everything_imports_the_product_by_its_one_root():
    linked = sorted(p.name for p in (ROOT / "stallfree").iterdir() if p.is_symlink())
    assert linked == sorted((*ROOTED, "web"))  # web/: the dashboard's files, package data, not imported
    benchmarks = tuple(f"bench/{p.name}" for p in (ROOT / "bench").iterdir() if (p / "__init__.py").exists())
    assert short_imports(ROOT, (*ROOTED, "tests", *benchmarks)) == []


def test_the_root_check_catches_a_short_import(tmp_path: Path):
    module = tmp_path / "gateway" / "app.py"
    module.parent.mkdir()
    module.write_text("from stallfree.core import faults\nimport kernels\n")
    assert short_imports(tmp_path, ("gateway",)) == ["gateway/app.py:2"]
