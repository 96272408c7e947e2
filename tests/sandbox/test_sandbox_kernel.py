"""What a sandboxed program may still ask of the kernel (issue 51, M3): /dev read-only (its /dev/shm private and
writable), no namespaces, mounts, ptrace, bpf, io_uring or keyrings of its own (the seccomp filter, and
bwrap --disable-userns in a user namespace), and a cgroup of its own where one is delegated (a missing, advisory
layer elsewhere: it never makes HYBRIDFLOW_SANDBOX=require refuse). Python, numpy, threads and subprocesses keep
working under the filter."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from hybridflow import sandbox
from hybridflow.sandbox import Limits, cgroup, policy, process, seccomp

LAYERS = sandbox.probe()
BWRAP = shutil.which("bwrap")

ATTACK = textwrap.dedent("""
    import ctypes, errno, json, os, subprocess, sys, threading
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    numbers, out = json.loads(sys.argv[1]), {}

    def call(name, *args):
        ctypes.set_errno(0)
        r = libc.syscall(ctypes.c_long(numbers[name]), *[ctypes.c_long(a) for a in args])
        if r == 0 and name == "clone":  # the child of a clone that went through
            os._exit(0)
        if r > 0 and name == "clone":
            os.waitpid(r, 0)
        return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))

    # harmless arguments: without the filter each fails for its arguments (or does nothing), never for policy
    out["ptrace"] = call("ptrace", 0x7FFF, 0, 0, 0)
    out["process_vm_readv"] = call("process_vm_readv", os.getpid(), 0, 0, 0, 0, 0)
    out["keyctl"] = call("keyctl", 0x7FFF, 0, 0, 0)
    out["bpf"] = call("bpf", 0x7FFF, 0, 0)
    out["perf_event_open"] = call("perf_event_open", 0, 0, -1, -1, 0)
    out["io_uring_setup"] = call("io_uring_setup", 1, 0)
    out["mount"] = call("mount", 0, 0, 0, 0, 0)
    out["setns"] = call("setns", -1, 0)
    out["personality"] = call("personality", 0xFFFFFFFF)
    out["clone3"] = call("clone3", 0, 0)
    out["clone"] = call("clone", 17, 0, 0, 0, 0)  # SIGCHLD: a plain fork
    out["clone_newuser"] = call("clone", 0x10000000 | 17, 0, 0, 0, 0)
    out["subprocess"] = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True,
                                       text=True).stdout.strip()
    t = threading.Thread(target=lambda: out.__setitem__("thread", "ok"))
    t.start(); t.join()
    import numpy
    out["numpy"] = float(numpy.arange(5).sum())
    out["unshare"] = call("unshare", 0x10000000)  # last: where it goes through, the process is in a new namespace
    print(json.dumps(out))
""")
REFUSED_HERE = ["ptrace", "process_vm_readv", "keyctl", "bpf", "perf_event_open", "io_uring_setup", "mount", "setns",
                "personality", "clone_newuser", "unshare"]


def _run(layers: sandbox.Layers, argv: list[str]) -> tuple[int, str, str]:
    box = sandbox.spawn(argv, Limits(), layers, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE)
    try:
        out, err = box.popen.communicate(timeout=60)
    finally:
        box.kill(wait=2)
    return box.popen.returncode, out.decode(), err.decode()


def _attack(layers: sandbox.Layers) -> dict:
    import pyseccomp

    names = ["ptrace", "process_vm_readv", "keyctl", "bpf", "perf_event_open", "io_uring_setup", "mount", "setns",
             "personality", "clone3", "clone", "unshare"]
    numbers = {n: pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, n) for n in names}
    rc, out, err = _run(layers, [sys.executable, "-c", ATTACK, json.dumps(numbers)])
    assert rc == 0, err[-2000:]
    return json.loads(out)


def _bwrap_kinds() -> list[sandbox.Layers]:
    """The kinds with bwrap this machine runs, as probe makes them (the filter; --disable-userns where it can)."""
    if not BWRAP:
        pytest.skip("bwrap is not installed")
    kinds = [c for c in process.candidates(BWRAP) if c.bwrap and c.proc]
    return [k for k in kinds if process.try_layers(k, (sys.executable, "-c", "print('ok')"), Limits()) is None]


def test_this_machine_gives_the_filter_and_no_cgroup_is_no_refusal():
    """As root with bwrap (CI): the seccomp filter is a layer of the whole sandbox; a cgroup only where one is
    delegated, and its absence, recorded with why, is no reason for a required sandbox to refuse."""
    if os.geteuid() != 0 or not BWRAP:
        pytest.skip("the whole sandbox needs root (or user namespaces) and bwrap")
    assert LAYERS.seccomp and "syscalls" in LAYERS.present, LAYERS.describe()
    assert LAYERS.complete, LAYERS.describe()
    if LAYERS.cgroup is None:
        why = dict(LAYERS.missing)["cgroup"]
        assert why and "cgroup" in why, LAYERS.describe()
        assert "cgroup (" in LAYERS.describe()
    sandbox.check_required(LAYERS, "the test's code", require=True)  # does not raise


def test_dev_is_read_only_and_its_shm_private_and_writable():
    """An unsized writable /dev (bwrap's --dev is a tmpfs) would hold what the sandbox writes there; /dev/shm is
    the private, sized tmpfs mounted after the remount, so shared memory still works."""
    if LAYERS.bwrap is None:
        pytest.skip(LAYERS.describe())
    code = textwrap.dedent("""
        import errno, os
        def attempt(f):
            try:
                f()
                return "ok"
            except OSError as e:
                return errno.errorcode[e.errno]
        print(attempt(lambda: open("/dev/evil", "w").write("x")), attempt(lambda: os.mkdir("/dev/d")),
              attempt(lambda: open("/dev/shm/x", "w").write("x")), attempt(lambda: open("/dev/null", "w").write("x")))
    """)
    for layers in _bwrap_kinds():
        rc, out, err = _run(layers, [sys.executable, "-c", code])
        assert (rc, out.split()) == (0, ["EROFS", "EROFS", "ok", "ok"]), (layers.how, out, err[-1000:])
    cmd = sandbox.command(["prog"], Limits(), sandbox.Layers("/usr/bin/bwrap", privileged=True), env={},
                          workdir=sandbox.WORKDIR)
    assert cmd.index("--remount-ro") < cmd.index("/dev/shm") and cmd[cmd.index("--remount-ro") + 1] == "/dev"


def test_the_seccomp_filter_refuses_namespaces_and_kernel_surface_and_python_still_works():
    """Each kind with bwrap: the calls of REFUSED answer EPERM, a clone with CLONE_NEWUSER too, clone3 ENOSYS (glibc
    falls back to clone); a plain fork, threads, a subprocess and numpy work."""
    for layers in _bwrap_kinds():
        assert layers.seccomp, layers
        got = _attack(layers)
        assert {k: got[k] for k in REFUSED_HERE} == {k: "EPERM" for k in REFUSED_HERE}, (layers.how, got)
        assert got["clone3"] == "ENOSYS" and got["clone"] == "ok", (layers.how, got)
        assert (got["subprocess"], got["thread"], got["numpy"]) == ("42", "ok", 10.0), (layers.how, got)


def test_without_the_filter_the_same_calls_go_through():
    """What the filter is for: the same program in the same kind without it makes a user namespace of its own."""
    if not LAYERS.bwrap:
        pytest.skip(LAYERS.describe())
    got = _attack(replace(LAYERS, seccomp=False, disable_userns=False))
    assert got["unshare"] == "ok" and got["personality"] == "ok", got


def test_disable_userns_in_a_user_namespace_and_its_note_where_bwrap_lacks_it(monkeypatch):
    """bwrap >= 0.8 in a user namespace: --disable-userns, so that even without the filter the program gets no
    user namespace of its own; an older bwrap: a note says only the filter refuses one."""
    if not BWRAP:
        pytest.skip("bwrap is not installed")
    if process.bwrap_version(BWRAP) < process.DISABLE_USERNS_SINCE:
        pytest.skip(f"bwrap {process.bwrap_version(BWRAP)} has no --disable-userns")
    userns = [c for c in process.candidates(BWRAP) if c.userns]
    assert userns and all(c.disable_userns for c in userns)
    layers = sandbox.Layers(BWRAP, userns=True, disable_userns=True)  # no filter: --disable-userns alone
    code = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); r = libc.unshare(0x10000000); "
            "print('ok' if r == 0 else os.strerror(ctypes.get_errno()))")
    if process.try_layers(layers, (sys.executable, "-c", "print('ok')"), Limits()) is not None:
        pytest.skip("user namespaces are refused here")
    rc, out, err = _run(layers, [sys.executable, "-c", code])
    assert rc == 0 and out.strip() != "ok", (out, err)
    rc, out, _ = _run(replace(layers, disable_userns=False), [sys.executable, "-c", code])
    assert out.strip() == "ok"  # what it stops
    assert "--disable-userns" in sandbox.command(["p"], Limits(), layers, env={}, workdir=sandbox.WORKDIR)
    monkeypatch.setattr(process, "bwrap_version", lambda _: (0, 6, 1))
    assert not any(c.disable_userns for c in process.candidates(BWRAP))
    note, = process.notes(replace(layers, disable_userns=False, seccomp=True))
    assert "bwrap 0.6.1 has no --disable-userns" in note and "only the seccomp filter refuses" in note


def test_no_filter_is_a_missing_layer_that_a_required_sandbox_refuses(monkeypatch):
    if not BWRAP:
        pytest.skip("bwrap is not installed")

    def unavailable():
        raise seccomp.SeccompUnavailable("no seccomp filter: pyseccomp cannot load libseccomp (test)")

    monkeypatch.setattr(seccomp, "filter_bpf", unavailable)
    layers = sandbox.probe.__wrapped__()
    assert not layers.seccomp and dict(layers.missing)["syscalls"].endswith("(test)"), layers.describe()
    with pytest.raises(sandbox.SandboxUnavailable, match="syscalls"):
        sandbox.check_required(layers, "the test's code", require=True)


def _fake_delegated(root) -> str:
    """A directory shaped like a delegated cgroup v2 (its files plain files: no kernel behind them)."""
    d = root / "delegated"
    d.mkdir()
    (d / "cgroup.controllers").write_text("cpu memory pids\n")
    (d / "cgroup.subtree_control").write_text("memory pids\n")
    (d / "cgroup.procs").write_text("")
    return str(d)


def test_a_delegated_cgroup_holds_each_sandbox_from_its_first_process(tmp_path, monkeypatch):
    """HYBRIDFLOW_SANDBOX_CGROUP (or this process's own cgroup, or its parent, where delegated): each sandbox gets a
    child of it with memory.max and pids.max, and its first process (bwrap, or the launcher) enters it before
    anything of the sandbox runs; the layer is present."""
    parent = _fake_delegated(tmp_path)
    monkeypatch.setenv(sandbox.limits.CGROUP_ENV, parent)
    cgroup.delegated.cache_clear()
    try:
        assert cgroup.delegated() == (parent, "")
        probed = sandbox.probe.__wrapped__()  # its trial sandbox entered a cgroup made there
    finally:
        cgroup.delegated.cache_clear()
    assert probed.cgroup == parent and "cgroup" in probed.present and probed.complete, probed.describe()
    limits = Limits(memory_bytes=1 << 30, processes=9)
    for layers in [probed, sandbox.Layers(None, cgroup=parent)]:
        box = sandbox.spawn([sys.executable, "-c", "print('ok')"], limits, layers, stdout=subprocess.PIPE)
        out, _ = box.popen.communicate(timeout=60)
        assert out.strip() == b"ok" and box.cgroup and os.path.dirname(box.cgroup) == parent
        with open(os.path.join(box.cgroup, "cgroup.procs")) as f:
            assert f.read().split() == [str(box.popen.pid)]  # the shell wrote its pid, then exec'd the sandbox
        with open(os.path.join(box.cgroup, "memory.max")) as f:
            assert int(f.read()) == limits.cgroup_memory_bytes
        with open(os.path.join(box.cgroup, "pids.max")) as f:
            assert int(f.read()) == 9
        box.kill(wait=0.1)


def test_where_no_cgroup_is_delegated_it_is_said_and_not_required(tmp_path, monkeypatch):
    not_ours = tmp_path / "not-ours"
    not_ours.mkdir()
    monkeypatch.setenv(sandbox.limits.CGROUP_ENV, str(not_ours))
    cgroup.delegated.cache_clear()
    try:
        where, why = cgroup.delegated()
    finally:
        cgroup.delegated.cache_clear()
    assert where is None and "not a cgroup v2 directory" in why and sandbox.limits.CGROUP_ENV in why
    layers = replace(LAYERS, cgroup=None, missing=(*LAYERS.required_missing, ("cgroup", why)))
    assert layers.complete == (not LAYERS.required_missing)
    if layers.complete:
        sandbox.check_required(layers, "the test's code", require=True)  # does not raise
        monkeypatch.setattr(policy, "_warned", set())
        policy.warn_once(layers, "the test's code")  # an info line, not the partial sandbox's warning
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n")
    procs = tmp_path / "cgroup"
    procs.write_text("0::/kubepods/pod1/ctr\n")
    assert cgroup.own_cgroup(str(mountinfo), str(procs)) == "/sys/fs/cgroup/kubepods/pod1/ctr"


def test_a_module_planted_in_a_workers_directory_is_never_imported(tmp_path):
    """Issue 51 (re-review N2): where the sandboxes of a pod share a uid (a default cluster's pods), one could write
    into another's working directory. A worker starts `python -P -m ...`, so a module planted there (a
    `hybridflow/` package shadowing ours) is not on its path; started the plain way, it would run first."""
    import subprocess
    import sys

    from hybridflow.sandbox import python_module

    (tmp_path / "planted.py").write_text("print('planted code ran')\n")
    plain = subprocess.run([sys.executable, "-m", "planted"], cwd=tmp_path, capture_output=True, text=True)
    assert "planted code ran" in plain.stdout  # what -P is for
    ours = subprocess.run(python_module("planted"), cwd=tmp_path, capture_output=True, text=True)
    assert ours.returncode != 0 and "planted code ran" not in ours.stdout
    assert "No module named planted" in ours.stderr
