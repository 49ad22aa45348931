"""The import graph follows the data flow (docs/architecture.md): a stage imports only stages below it, through
their public surface (the stage's `__init__`), and the launcher imports no worker stage. Roles and backends
are named by module in tables; every name there must import and have its entry point."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from areal_hpc.config import GEN_BACKENDS, TRAIN_BACKENDS
from areal_hpc.launch.roles import ROLES

PACKAGE = Path(__file__).resolve().parents[1] / "areal_hpc"
# Lowest first. A stage may import the stages of lower layers; stages of one layer know nothing of each other.
LAYERS = (
    ("alloc",),
    ("config",),
    ("control",),
    ("algo", "data", "monitor"),
    ("weights", "recover", "reward"),
    ("agent",),
    ("gen", "train"),
    ("eval",),
    ("master",),
    ("launch",),
    ("cli",),
)
LAYER = {stage: i for i, layer in enumerate(LAYERS) for stage in layer}
WORKERS = ("master", "gen", "train")  # the stages of the roles: started by the launcher, never imported by it


def stage_of(module: str) -> str:
    return module.split(".")[1]


def imports() -> list[tuple[str, int, str]]:
    """(file, line, imported module) of every import of areal_hpc inside the package, in functions too."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("areal_hpc"):
                names = (
                    [f"{node.module}.{a.name}" for a in node.names]
                    if node.module == "areal_hpc"
                    else [node.module]
                )
                out += [(str(path.relative_to(PACKAGE.parent)), node.lineno, name) for name in names]
            elif isinstance(node, ast.Import):
                rel = str(path.relative_to(PACKAGE.parent))
                out += [(rel, node.lineno, a.name) for a in node.names if a.name.startswith("areal_hpc.")]
    return out


def module_of(file: str) -> str:
    return file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def test_every_module_belongs_to_a_stage_of_the_layers():
    files = [p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"]
    stages = {stage_of(module_of(str(p.relative_to(PACKAGE.parent)))) for p in files}
    assert stages <= set(LAYER), f"stages missing from LAYERS: {sorted(stages - set(LAYER))}"


def test_imports_run_down_the_layers_through_public_surfaces():
    wrong = []
    for file, line, target in imports():
        here, there = stage_of(module_of(file)), stage_of(target)
        if here == there:
            continue
        if LAYER[there] >= LAYER[here]:
            wrong.append(f"{file}:{line}: {here} imports {target}, of a stage at or above its layer")
        elif here in ("launch", "cli") and there in WORKERS:
            wrong.append(f"{file}:{line}: {here} imports {target}; roles are started by module name (ROLES)")
        elif target.count(".") > 1:
            wrong.append(f"{file}:{line}: {target} is not the public surface of {there} (areal_hpc.{there})")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("role, module", sorted(ROLES.items()))
def test_each_role_has_its_entry_point_in_its_stage(role, module):
    assert stage_of(module) in ("master", "gen", "train")
    assert callable(importlib.import_module(module).run)


@pytest.mark.parametrize("name", sorted(GEN_BACKENDS))
def test_each_generation_backend_has_a_start(name):
    assert callable(importlib.import_module(GEN_BACKENDS[name].module).start)


@pytest.mark.parametrize("name", sorted(TRAIN_BACKENDS))
def test_each_training_backend_has_an_engine(name):
    assert callable(importlib.import_module(TRAIN_BACKENDS[name].module).Engine)


def test_only_rundir_names_the_paths_of_a_run_directory():
    from areal_hpc.control import RunDir

    run = RunDir(Path("/run"))
    paths = [run.config, run.status, run.finished, run.progress, run.start_point, run.published_version]
    paths += [run.ledger, run.heartbeats, run.mailboxes, run.gen_servers, run.dist_init, run.rollouts]
    paths += [run.checkpoints, run.stats, run.failed_attempts, run.jobs, run.launcher]
    names = {p.name for p in paths}
    spelled = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "rundir.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert not spelled, "\n".join(spelled)
