"""Session set-up shared by the test modules.

DeepSpeed JIT-builds its CPU communication extension (deepspeed_shm_comm) on first use, in every
process that initialises its communication on CPU. Left to the multi-process tests, the first of
them pays the build (1-3 minutes on 2 cores) inside its own deadline, and a worker killed
mid-build leaves a lock that every later DeepSpeed process waits on. So when tests marked
`deepspeed_ext` are collected, the extension is built here first: once, in one process, with its
own deadline ($KOALA_BUILD_TIMEOUT_S, default 900 s) and no test's timeout running. If that fails,
those tests fail at once with its one-line reason; the other tests still run.
"""
from __future__ import annotations

import os
import sys

import pytest

_BUILD_ERROR = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker runs torch on one intra-op thread (it and its child processes, unless
    OMP_NUM_THREADS is set): the workers already fill the cores, and the tests' tensors are
    tiny. Two threads per worker on 2 busy cores made a 32x64 @ 64x256 matmul 30x slower
    (0.7 ms instead of 23 us), in wall and CPU time: the threads spin waiting for each other."""
    if hasattr(config, "workerinput") and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch = sys.modules.get("torch")  # normally imported later, by the test modules
        if torch is not None:
            torch.set_num_threads(1)


# The test files whose in-process tests import torch's compiler stack (torch._dynamo and
# torch._inductor): megatron-core (4-5 s of CPU per process that imports it, mostly that stack,
# which its fused kernels load) and torch.distributed.pipelining (1.4 s after torch; about 0.2 s
# once megatron-core has loaded the stack). Under xdist (`make test-fast`) one worker runs them
# all, so the other never pays those imports. Only a matter of speed: a file missing here still
# runs, on any worker.
COMPILER_STACK_FILES = frozenset({
    "test_megatron_layout.py", "test_megatron_unit.py", "test_one_line_errors.py", "test_profile_layers.py",
    "test_profiler.py", "test_timeout.py", "test_wgrad.py", "test_wgrad_policy.py", "test_library_torch.py",
    "test_torch_adapter.py"})


def _scope(nodeid: str) -> str:
    """xdist's unit of work: the compiler-stack files' tests are one unit, every other test its own."""
    return "compiler-stack" if nodeid.split("::", 1)[0].rsplit("/", 1)[-1] in COMPILER_STACK_FILES else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """For xdist's default distribution (`-n N`, `--dist load`): tests go to whichever worker is
    free, one at a time, except the compiler-stack files' (`COMPILER_STACK_FILES`), which go as one
    unit, first (xdist orders units by size), to one worker. pytest-xdist's own grouping
    (`--dist loadgroup` with xdist_group marks) is a no-op with pytest 9.2 (pytest-xdist#1386)."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneCompilerStackWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return OneCompilerStackWorker(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """An xdist worker ends here, at once. pytest-xdist has already sent its results (at the end
    of its session, before this hook; after that the controller ignores the worker's
    connection), and the controller waits for each worker's process to end before it reports.
    Ending normally took 2-3 s more per worker with torch, DeepSpeed and megatron-core loaded:
    pytest's final garbage collections (about 0.8 s), then the interpreter's teardown (about
    1.5 s, measured in a bare process with those imports). Nothing of a test runs after this."""
    if hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(item.get_closest_marker("deepspeed_ext") for item in session.items):
        return
    from deepspeed_jobs import BUILD_TIMEOUT_S, ExtensionBuildError, build_cpu_extension, extensions_dir

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    raw = os.environ.get("KOALA_BUILD_TIMEOUT_S")
    try:
        timeout_s = float(raw) if raw is not None else BUILD_TIMEOUT_S
    except ValueError:
        timeout_s = float("nan")
    if not (0 < timeout_s < float("inf")):
        raise pytest.UsageError(f"KOALA_BUILD_TIMEOUT_S={raw!r}: expected a finite number of seconds > 0")
    if reporter is not None:
        reporter.write_line(f"DeepSpeed CPU extension: building or checking it in {extensions_dir()} "
                            f"(the first run builds it: 1-3 minutes on 2 cores; deadline {timeout_s:.0f} s)")
    try:
        seconds = build_cpu_extension(timeout_s=timeout_s)
    except ExtensionBuildError as exc:
        session.stash[_BUILD_ERROR] = str(exc)
        if reporter is not None:
            reporter.write_line(f"DeepSpeed CPU extension: {exc}", red=True)
        return
    if reporter is not None:
        reporter.write_line(f"DeepSpeed CPU extension: ready ({seconds:.0f} s)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    error = item.session.stash.get(_BUILD_ERROR, None)
    if error is not None and item.get_closest_marker("deepspeed_ext"):
        pytest.fail(error, pytrace=False)


@pytest.fixture
def one_torch_thread():
    """torch on one intra-op thread for the test (timings of small layers are steadier)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _destroy_process_groups() -> None:
    """megatron-core's parallel state (when imported) and torch.distributed's default group."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None:
        ps.destroy_model_parallel()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _group_initialised() -> bool:
    dist = sys.modules.get("torch.distributed")  # never imports torch for a test that did not
    return dist is not None and dist.is_available() and dist.is_initialized()


@pytest.fixture(autouse=True)
def _no_process_group_left_behind(request):
    """A test that initialises torch.distributed in this process must destroy its group: every
    later test in the process (an xdist worker runs hundreds) would see it, e.g.
    koala_ds.core.errors.process_rank takes the rank from it instead of $RANK. A test that leaves
    one fails here, and the group is destroyed so that the tests after it still run clean."""
    before = _group_initialised()
    yield
    if not before and _group_initialised():
        _destroy_process_groups()
        pytest.fail(f"{request.node.nodeid} left a torch.distributed process group initialised: destroy it "
                    f"(tests/conftest.py's single_process_megatron fixture does for megatron-core)", pytrace=False)


@pytest.fixture
def single_process_megatron():
    """For a test that builds megatron-core modules in this process (koala_ds.profiler.models
    sets up megatron-core's parallel state on a one-rank gloo group): the state and the group
    are destroyed after the test."""
    pytest.importorskip("megatron.core")
    yield
    _destroy_process_groups()
