"""Runs the suite's JAX tests inside the main (TensorFlow) pytest run, each
as its own item (tests/conftest.py loads this plugin; its docstring has the
rules for test authors).

Keras fixes its backend once per process, so the JAX tests run in a JAX
process: one persistent worker per main process (per pytest-xdist worker),
started when its first JAX test runs. It is pytest itself, collecting the
same files, whose run loop takes node ids over a pipe, runs each through
pytest's full test protocol (the next node id says which module and
session fixtures to tear down) and sends back the serialized reports,
which the main process logs as its own under the item's node id with a
`[jax]` suffix: outcomes, tracebacks, captured output and durations are
the worker's. The items are known from one collection under JAX
(`--collect-only` in a child): the xdist controller runs it once and hands
its file to every xdist worker, so all collect the same items.

A worker that dies, or gives no result within `TEST_SECONDS` (or what is
left of `FILE_SECONDS` for the file), is killed with its process group;
the test fails saying so with the end of the worker's output, and the next
JAX test starts a new worker."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
JAX_DIR = ROOT / "tests" / "jax_backend"
SUFFIX = "[jax]"
TEST_SECONDS, FILE_SECONDS, START_SECONDS = 300, 900, 300

# Files of tests/jax_backend that run in the main (TensorFlow) process:
# they start JAX children of their own, or test the JAX library's links.
TENSORFLOW_SIDE = ("test_jax_backend.py", "test_cross_backend_saving.py",
                   "test_cross_backend_training.py", "test_cross_backend_hash_layers.py",
                   "test_cross_backend_export.py")

# What the worker's environment adds: XLA's compiles are most of the JAX
# tests' time, so it compiles with XLA's optimizations mostly off and with
# a compilation cache of its own (identical programs compile once).
_ENV = {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
# Marks that pytest evaluates with arguments: the worker has applied them.
_EVALUATED_MARKS = {"skip", "skipif", "xfail", "parametrize", "usefixtures", "filterwarnings"}
_BACKENDS_MARK = re.compile(r"""mark\.backends\([^)]*["']jax["']""")

_ROLE = os.environ.get("KRE_JAX_ROLE")  # "collect" or "run" in the JAX child


def _is_jax_file(path):
    """Whether `path` (a test file) holds tests that run under JAX."""
    path = pathlib.Path(path)
    if not (path.name.startswith("test_") and path.suffix == ".py"):
        return False
    if path.parent == JAX_DIR:
        return path.name not in TENSORFLOW_SIDE
    try:
        return bool(_BACKENDS_MARK.search(path.read_text()))
    except OSError:
        return False


def runs_under(item, backend):
    """Whether `item` runs under `backend`: tests of tests/jax_backend
    under JAX only, others as their `backends` mark says (TensorFlow
    without one)."""
    if item.path.parent == JAX_DIR:
        return backend == "jax"
    mark = item.get_closest_marker("backends")
    return backend in (mark.args if mark else ("tensorflow",))


# -- the JAX child ------------------------------------------------------------

if _ROLE:
    _reports = []

    def pytest_runtest_logreport(report):
        _reports.append(report)

    def pytest_collectreport(report):
        if report.failed:
            _reports.append(report)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(session):
        config = session.config
        conn = Connection(int(os.environ["KRE_JAX_FD"]))
        if _ROLE == "collect":
            items = [{"nodeid": item.nodeid, "location": list(item.location),
                      "marks": sorted({m.name for m in item.iter_markers()} - _EVALUATED_MARKS)}
                     for item in session.items]
            errors = {report.nodeid: str(report.longrepr) for report in _reports}
            conn.send({"items": items, "errors": errors})
            return True
        by_id = {item.nodeid: item for item in session.items}
        conn.send("ready")
        while (message := conn.recv()) is not None:
            nodeid, next_id = message
            _reports.clear()
            if nodeid not in by_id:
                conn.send(f"the JAX worker did not collect {nodeid}")
                continue
            config.hook.pytest_runtest_protocol(item=by_id[nodeid], nextitem=by_id.get(next_id))
            conn.send([config.hook.pytest_report_to_serializable(config=config, report=r)
                       for r in _reports])
        return True


# -- the main process: the JAX child's start and its collection ---------------

def _start_child(config, role, files, basetemp):
    """A JAX pytest over `files` in `role`, its connection and its log."""
    ours, theirs = Pipe()
    log = open(basetemp.with_suffix(".log"), "w+b")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env.update(_ENV, KRE_JAX_ROLE=role, KRE_JAX_FD=str(theirs.fileno()),
               JAX_COMPILATION_CACHE_DIR=str(basetemp.parent / "jax-cache"))
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
            f"--basetemp={basetemp}", f"--tb={config.option.tbstyle}", *(["-l"] if config.option.showlocals else []),
            *(["--long"] if config.getoption("--long") else []), *map(str, files)]
    process = subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, pass_fds=[theirs.fileno()],
                               start_new_session=True)
    theirs.close()
    return process, ours, log


def _log_tail(log, size=6000):
    log.flush()
    log.seek(0, os.SEEK_END)
    log.seek(max(0, log.tell() - size))
    return log.read().decode(errors="replace")


def _kill(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _wanted_files(config):
    """The JAX test files under the run's arguments (their `::` parts aside)."""
    files = set()
    for arg in config.args:
        path = pathlib.Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        candidates = sorted(path.rglob("test_*.py")) if path.is_dir() else [path]
        files.update(f for f in candidates if _is_jax_file(f))
    return sorted(files)


def _temp_dir(config):
    if not hasattr(config, "_kre_jax_dir"):
        config._kre_jax_dir = pathlib.Path(tempfile.mkdtemp(prefix="kre-jax-"))
    return config._kre_jax_dir


def _collect(config):
    """The JAX collection of the run's JAX files, as a file path (None if
    the run has none), collected once per run."""
    if hasattr(config, "workerinput"):
        return config.workerinput.get("kre_jax_collection")
    if not hasattr(config, "_kre_jax_collection"):
        config._kre_jax_collection = None
        files = _wanted_files(config)
        if files:
            path = _temp_dir(config) / "collection.json"
            process, conn, log = _start_child(config, "collect", files,
                                              _temp_dir(config) / "collect")
            try:
                result = conn.recv() if conn.poll(START_SECONDS) else None
            except EOFError:
                result = None
            if result is None:
                _kill(process)
                raise pytest.UsageError("the JAX collection of tests/_backends.py gave no result "
                                        f"in {START_SECONDS} s:\n{_log_tail(log)}")
            process.wait()
            path.write_text(json.dumps(result))
            config._kre_jax_collection = str(path)
    return config._kre_jax_collection


def _collection(config):
    if not hasattr(config, "_kre_jax_items"):
        path = _collect(config)
        config._kre_jax_items = json.loads(pathlib.Path(path).read_text()) if path else {
            "items": [], "errors": {}}
    return config._kre_jax_items


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller: the workers read its one collection."""
    node.workerinput["kre_jax_collection"] = _collect(node.config)


def pytest_unconfigure(config):
    worker = getattr(config, "_kre_jax_worker", None)
    if worker:
        worker.stop()
    if hasattr(config, "_kre_jax_dir"):
        shutil.rmtree(config._kre_jax_dir, ignore_errors=True)


# -- the main process: the items ----------------------------------------------

class _Worker:
    """The persistent JAX pytest of one main process."""

    def __init__(self, config):
        self.config, self.process, self.starts = config, None, 0
        self.files = sorted({item["nodeid"].split("::")[0]
                             for item in _collection(config)["items"]})

    def run(self, nodeid, next_id, seconds):
        """The serialized reports of `nodeid` (or a str saying why none)."""
        if self.process is None:
            self.starts += 1
            base = self.config._tmp_path_factory.getbasetemp() / f"jax-{self.starts}"
            self.process, self.conn, self.log = _start_child(self.config, "run", self.files,
                                                             base)
            ready = self._receive(START_SECONDS, "starting (collecting its files)")
            if isinstance(ready, str) and ready != "ready":
                return ready
        self.conn.send((nodeid, next_id))
        return self._receive(seconds, f"running {nodeid}")

    def _receive(self, seconds, doing):
        try:
            if self.conn.poll(seconds):
                return self.conn.recv()
            why = f"took over {seconds:.0f} s {doing}: killed"
        except (EOFError, OSError):
            why = f"died while {doing} (exit status {self.process.poll()})"
        _kill(self.process)
        tail = _log_tail(self.log)
        self.stop()
        return (f"the JAX worker process {why}; the next JAX test starts a new one. "
                f"The end of its output:\n{tail}")

    def stop(self):
        if self.process is not None:
            try:
                self.conn.send(None)
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                _kill(self.process)
            self.conn.close()
            self.log.close()
            self.process = None


class JaxItem(pytest.Item):
    """A test that runs in the JAX worker; its reports are the worker's."""

    def __init__(self, *, child, location, marks, **kwargs):
        super().__init__(**kwargs)
        self.child_nodeid, self._location, self.reports = child, location, {}
        for name in marks:
            self.add_marker(name)
        self.add_marker("jax")

    def reportinfo(self):
        return self.path, self._location[1], self._location[2] + SUFFIX

    def setup(self):
        config = self.config
        if getattr(config, "_kre_jax_worker", None) is None:
            config._kre_jax_worker = _Worker(config)
        spent = config.stash.setdefault(_SPENT, {})
        file = self.child_nodeid.split("::")[0]
        seconds = min(TEST_SECONDS, FILE_SECONDS - spent.get(file, 0.0))
        if seconds <= 0:
            pytest.fail(f"{file}'s JAX tests have used their {FILE_SECONDS} s", pytrace=False)
        start = time.monotonic()
        next_id = getattr(self, "_next", None)
        reports = config._kre_jax_worker.run(self.child_nodeid, next_id, seconds)
        spent[file] = spent.get(file, 0.0) + time.monotonic() - start
        if isinstance(reports, str):
            pytest.fail(reports, pytrace=False)
        for data in reports:
            report = config.hook.pytest_report_from_serializable(config=config, data=data)
            report.nodeid, report.location = self.nodeid, self.location
            self.reports[report.when] = report

    def runtest(self):
        pass  # the worker ran it (setup)


_SPENT = pytest.StashKey[dict]()


class JaxFile(pytest.File):
    """A test file's JAX items, from the JAX collection (not imported here)."""

    def collect(self):
        collection = _collection(self.config)
        rel = self.path.relative_to(self.config.rootpath).as_posix()
        for where, error in collection["errors"].items():
            if rel == where or rel.startswith(where + "/") or not where:
                raise self.CollectError(f"under the JAX backend:\n{error}")
        top, nodes = [], {}
        for entry in collection["items"]:
            file, *classes, name = entry["nodeid"].split("::")
            if file != rel:
                continue
            parent, children = self, top
            for i in range(1, len(classes) + 1):
                if tuple(classes[:i]) not in nodes:
                    nodes[tuple(classes[:i])] = JaxClass.from_parent(parent, name=classes[i - 1])
                    children.append(nodes[tuple(classes[:i])])
                parent = nodes[tuple(classes[:i])]
                children = parent.children
            children.append(JaxItem.from_parent(parent, name=name + SUFFIX, child=entry["nodeid"],
                                                location=entry["location"], marks=entry["marks"]))
        return top


class JaxClass(pytest.Collector):
    """A test class of a JAX file (JaxFile makes its items)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.children = []

    def collect(self):
        return self.children


def pytest_pycollect_makemodule(module_path, parent):
    """tests/jax_backend's JAX files hold nothing the main process runs."""
    if _ROLE is None and module_path.parent == JAX_DIR and _is_jax_file(module_path):
        return JaxFile.from_parent(parent, path=module_path)
    return None


def pytest_collect_file(file_path, parent):
    """Files elsewhere with tests for both backends: their JAX items too."""
    if _ROLE is None and file_path.parent != JAX_DIR and _is_jax_file(file_path):
        return JaxFile.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config, items):
    """Each process keeps the tests of its backend."""
    items[:] = [item for item in items if isinstance(item, JaxItem)
                or runs_under(item, "jax" if _ROLE else "tensorflow")]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if isinstance(item, JaxItem):
        item._next = nextitem.child_nodeid if isinstance(nextitem, JaxItem) else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item, call):
    """A JAX item's reports are the worker's, unless the main process's
    own step failed (the worker's death, a timeout)."""
    if isinstance(item, JaxItem) and call.excinfo is None:
        return item.reports.get(call.when)
    return None
