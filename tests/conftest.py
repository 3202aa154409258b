import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# submitit's import runs logging.config.dictConfig, which closes every logging handler that exists at
# that moment. A handler an earlier test added on pytest's per-test capture stream (absl's, imported
# with rouge-score) would then close the capture of whichever test first imports submitit, and every
# later test in that process errors. Imported once here, before any test, it closes nothing of theirs.
import submitit  # noqa: E402, F401

from .helpers import FIXTURES  # noqa: E402


def locked_fixtures(out: Path) -> Path:
    """`ensure_fixtures(out)` under a file lock in `out`: with pytest-xdist several workers start at once,
    and one writes the fixtures while the others wait, then find them complete."""
    from filelock import FileLock

    from resadapt_eval.fixtures import ensure_fixtures

    out.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out / ".write.lock")):
        return ensure_fixtures(out)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The repository's offline fixtures, written by the same code as `resadapt-eval fixtures`."""
    return locked_fixtures(FIXTURES)


@pytest.fixture(scope="session")
def adapters(fixtures_dir):
    from resadapt_eval.backbones.qwen import ADAPTERS

    return {name: cls.from_pretrained(str(fixtures_dir / name), dtype="float32") for name, cls in ADAPTERS.items()}


@pytest.fixture(scope="module")
def eager_adapters(fixtures_dir):
    """The tiny backbones with eager attention: the attention maps the pruning rules are checked against,
    and the score matmuls FlopCounterMode sees (CPU SDPA it does not). One per module, as each module's
    hooks and caches are its own."""
    from resadapt_eval.backbones.qwen import ADAPTERS

    return {
        name: cls.from_pretrained(str(fixtures_dir / name), dtype="float32", attn_implementation="eager")
        for name, cls in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def text_models(fixtures_dir):
    """Each tiny backbone's decoder stack in float64 with eager attention and its first prunable layer
    (`helpers.build_text_models`), for the fidelity tests of stages inside the LLM."""
    from .helpers import build_text_models

    return build_text_models(fixtures_dir)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a module of tiny-tensor tests: much faster, and steadier on a
    shared 2-core machine, than several (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
