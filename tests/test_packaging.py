"""A wheel, installed as the README says (not editable), runs without the checkout: the sbatch template and every
other file the package reads at run time travel inside it."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from areal_hpc.config.docs import render_markdown
from tests.helpers import REPO_ROOT


def copy_source(dest: Path) -> Path:
    """The checkout without its caches and builds: the wheel is built there, so the checkout is left as it is."""

    def ignored(folder: str, names: list[str]) -> set[str]:
        top = Path(folder) == REPO_ROOT
        return {
            n
            for n in names
            if n.startswith(".")
            or n.endswith(".egg-info")
            or n == "__pycache__"
            or (top and n in {"build", "dist", "runs"})
        }

    shutil.copytree(REPO_ROOT, dest, symlinks=True, ignore=ignored)
    return dest


def build_wheel(src: Path, out: Path) -> Path:
    """Offline: setuptools of this environment, no index."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", str(src), "-w", str(out)],
        check=True,
    )
    (wheel,) = out.glob("areal_hpc-*.whl")
    return wheel


def fresh_venv(venv: Path, wheel: Path) -> Path:
    """A venv holding the wheel; the dependencies come from this environment's site-packages by a .pth file, which
    only appends them to sys.path: the editable install's finder there is not loaded, so it cannot shadow the wheel."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "--python", str(python)]
    # Installed before the .pth exists, so that pip does not see (and replace) this environment's areal_hpc.
    subprocess.run([*pip, "install", "--no-deps", "--no-index", str(wheel)], check=True)
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "areal_hpc_test_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return venv / "bin"


def test_wheel_install_renders_a_dry_run_outside_the_checkout(tmp_path, toy):
    wheel = build_wheel(copy_source(tmp_path / "src"), tmp_path / "dist")
    # The venv and the working folder lie in a git repository of their own, as a user's project may.
    elsewhere = tmp_path / "project"
    elsewhere.mkdir()
    git = ["git", "-C", str(elsewhere), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "a user's project"], check=True)
    bin_dir = fresh_venv(elsewhere / "venv", wheel)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}

    def run(*args: str) -> str:
        done = subprocess.run(args, cwd=elsewhere, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert run(str(bin_dir / "python"), "-c", "import areal_hpc; print(areal_hpc.__file__)").startswith(
        str(bin_dir.parent)
    )
    config = str(REPO_ROOT / "configs" / "toy-cpu.yaml")
    dry_run = run(str(bin_dir / "areal-hpc"), "submit", "--dry-run", config, *toy.overrides("wheel", 1))
    assert "#!/bin/bash\n" in dry_run and "srun " in dry_run
    # The version is the package's alone: the git repository around the venv is not the package's source.
    assert f"#SBATCH --comment=areal_hpc-{metadata.version('areal_hpc')}\n" in dry_run
    # No checkout's docs/ beside the package: the reference goes to the current folder, and says so.
    assert "using config.md in the current folder" in run(str(bin_dir / "areal-hpc"), "config", "docs")
    assert (elsewhere / "config.md").read_text() == render_markdown()
