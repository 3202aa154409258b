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


def report_sweep_folder(config) -> Path:
    """Where the session's report sweep goes: a folder every pytest-xdist worker of the session shares
    (the parent of a worker's base temporary folder)."""
    base = config._tmp_path_factory.getbasetemp()  # pytest's tmp_path_factory, before any fixture exists
    return (base.parent if hasattr(config, "workerinput") else base) / "report_sweep"


REPORT_SWEEP_RUN = pytest.StashKey()  # the background sweep this process started, if any


def pytest_collection_modifyitems(session, config, items):
    """Start the report sweep (`REPORT_GRID`) in the background as soon as the session knows a test reads
    it, so that no worker sits waiting for it later: the first worker to get here starts it, under a lock."""
    if not any("report_sweep" in getattr(item, "fixturenames", ()) for item in items):
        return
    import shlex
    import subprocess

    from filelock import FileLock

    from .helpers import REPO, REPORT_GRID, sweep_cmd

    out = report_sweep_folder(config)
    locked_fixtures(FIXTURES)  # the sweep's card reads the tiny checkpoints
    with FileLock(str(out.parent / "report_sweep.lock")):
        if (out.parent / "report_sweep.log").exists():
            return
        command = shlex.join(sweep_cmd(out, **REPORT_GRID))
        ended = f"touch {out.parent / 'report_sweep.done'} || touch {out.parent / 'report_sweep.failed'}"
        log = (out.parent / "report_sweep.log").open("w")
        config.stash[REPORT_SWEEP_RUN] = subprocess.Popen(
            ["sh", "-c", f"{command} && {ended}"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )


def pytest_sessionfinish(session):
    """A background report sweep still running when the session ends (an interrupted run) ends with it."""
    run = session.config.stash.get(REPORT_SWEEP_RUN, None)
    if run is not None and run.poll() is None:
        run.terminate()
        run.wait()


@pytest.fixture(scope="session")
def report_sweep(request):
    """The session's report sweep (`REPORT_GRID`, started at collection): its readers write only their own
    subfolders (tables/, plots/) or copy it."""
    import time

    out = report_sweep_folder(request.config)
    deadline = time.monotonic() + 900
    while not (out.parent / "report_sweep.done").exists():
        log = out.parent / "report_sweep.log"
        assert not (out.parent / "report_sweep.failed").exists(), log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"the report sweep did not end within 900 s: {log}"
        time.sleep(0.5)
    return out
