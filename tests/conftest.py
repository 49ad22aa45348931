"""Shared fixtures: the tiny model, its tokenizer and the toy data, built once per test session.

``make tiny`` builds them into ``.cache/tiny``; when that holds a complete build of the current builder and
seed, the tests read it, otherwise they build their own copy in a temporary directory (never in the repo).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # `areal_hpc` and `tools` importable without installing

# No test may reach the network; the tiny model is built locally.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from tests.helpers import Toy  # noqa: E402
from tests.slurm import slurm_cluster, slurm_env  # noqa: E402, F401 (the fixtures of tests marked slurm)
from tools.build_tiny_model import TinyBuild, build, is_complete  # noqa: E402

TINY_SEED = 1
REPO_TINY_DIR = REPO_ROOT / ".cache" / "tiny"


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory: pytest.TempPathFactory) -> TinyBuild:
    """Paths of the tiny build: model_dir, train_path, test_path."""
    if is_complete(REPO_TINY_DIR, TINY_SEED):
        return TinyBuild(REPO_TINY_DIR)
    return build(tmp_path_factory.mktemp("tiny") / "build", seed=TINY_SEED)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_build: TinyBuild) -> Path:
    """A Hugging Face directory holding the tiny Qwen2 model and its tokenizer."""
    return tiny_build.model_dir


@pytest.fixture(scope="session")
def tiny_moe_dir(tiny_build: TinyBuild) -> Path:
    """A Hugging Face directory holding the tiny Qwen3-MoE model (8 experts, top 2) and the same tokenizer."""
    return tiny_build.moe_dir


@pytest.fixture
def plugins(monkeypatch):
    """tests/plugins (a user's code outside areal_hpc) importable here, in worker processes, and in the roles
    of a run (local or on the local Slurm: sbatch passes the environment on)."""
    folder = str(REPO_ROOT / "tests" / "plugins")
    monkeypatch.syspath_prepend(folder)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")])))


@pytest.fixture
def builtin_client(tiny_model_dir: Path):
    """A client of a built-in generation server (engine + HTTP on a thread of this process) on the tiny model."""
    import threading

    from areal_hpc.gen.backends.builtin.engine import Engine
    from areal_hpc.gen.backends.builtin.server import App, GenHTTPServer
    from areal_hpc.gen.client import GenClient

    engine = Engine(str(tiny_model_dir), seed=0, max_batch_size=8).start()
    httpd = GenHTTPServer(("127.0.0.1", 0), App(engine, {}), "test-token")
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield GenClient(f"http://127.0.0.1:{httpd.server_address[1]}", "test-token", timeout=120)
    httpd.shutdown()
    engine.stop()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    """The tiny model's tokenizer (shared by the session: do not mutate it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def toy_train_path(tiny_build: TinyBuild) -> Path:
    """JSONL file of the toy training questions."""
    return tiny_build.train_path


@pytest.fixture(scope="session")
def toy_test_path(tiny_build: TinyBuild) -> Path:
    """JSONL file of the held-out toy questions, disjoint from the training ones."""
    return tiny_build.test_path


@pytest.fixture
def toy(tmp_path: Path, tiny_build: TinyBuild) -> Toy:
    """The toy experiment with tiny batches, its runs under tmp_path (see tests/helpers.py)."""
    return Toy(tmp_path, tiny_build.model_dir, tiny_build.root / "data" / "easy")
