"""Suite-wide settings: strict warnings (pyproject), deterministic torch, hypothesis profiles,
long-lived gloo process pools shared by every multi-process test, and commands run beside the tests."""

from __future__ import annotations

import compileall
import fnmatch
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

from shardwise.collectives.backends import start_method as _start_method
from shardwise.transforms.tensor_parallel.not_judged import forget_said

# "ci" is fast and reproducible (derandomize); "dev" searches deeper:
#   HYPOTHESIS_PROFILE=dev pytest
settings.register_profile(
    "ci",
    max_examples=12,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev",
    max_examples=200,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)

# -- bytecode of the package and the tests, written once for every process the suite starts ----------------
# Rank processes, benchmarks, examples and the CLI each import shardwise afresh. Where PYTHONDONTWRITEBYTECODE
# is set (the CI machine sets it) none of them writes what it compiled, so each compiled the package's
# 56,000 lines again: 0.8 s of CPU in every one of a hundred processes a run. Python still reads bytecode
# that is there (and recompiles a source newer than it), so the controller writes it once, before its
# workers start. (compileall writes whatever that variable says; __pycache__ is git-ignored.)
if "PYTEST_XDIST_WORKER" not in os.environ:
    for _tree in ("shardwise", "tests"):
        compileall.compile_dir(Path(__file__).resolve().parents[1] / _tree, quiet=1)


# Likewise the test modules as pytest rewrites their asserts: pytest caches a rewritten module in its own pyc
# (``__pycache__/<name>.cpython-3X-pytest-<version>.pyc``), which it reads whatever PYTHONDONTWRITEBYTECODE says
# but writes only where it is unset; so each worker rewrote all 400 test modules and conftests as it collected
# them, 8 s of its 14 s collection (6 s with the pycs there). The controller writes them, on a thread that runs
# while its workers start (they import torch first): a worker that comes to a module before it is written
# rewrites it itself, as before (pytest writes a pyc whole, by a rename, and checks it against the source's
# hash). Only a cache: with a pytest whose internals moved, nothing is written and every worker rewrites.
def _write_rewritten_test_pycs(config: pytest.Config) -> None:
    try:
        from _pytest.assertion import rewrite

        state = config.stash[rewrite.assertstate_key]
        patterns = ["conftest.py", *config.getini("python_files")]
        for path in sorted((ROOT / "tests").rglob("*.py")):
            if not any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns):
                continue
            pyc = rewrite.get_cache_dir(path) / (path.name[:-3] + rewrite.PYC_TAIL)
            if rewrite._read_pyc(path, pyc, state.trace) is None and rewrite.try_makedirs(pyc.parent):
                source_hash, code = rewrite._rewrite_test(path, config)
                rewrite._write_pyc(state, code, source_hash, pyc)
    except Exception:  # (only a cache: whatever pytest's private names became, the workers rewrite as before)
        return


def pytest_configure(config: pytest.Config) -> None:
    if (sys.dont_write_bytecode and not hasattr(config, "workerinput")
            and config.getoption("assertmode", None) == "rewrite"):
        threading.Thread(target=_write_rewritten_test_pycs, args=(config,), name="rewritten-pycs", daemon=True).start()


# -- rank processes forked from the fork server, in every test ------------------------------------
# A launch forks its ranks from a server that imported torch once only while what a rank inherits
# (start_method.inherited: the environment among it, but PYTEST_CURRENT_TEST, which pytest rewrites
# before every phase of every test) is what the server had when it started; else it spawns them, each
# importing torch again (2 to 5 s a pool). So the server starts as the first gloo test's setup does,
# before its fixtures can change what ranks inherit (a variable a test sets itself still spawns).
@pytest.hookimpl(tryfirst=True)  # before the test's fixtures (a pool, a variable set) run
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gloo") and os.environ.get(_start_method.ENV_VAR, "forkserver") == "forkserver":
        _start_method.rank_context()  # the first starts the server, with what every test's ranks inherit


def _pool(world: int) -> Iterator[object]:
    from shardwise.collectives.backends.processes import ProcessPool

    with ProcessPool(world, timeout=60.0) as pool:
        yield pool


@pytest.fixture(scope="session")
def gloo2() -> Iterator[object]:
    """Two gloo ranks as processes, reused by every test that asks (a process costs ~2 s to start)."""
    yield from _pool(2)


@pytest.fixture(scope="session")
def gloo4() -> Iterator[object]:
    """Four gloo ranks as processes, reused by every test that asks."""
    yield from _pool(4)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def fresh_interpreter(tmp_path: Path) -> Callable[..., str]:
    """``run(text, *args)``: ``text`` as a script in a fresh interpreter (this checkout's shardwise first on
    its path), which must exit 0; its stdout. For what a process does from its first import on."""

    def run(text: str, *args: str, timeout: float = 240) -> str:
        script = tmp_path / "fresh_script.py"
        script.write_text(text)
        done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    return run


@pytest.fixture
def process_alive() -> Callable[[int], bool]:
    """Whether a process of this pid exists: ``os.kill(pid, 0)`` (a zombie counts, so a test that
    sees its ranks gone has also seen them reaped)."""
    return _process_alive


class _StartedWith:
    """A pool whose processes start (and restart, after a failed run) with ``env`` in their environment."""

    def __init__(self, pool: object, env: dict[str, str]) -> None:
        self.pool, self.env = pool, env

    def run(self, fn: object, *args: object) -> list[object]:
        with pytest.MonkeyPatch.context() as patch:
            for key, value in self.env.items():
                patch.setenv(key, value)
            return self.pool.run(fn, *args)  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def live_malloc_gloo4() -> Iterator[object]:
    """Four gloo ranks whose glibc returns freed memory at once (``LIVE_MALLOC``: RSS follows live
    memory), shared by the tests that measure a rank's peak at world 4. Each measures after a warm-up
    of its own code on a tiny model, from a reset high-water mark (``PeakRSS``)."""
    from shardwise.collectives.backends.processes import ProcessPool
    from shardwise.testing.memory import LIVE_MALLOC

    with ProcessPool(4, timeout=240.0) as pool:
        yield _StartedWith(pool, LIVE_MALLOC)


# -- commands beside the tests ------------------------------------------------------------------
# A test marked ``beside(command, timeout=..., env=...)`` only reads the result of a command (mypy, a
# benchmark's smoke run in a process of its own). In a run on one process (``-n 0``) the tests run
# one at a time, torch on one thread, so a second core is mostly idle: once the tests are collected,
# those commands run there, one after another in collection order, and each test reads its own with
# the ``beside`` fixture (waiting for it, or running it then if its turn has not come). The result is
# subprocess.run's, as if run there. Under two workers the second core is in use: a worker runs the
# command when the test comes.
# Only for a command of one process that opens no port: one that starts gloo ranks, run beside the
# first tests, made a torchrun fault test's 2 s rendezvous time out.
ROOT = Path(__file__).resolve().parents[1]


class _Beside:
    def __init__(self, jobs: dict[str, pytest.Mark]) -> None:
        self._pending = dict(jobs)  # node id -> its mark, in collection order
        self._done: dict[str, subprocess.CompletedProcess[str] | BaseException] = {}
        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen[str]] = set()
        self._stopped = False
        threading.Thread(target=self._loop, name="beside", daemon=True).start()

    def _take(self, nodeid: str | None = None) -> tuple[str, pytest.Mark] | None:
        with self._lock:
            if self._stopped or not self._pending or (nodeid is not None and nodeid not in self._pending):
                return None
            nodeid = nodeid or next(iter(self._pending))
            self._events[nodeid] = threading.Event()
            return nodeid, self._pending.pop(nodeid)

    def _loop(self) -> None:
        while (job := self._take()) is not None:
            self._run(*job)

    def _run(self, nodeid: str, mark: pytest.Mark) -> None:
        try:
            self._done[nodeid] = self._call(mark)
        except BaseException as exc:  # re-raised in the test
            self._done[nodeid] = exc
        finally:
            self._events[nodeid].set()

    def _call(self, mark: pytest.Mark) -> subprocess.CompletedProcess[str]:
        (command,), timeout = mark.args, mark.kwargs.get("timeout", 300)
        with subprocess.Popen(command, cwd=ROOT, env=mark.kwargs.get("env"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) as proc:
            with self._lock:
                if self._stopped:
                    proc.kill()
                self._procs.add(proc)
            try:
                out, err = proc.communicate(timeout=timeout)
            except BaseException:
                proc.kill()
                proc.communicate()
                raise
            finally:
                with self._lock:
                    self._procs.discard(proc)
        return subprocess.CompletedProcess(command, proc.returncode, out, err)

    def knows(self, nodeid: str) -> bool:
        with self._lock:
            return nodeid in self._pending or nodeid in self._events

    def result(self, nodeid: str) -> subprocess.CompletedProcess[str]:
        job = self._take(nodeid)
        if job is not None:  # its turn has not come: run it now
            self._run(*job)
        self._events[nodeid].wait()
        done = self._done.pop(nodeid)
        if isinstance(done, BaseException):
            raise done
        return done

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            procs = list(self._procs)
        for proc in procs:
            proc.kill()


_BESIDE = pytest.StashKey[_Beside]()


# -- two workers (pytest-xdist, pyproject's addopts) -----------------------------------------------
# The tests that start gloo ranks (a pool, torchrun, an example on processes) run on one worker, one
# after another as before: two at once would put up to eight rank processes on this machine's two
# cores, and a fault test's short rendezvous or deadline would then time out. The other tests (one
# thread of torch each) share both workers.
# xdist's loadgroup reads a test's group from a suffix of its nodeid ("...@gloo"), which xdist
# 3.8 writes into ``Node._nodeid``; pytest 9.2 keeps the nodeid in ``Node._id`` (a NodeId), so that
# write was lost and the gloo tests ran on both workers at once (each starting its own pools). The
# suffix is written here, for either pytest, and checked: a pytest that keeps it elsewhere again
# fails the collection, loudly, instead of spreading the gloo tests again.
GROUP = "gloo"


@pytest.hookimpl(trylast=True)  # after xdist's own, which finds no mark yet: the suffix is ours alone
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouping = bool(getattr(config.option, "loadgroup", False))  # a worker of `--dist loadgroup`
    for item in items:
        if item.get_closest_marker("gloo"):
            item.add_marker(pytest.mark.xdist_group(GROUP))
            if grouping and not item.nodeid.endswith(f"@{GROUP}"):
                _name_group(item)


def _name_group(item: pytest.Item) -> None:
    named = f"{item.nodeid}@{GROUP}"
    if hasattr(item, "_id"):  # a pytest that keeps a NodeId (9.2)
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(named)
    else:
        item._nodeid = named
    if item.nodeid != named:
        raise pytest.UsageError(f"could not put {item.nodeid} in xdist group {GROUP!r}: pytest keeps nodeids "
                                "elsewhere now; see tests/conftest.py")


def pytest_collection_finish(session: pytest.Session) -> None:
    jobs = {item.nodeid: mark for item in session.items if (mark := item.get_closest_marker("beside"))}
    if jobs and not session.config.option.collectonly and not hasattr(session.config, "workerinput"):
        session.config.stash[_BESIDE] = _Beside(jobs)


def pytest_sessionfinish(session: pytest.Session) -> None:
    beside = session.config.stash.get(_BESIDE, None)
    if beside is not None:  # a run stopped early (-x) leaves no command running
        beside.stop()


@pytest.fixture
def beside(request: pytest.FixtureRequest) -> subprocess.CompletedProcess[str]:
    """The result of this test's ``beside`` command (see above)."""
    mark = request.node.get_closest_marker("beside")
    assert mark is not None, "the beside fixture is for tests marked beside(command, ...)"
    runner = request.config.stash.get(_BESIDE, None)
    if runner is None or not runner.knows(request.node.nodeid):
        runner = _Beside({request.node.nodeid: mark})
    return runner.result(request.node.nodeid)


@pytest.fixture
def benchmark_script(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Any]:
    """Loads ``benchmarks/<name>.py`` in this process, as ``python benchmarks/<name>.py`` would see it: its folder
    on sys.path (it imports its sibling ``_common`` by the bare name) and the module in sys.modules under
    ``<name>_benchmark`` (dataclasses look their module up there), both undone after the test."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))

    def load(name: str) -> Any:
        module_name = f"{name}_benchmark"
        spec = importlib.util.spec_from_file_location(module_name, ROOT / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, module_name, module)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(autouse=True)
def _regions_judged_anew() -> None:
    """sw.tp.RegionNotJudged is said once per Region class and cause in a process: in each test, as in a fresh one (a
    test that meets a Region left unjudged warns alone as in the suite)."""
    forget_said()
