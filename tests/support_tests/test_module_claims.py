"""support/module_claims.py: two pytest processes given the same claims directory, one from the front and one from
the back, run every test of the selection exactly once between them, each module whole in one process with its
module-scoped fixture set up and torn down once there (pytest itself fails a run whose next item was wrong: "previous
item was not torn down properly")."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

from support.paths import ROOT

MODULE = '''
import os, time
import pytest

@pytest.fixture(scope="module")
def held():
    # both processes inside a module before either goes on: on a busy machine one could otherwise start only
    # after the other had taken every module
    log = os.environ["LOG"]
    print("setup", __name__, os.getpid(), file=open(log, "a"), flush=True)
    deadline = time.time() + 60
    while len({line.split()[-1] for line in open(log) if line.startswith("setup")}) < 2 and time.time() < deadline:
        time.sleep(0.02)
    yield
    print("teardown", __name__, os.getpid(), file=open(log, "a"), flush=True)

@pytest.mark.parametrize("i", range(3))
def test_it(held, i):
    time.sleep(0.05)
    print("ran", __name__, i, os.getpid(), file=open(os.environ["LOG"], "a"), flush=True)

def test_without_the_fixture():
    print("ran", __name__, "plain", os.getpid(), file=open(os.environ["LOG"], "a"), flush=True)
'''


def test_two_processes_run_each_module_once_whole_from_both_ends(tmp_path):
    modules = [f"test_m{i}" for i in range(7)]
    (tmp_path / "tests").mkdir()
    for name in modules:
        (tmp_path / "tests" / f"{name}.py").write_text(MODULE)
    (tmp_path / "claims").mkdir()
    log = tmp_path / "log"
    env = {**os.environ, "LOG": str(log), "HYBRIDFLOW_TEST_CLAIMS": str(tmp_path / "claims"),
           "PYTHONPATH": str(ROOT / "tests")}
    procs = {end: subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "support.module_claims",
                                    "-p", "no:cacheprovider", "-o", "pythonpath=", str(tmp_path / "tests")],
                                   cwd=tmp_path, env={**env, "HYBRIDFLOW_TEST_CLAIM_FROM": end},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for end in ("front", "back")}
    out = {end: p.communicate(timeout=120)[0] for end, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), out
    pid = {end: p.pid for end, p in procs.items()}
    lines = [line.split() for line in log.read_text().splitlines()]
    ran = Counter((m, i) for what, m, i, _ in (x for x in lines if x[0] == "ran"))
    assert sorted(ran) == sorted((m, i) for m in modules for i in ("0", "1", "2", "plain")), ran
    assert set(ran.values()) == {1}, f"a test ran twice: {ran}"
    where = {}
    for line in lines:
        where.setdefault(line[1], set()).add(int(line[-1]))
    assert all(len(pids) == 1 for pids in where.values()), f"a module ran in both processes: {where}"
    assert where[modules[0]] == {pid["front"]} and where[modules[-1]] == {pid["back"]}, (where, pid)
    for m in modules:
        assert [x[0] for x in lines if x[1] == m and x[0] != "ran"] == ["setup", "teardown"], lines
    done = {end: next(line for line in text.splitlines() if "module claims" in line) for end, text in out.items()}
    assert sum(int(d.split("ran ")[1].split()[0]) for d in done.values()) == len(modules), done
