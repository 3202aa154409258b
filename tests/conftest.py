import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"  # the folder the smoke task reads


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The repository's offline fixtures, written by the same code as `resadapt-eval fixtures`."""
    from resadapt_eval.fixtures import ensure_fixtures

    return ensure_fixtures(FIXTURES)


@pytest.fixture(scope="session")
def adapters(fixtures_dir):
    from resadapt_eval.backbones.qwen import ADAPTERS

    return {name: cls.from_pretrained(str(fixtures_dir / name), dtype="float32") for name, cls in ADAPTERS.items()}


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a module of tiny-tensor tests: much faster, and steadier on a
    shared 2-core machine, than several (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
