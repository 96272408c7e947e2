"""A user's reward function runs as untrusted code: separate processes, a deadline per call, errors reported with
the sample that caused them, and bad files refused before anything runs."""
import os
import textwrap
import time

import pytest

from hybridflow.rewards.reward_file import RewardFileError, check_reward_file
from hybridflow.rewards.sandbox import RewardFunction


def _file(tmp_path, body: str, name: str = "reward.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


GOOD = """
import os
def compute_score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "boom":
        raise ZeroDivisionError("the user's bug")
    if solution_str == "hang":
        while True:
            pass
    if solution_str == "text":
        return "one"
    if solution_str == "env":
        return float(len([k for k in os.environ if "SECRET" in k]))
    if solution_str == "cwd":
        return float(len(os.listdir(".")))
    if solution_str == "exit":
        os._exit(3)
    exact = float(solution_str.strip() == str(ground_truth))
    return {"score": exact, "length": float(len(solution_str)), "source_ok": float(data_source == "gsm8k")}
"""


def _score(fn, solutions, truths=None):
    n = len(solutions)
    return fn.score(["gsm8k"] * n, solutions, truths or ["72"] * n, [{}] * n)


def test_scores_extras_and_errors_with_their_samples(tmp_path):
    with RewardFunction(_file(tmp_path, GOOD), timeout_seconds=5, error_score=-1.0) as fn:
        out = _score(fn, ["72", " 71", "boom", "text"])
    assert out.scores == [1.0, 0.0, -1.0, -1.0]
    assert out.extras["length"][:2] == [2.0, 3.0] and out.extras["source_ok"][:2] == [1.0, 1.0]
    assert [e.index for e in out.errors] == [2, 3]
    assert "ZeroDivisionError: the user's bug at reward.py:5" in str(out.errors[0])
    assert "'boom'" in str(out.errors[0]) and "'72'" in str(out.errors[0])  # the sample and its ground truth
    assert "returned str 'one', not a number" in str(out.errors[1])


def test_the_arithmetic_examples_reward_file_scores_by_its_rule_in_the_sandbox():
    """examples/smollm2-arithmetic-reward.yaml's function, as its job names it, in the sandboxed workers: 1 for
    the right sum, 0.1 for a wrong number, 0 for none, and its extra key `answered` for the step log. (The job's
    dataflow with a user's file is run by tests/trainer/test_end_to_end.py's word-problems job; this example's YAML, with a
    failing file, by its reward-failure test.)"""
    from hybridflow.api.manifest_io import load_job

    root = ROOT
    function = load_job(root / "examples" / "smollm2-arithmetic-reward.yaml").spec.models.reward.function
    with RewardFunction(root / function.path, function.name, timeout_seconds=5) as fn:
        out = fn.score(["arithmetic"] * 4, ["12 + 30 = 42", "12 + 30 = 41", "I do not know", " 42"], ["42"] * 4,
                       [{}] * 4)
    assert out.scores == [1.0, 0.1, 0.0, 1.0] and not out.errors
    assert out.extras["answered"] == [1.0, 1.0, 0.0, 1.0]


def test_a_hanging_call_costs_one_deadline_and_the_pool_recovers(tmp_path):
    with RewardFunction(_file(tmp_path, GOOD), workers=2, timeout_seconds=1.5) as fn:
        t0 = time.monotonic()
        out = _score(fn, ["hang", "72", "72", "72"])
        took = time.monotonic() - t0
        assert out.scores == [0.0, 1.0, 1.0, 1.0]
        assert out.errors[0].index == 0 and "timed out after 1.5 s" in out.errors[0].error
        assert took < 1.5 + 10, took  # generous: the other worker went on meanwhile
        assert _score(fn, ["72", "exit", "72"]).scores == [1.0, 0.0, 1.0]  # a dying worker is replaced too


def test_workers_see_no_credentials_and_an_empty_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-leak")
    monkeypatch.setenv("RAY_AUTH_SECRET_TOKEN", "do-not-leak")
    with RewardFunction(_file(tmp_path, GOOD), timeout_seconds=10) as fn:
        out = _score(fn, ["env", "cwd"])
    assert out.errors == [] and out.scores == [0.0, 0.0]
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "do-not-leak"  # the driver's own environment is untouched


def test_batched_functions_take_lists(tmp_path):
    body = """
    def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
        return [float(s == t) for s, t in zip(solution_strs, ground_truths)]
    """
    with RewardFunction(_file(tmp_path, body), batched=True, timeout_seconds=5) as fn:
        assert _score(fn, ["72", "7"]).scores == [1.0, 0.0]
    short = """
    def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]
    """
    with RewardFunction(_file(tmp_path, short, "short.py"), batched=True, timeout_seconds=5) as fn:
        out = _score(fn, ["72", "7"])
    assert out.scores == [0.0, 0.0] and "must return a list of 2 scores" in out.errors[0].error


@pytest.mark.parametrize("body,message", [
    ("def compute_score(a, b:\n    return 1\n", "reward.py:1: syntax error"),
    ("def score(data_source, solution_str, ground_truth, extra_info):\n    return 1\n",
     "no top-level function 'compute_score' (functions found: score)"),
    ("def compute_score(solution_str):\n    return 1\n", "must accept (data_source, solution_str, ground_truth"),
    ("async def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1\n", "is async"),
    ("def helper():\n    compute_score = 1\n    return compute_score\n",  # bound only inside a function body
     "no top-level function 'compute_score' (functions found: helper)"),
])
def test_bad_reward_files_are_refused_with_the_file_named(tmp_path, body, message):
    path = _file(tmp_path, body)
    with pytest.raises(RewardFileError) as err:
        check_reward_file(path, "compute_score")
    assert str(path) in str(err.value) and message in str(err.value)


def test_missing_file_and_failing_import_are_reported(tmp_path):
    with pytest.raises(RewardFileError, match="reward file not found"):
        check_reward_file(tmp_path / "nope.py", "compute_score")
    body = "import not_a_module_anywhere\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1\n"
    with pytest.raises(RewardFileError, match="loading it failed: ModuleNotFoundError"):
        RewardFunction(_file(tmp_path, body), timeout_seconds=5)


def test_kwargs_signature_is_accepted(tmp_path):
    body = "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n    return 0.5\n"
    with RewardFunction(_file(tmp_path, body), timeout_seconds=5) as fn:
        assert _score(fn, ["x"]).scores == [0.5]


def test_verl_names_are_passed_by_keyword_in_any_order(tmp_path):
    """verl calls compute_score by keyword: a file that orders the parameters its own way still gets each one."""
    body = """
    def compute_score(solution_str, ground_truth, data_source=None, extra_info=None):
        return solution_str == ground_truth and data_source == "gsm8k"
    """
    with RewardFunction(_file(tmp_path, body), timeout_seconds=5) as fn:
        out = _score(fn, ["72", "7"])
    assert out.errors == [] and out.scores == [1.0, 0.0]  # a bool is a score


def test_numpy_scalars_are_scores(tmp_path):
    body = """
    import numpy as np
    def compute_score(data_source, solution_str, ground_truth, extra_info):
        return {"score": np.float32(0.5), "hits": np.int64(3), "mean": np.array(0.25)}  # scalars, a 0-d array
    """
    with RewardFunction(_file(tmp_path, body), timeout_seconds=10) as fn:
        out = _score(fn, ["x"])
    assert out.errors == [] and out.scores == [0.5] and out.extras["hits"] == [3.0] and out.extras["mean"] == [0.25]


def test_a_worker_that_died_while_idle_is_replaced(tmp_path):
    with RewardFunction(_file(tmp_path, GOOD), workers=1, timeout_seconds=5) as fn:
        assert _score(fn, ["72"]).scores == [1.0]
        victim = fn._procs[0].proc
        victim.kill()
        victim.wait(5)
        out = _score(fn, ["72", "71"])
    assert out.scores == [1.0, 0.0] and out.errors == []


def test_functions_bound_otherwise_are_checked_when_loaded(tmp_path):
    ok = """
    import functools
    def _score(data_source, solution_str, ground_truth, extra_info, scale):
        return scale * float(solution_str == ground_truth)
    compute_score = functools.partial(_score, scale=2.0)
    """
    check_reward_file(_file(tmp_path, ok), "compute_score")  # not a plain def: no verdict from the AST
    with RewardFunction(tmp_path / "reward.py", timeout_seconds=5) as fn:
        assert _score(fn, ["72"]).scores == [2.0]
    bad = "compute_score = lambda solution_str: 1.0\n"
    with pytest.raises(RewardFileError, match="must accept .data_source, solution_str, ground_truth, extra_info"):
        RewardFunction(_file(tmp_path, bad, "bad.py"), timeout_seconds=5)


# --- The sandbox under attack: each attack is a real reward function file run by RewardFunction; each is refused
# or contained, its sample scores errorScore (with the reason) or shows nothing leaked, and scoring goes on.

import logging
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

from hybridflow import sandbox
from hybridflow.rewards import sandbox as reward_sandbox
from hybridflow.sandbox import policy as sandbox_policy
from hybridflow.sandbox import Limits, SandboxUnavailable

from support.paths import ROOT
from support.process_watch import ProcessWatch, kill_pids, pids_with, python_pids_with, wait_gone
LAYERS = sandbox.probe(reward_sandbox.WORKER_CHECK)
SECRET = "hf-test-secret-" + uuid.uuid4().hex

ATTACKS = """
import os, socket, sys, time


def _daemon(marker):
    # setsid + a double fork: the grandchild has a session of its own and is reparented away from the worker
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", marker])
        os._exit(0)
    os.wait()


def _bomb(depth):
    for _ in range(2):
        try:
            pid = os.fork()
        except OSError:  # the process limit
            continue
        if pid == 0:
            if depth:
                _bomb(depth - 1)
            while True:
                time.sleep(1)


def compute_score(data_source, solution_str, ground_truth, extra_info):
    what, _, arg = solution_str.partition(":")
    secret = extra_info.get("secret", "")
    if what == "ok":
        return 1.0
    if what == "connect":  # reaching it scores 1
        host, port = arg.rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=3).close()
        return 1.0
    if what == "interfaces":  # network interfaces other than a loopback
        return float(len([n for _, n in socket.if_nameindex() if n != "lo"]))
    if what == "read":  # finding the secret in the file scores 1
        with open(arg.replace("PPID", str(os.getppid())), errors="replace") as f:
            return float(secret in f.read())
    if what == "environ":
        return float(any(secret in v for v in os.environ.values()))
    if what == "scan":  # every /proc/*/environ it can read
        found = 0
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    with open(f"/proc/{p}/environ", errors="replace") as f:
                        found += secret in f.read()
                except OSError:
                    pass
        return float(found)
    if what == "sees":  # a pid of the driver's
        return float(os.path.exists(f"/proc/{arg}"))
    if what == "write":
        with open(arg, "w") as f:
            f.write("escaped")
        return 1.0
    if what == "bigfile":
        with open("big", "wb") as f:
            f.write(b"x" * int(arg))
        return 1.0
    if what == "memory":
        return float(len(bytearray(int(arg))) > 0)
    if what == "cpu":
        while True:
            pass
    if what == "bomb":
        _bomb(int(arg))
        while True:
            time.sleep(1)
    if what == "daemon":  # leaves a detached child behind, then returns or hangs
        _daemon(extra_info["marker"])
        while arg == "hang":
            time.sleep(1)
        return 1.0
    if what == "uid":
        return float(os.getuid())
    raise ValueError(what)
"""


def needs(*layers):
    missing = dict(LAYERS.missing)
    gone = [f"{x} ({missing[x]})" for x in layers if x in missing]
    if gone:
        pytest.skip("this machine's sandbox lacks " + "; ".join(gone))


def _attacks(tmp_path):
    return _file(tmp_path, ATTACKS, "attacks.py")


def _run(fn, calls, **extra):
    """calls: solution strings; extra_info carries the secret and the rest."""
    n = len(calls)
    info = {"secret": SECRET, **extra}
    return fn.score(["attack"] * n, list(calls), ["-"] * n, [info] * n)


def test_this_machine_gives_the_whole_sandbox():
    """Root with bwrap installed (`make install-tools`; the images run bwrap in a user namespace where the pod
    allows one): every layer, or the attack tests below would skip."""
    if os.geteuid() != 0:
        pytest.skip("not root: the whole sandbox needs root or user namespaces (see test_the_user_namespace_kind)")
    assert shutil.which("bwrap"), "bwrap is not installed: `make install-tools` installs it (apt-get install bubblewrap)"
    assert LAYERS.complete, LAYERS.describe()
    assert LAYERS.privileged and LAYERS.proc


def test_the_command_line_names_every_layer():
    layers = sandbox.Layers("/usr/bin/bwrap", privileged=True)
    cmd = sandbox.command(["prog"], Limits(processes=7, memory_bytes=1 << 30), layers, env={"PATH": "/bin"},
                          workdir=sandbox.WORKDIR, uid=1234567890, binds=["/tmp/user/code"], hidden=["/root"],
                          needed=["/root/venv", "/usr"])
    for flag in ("--unshare-net", "--unshare-pid", "--die-with-parent", "--new-session", "--clearenv"):
        assert flag in cmd
    joined = " ".join(cmd)
    assert "--ro-bind / /" in joined and "--proc /proc" in joined and "--tmpfs /tmp" in joined
    assert "--cap-drop ALL --cap-add CAP_SETUID --cap-add CAP_SETGID" in joined
    assert "--tmpfs /root" in joined and "--ro-bind /root/venv /root/venv" in joined and "/usr /usr" not in joined
    assert "--ro-bind /tmp/user/code /tmp/user/code" in joined and "--dir /tmp/user" in joined
    assert cmd.index("--tmpfs") < cmd.index("/tmp/user/code")  # the bind lands in the private /tmp
    assert "RLIMIT_NPROC=7" in cmd and f"RLIMIT_AS={1 << 30}" in cmd and "uid=1234567890" in cmd
    assert cmd[-1] == "prog" and "--setenv" in cmd and "SECRET" not in joined
    userns = sandbox.command(["prog"], Limits(), sandbox.Layers("/usr/bin/bwrap", userns=True), env={},
                             workdir=sandbox.WORKDIR)
    assert "--unshare-user" in userns and "--cap-add" not in userns and not any(a.startswith("uid=") for a in userns)
    bare = sandbox.command(["prog"], Limits(), sandbox.Layers(None), env={}, workdir="/tmp/w", parent=42)
    assert bare[0] == sys.executable and "parent=42" in bare and not any("RLIMIT_NPROC" in a for a in bare)


def test_a_driver_whose_home_is_tmp_still_gets_the_whole_sandbox(monkeypatch):
    """Job pods run with HOME=/tmp (their scratch emptyDir, manifests._ray_env). Hiding "the driver's home" put a
    read-only tmpfs over the sandbox's own private /tmp: it could not make its working directory, every kind of
    sandbox with bwrap failed, and the e2e pods' reward functions ran with no network, process or filesystem layer
    (an egress probe in e2e/test_user_inputs.py reached the head's Ray GCS)."""
    needs("network", "filesystem")
    monkeypatch.setenv("HOME", "/tmp")
    assert "/tmp" in sandbox.default_hidden()
    layers = sandbox.probe.__wrapped__()  # not the probe cached for this process's own HOME
    assert layers.complete and layers.bwrap, layers.describe()
    # and the warning of a partial sandbox names why each kind with bwrap failed, not only the first (bwrap as root
    # fails as expected in a user namespace, which hid the read-only /tmp of the one that should have run)
    failed = {"bwrap as root, a fresh uid": "PermissionError: EPERM", "bwrap in a user namespace": "OSError: EROFS",
              "no bwrap, a fresh uid": "EINVAL"}
    why = dict(sandbox.missing_layers(sandbox.Layers(None), "/usr/bin/bwrap", failed))["network"]
    assert "bwrap as root, a fresh uid: PermissionError: EPERM" in why and "user namespace: OSError: EROFS" in why


def test_no_network(tmp_path):
    """A connect to a port the test listens on (127.0.0.1), to an outside address, and the interfaces it sees."""
    needs("network")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        with RewardFunction(_attacks(tmp_path), workers=1, timeout_seconds=10) as fn:
            out = _run(fn, [f"connect:127.0.0.1:{port}", "connect:1.1.1.1:53", "interfaces", "ok"])
    finally:
        listener.close()
    errors = {e.index: e.error for e in out.errors}
    assert out.scores == [0.0, 0.0, 0.0, 1.0], errors
    assert "ConnectionRefusedError" in errors[0], errors  # its own loopback: nothing listens there
    assert "Network is unreachable" in errors[1], errors  # no route out: only a loopback
    assert 2 not in errors  # it ran, and saw no interface but lo


def test_no_credentials_in_its_environment_or_through_proc(tmp_path, monkeypatch):
    """The driver's secrets in its environment; the reward reads os.environ, /proc/self, its parent's, pid 1's and
    the driver's /proc/<pid>/environ, and scans every /proc/*/environ."""
    needs("processes", "environment")
    for k in ("RAY_AUTH_TOKEN", "AWS_SECRET_ACCESS_KEY", "HYBRIDFLOW_FAKE_KEY"):
        monkeypatch.setenv(k, SECRET)
    me = os.getpid()
    attacks = ["environ", "read:/proc/self/environ", "read:/proc/PPID/environ", "read:/proc/1/environ",
               f"read:/proc/{me}/environ", "scan", f"sees:{me}", "ok"]
    with RewardFunction(_attacks(tmp_path), workers=1, timeout_seconds=10, error_score=-1.0) as fn:
        out = _run(fn, attacks)
    errors = {e.index: e.error for e in out.errors}
    assert all(s != 1.0 for s in out.scores[:-1]) and out.scores[-1] == 1.0, (out.scores, errors)
    assert "No such file or directory" in errors[4], errors  # the driver is not in its PID namespace
    assert out.scores[6] == 0.0  # nor is any pid of the driver's
    assert out.scores[0] == 0.0 and out.scores[1] == 0.0 and out.scores[5] == 0.0


def test_no_writes_outside_its_private_directory(tmp_path, monkeypatch):
    """Into the test's own directory (which holds the reward file), the reward file itself, the repository,
    /var/tmp (world-writable), /tmp; past the file-size limit; and reading what the driver keeps in /tmp and its
    home."""
    needs("filesystem", "limits")
    tag = uuid.uuid4().hex
    host_tmp = Path(f"/tmp/hf-sandbox-{tag}")
    host_tmp.write_text(SECRET)  # world-readable, in the driver's /tmp
    home = Path(f"/var/tmp/hf-sandbox-home-{tag}")
    home.mkdir()
    (home / "token").write_text(SECRET)
    os.chmod(home, 0o755)
    monkeypatch.setenv("HOME", str(home))  # the driver's home: hidden, though world-readable
    tmp_path.chmod(0o755)  # what the sandbox sees of it: the reward file's directory, read-only
    reward = _attacks(tmp_path)
    targets = [tmp_path / "escaped.txt", reward, ROOT / f"escaped-{tag}", Path(f"/var/tmp/escaped-{tag}")]
    try:
        with RewardFunction(reward, workers=1, timeout_seconds=10,
                            limits=Limits(file_size_bytes=1 << 20)) as fn:
            out = _run(fn, [*(f"write:{t}" for t in targets), f"write:/tmp/{tag}", f"bigfile:{4 << 20}",
                            "bigfile:1000", f"read:{host_tmp}", f"read:{home}/token", "ok"])
        errors = {e.index: e.error for e in out.errors}
        for i in range(3):  # the read-only view, and the uid too where it differs (these are root's 0755)
            assert "Read-only file system" in errors.get(i, "") or "Permission denied" in errors.get(i, ""), (i, errors)
        assert "Read-only file system" in errors.get(3, ""), errors  # /var/tmp is everyone's: only the view stops it
        assert reward.read_text() == textwrap.dedent(ATTACKS)
        assert not any(t.exists() for t in targets[::2] + targets[3:]), "a write escaped"
        assert out.scores[4] == 1.0 and not Path(f"/tmp/{tag}").exists()  # /tmp is its own
        assert "File too large" in errors[5] and out.scores[6] == 1.0, errors
        assert "No such file or directory" in errors[7] and "No such file or directory" in errors[8], errors
        assert out.scores[9] == 1.0
    finally:
        host_tmp.unlink()
        shutil.rmtree(home)
        for t in [*targets[2:], Path(f"/tmp/{tag}")]:
            t.unlink(missing_ok=True)


def test_another_uid_cannot_read_the_drivers_files(tmp_path):
    """Root's 0600 key file beside the reward file (whose directory it sees): not readable by the sandbox's uid."""
    needs("user")
    if not LAYERS.other_uid:
        pytest.skip("not root: the sandbox's user namespace maps to the driver's own uid")
    tmp_path.chmod(0o755)
    key, data = tmp_path / "key", tmp_path / "data.txt"
    key.write_text(SECRET)
    key.chmod(0o600)
    data.write_text(SECRET)  # 0644: a data file the reward may read beside itself
    with RewardFunction(_attacks(tmp_path), workers=1, timeout_seconds=10) as fn:
        out = _run(fn, [f"read:{key}", f"read:{data}", "uid", "ok"])
    errors = {e.index: e.error for e in out.errors}
    assert "PermissionError" in errors.get(0, ""), (out.scores, errors)
    assert out.scores[1] == 1.0, errors
    assert out.scores[2] not in (float(os.getuid()), 0.0) and out.scores[3] == 1.0


def test_a_fork_bomb_is_held_by_the_process_limit_and_the_deadline(tmp_path):
    """A bomb of 62 processes (bounded, to keep the machine fine) against a limit of 12; the deadline ends it and
    nothing of it is left."""
    needs("limits", "user")
    reward = _attacks(tmp_path)
    limit = 12
    with RewardFunction(reward, workers=1, timeout_seconds=4, limits=Limits(processes=limit)) as fn:
        with ProcessWatch(str(reward), python=True) as watch:
            out = _run(fn, ["bomb:4", "ok"])
        assert out.scores == [0.0, 1.0] and "timed out after 4 s" in out.errors[0].error
        assert 2 < watch.seen <= limit, watch.seen  # it did fork, up to the limit (the worker counts)
        time.sleep(0.5)
        left = python_pids_with(str(reward))
        assert len(left) == 1, left  # only the worker that replaced it
        assert _run(fn, ["ok", "ok"]).scores == [1.0, 1.0]
    kill_pids(pids_with(str(reward)))


def test_nothing_outlives_its_sandbox(tmp_path):
    """setsid + a double fork: a detached child, tagged in its command line so the test sees it on the machine.
    It lives in the worker's sandbox as long as the worker does (bounded by its limits), and dies with it: when its
    call's deadline kills the worker, and when the pool closes."""
    needs("processes")
    marker = "hf-sandbox-daemon-" + uuid.uuid4().hex
    try:
        with RewardFunction(_attacks(tmp_path), workers=1, timeout_seconds=3) as fn:
            with ProcessWatch(marker) as watch:
                out = _run(fn, ["daemon:hang", "ok"], marker=marker)
            assert out.scores == [0.0, 1.0] and "timed out" in out.errors[0].error
            assert watch.seen == 1, "the detached child never showed: nothing to outlive the deadline"
            assert wait_gone(marker) == [], "a detached child outlived its call's deadline"
            out = _run(fn, ["daemon:return"], marker=marker + "-2")
            assert out.scores == [1.0]
            deadline = time.monotonic() + 10  # it execs its marker after the call returned
            while not pids_with(marker + "-2") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pids_with(marker + "-2"), "the detached child should be seen while its worker lives"
        assert wait_gone(marker) == [], "a detached child outlived its worker"
    finally:
        kill_pids(pids_with(marker))


def test_killing_the_driver_kills_its_sandboxes(tmp_path):
    """A driver process runs a RewardFunction whose call leaves a detached child and hangs; kill -9 the driver:
    its workers and that child go with it."""
    needs("processes")
    reward = _attacks(tmp_path)
    marker = "hf-sandbox-orphan-" + uuid.uuid4().hex
    script = ("import os, sys\nfrom hybridflow.rewards.sandbox import RewardFunction\n"
              "fn = RewardFunction(sys.argv[1], workers=1, timeout_seconds=600)\n"
              "fn.score(['x'], ['daemon:hang'], ['-'], [{'marker': os.environ['MARKER']}])\n")
    # the marker goes by the environment: only the detached child's command line holds it
    driver = subprocess.Popen([sys.executable, "-c", script, str(reward)], env={**os.environ, "MARKER": marker})
    try:
        deadline = time.monotonic() + 60
        while not pids_with(marker) and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.1)
        assert pids_with(marker), "the driver's reward never started its child"
        assert len(python_pids_with(str(reward))) == 2  # the driver and its worker
        driver.kill()
        driver.wait(10)
        assert wait_gone(marker) == [], "the detached child outlived the driver"
        assert wait_gone(str(reward)) == [], "a sandbox outlived the driver"
    finally:
        driver.kill()
        kill_pids(pids_with(marker) + pids_with(str(reward)))


def test_memory_cpu_and_the_pool_goes_on(tmp_path):
    """A 1 GiB allocation against a 512 MiB address space; a busy loop against 2 CPU seconds (well before its
    30 s deadline): each scores errorScore with why, and the next samples score."""
    needs("limits")
    limits = Limits(memory_bytes=512 << 20, cpu_seconds=2)
    with RewardFunction(_attacks(tmp_path), workers=1, timeout_seconds=30, error_score=-1.0, limits=limits) as fn:
        t0 = time.monotonic()
        out = _run(fn, [f"memory:{1 << 30}", "ok", "cpu", "ok"])
        took = time.monotonic() - t0
    errors = {e.index: e.error for e in out.errors}
    assert out.scores == [-1.0, 1.0, -1.0, 1.0], errors
    assert "MemoryError" in errors[0], errors
    assert "died" in errors[2] and "CPU-time limit" in errors[2], errors
    assert took < 25, took


def test_without_bwrap_it_warns_once_and_scores(tmp_path, monkeypatch, caplog):
    """A machine without bwrap: one warning naming the missing layers and the remaining ones, then scoring as
    usual; required (the argument, or HYBRIDFLOW_SANDBOX=require), it refuses to start."""
    bare = sandbox.probe(reward_sandbox.WORKER_CHECK, bwrap=None)
    monkeypatch.setattr(sandbox_policy, "_warned", set())  # where warn_once keeps it
    caplog.set_level(logging.WARNING, logger="hybridflow.sandbox")
    for _ in range(2):
        with RewardFunction(_file(tmp_path, GOOD), workers=1, timeout_seconds=5, layers=bare) as fn:
            assert _score(fn, ["72", "cwd", "env"]).scores == [1.0, 0.0, 0.0]
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "hybridflow.sandbox"]
    assert "missing network, processes, filesystem (bwrap is not installed" in warning, warning
    assert "it keeps rlimits, a clean environment, a new session and a private temporary directory" in warning
    assert "HYBRIDFLOW_SANDBOX=require" in warning
    with pytest.raises(SandboxUnavailable, match="network"):
        RewardFunction(_file(tmp_path, GOOD), workers=1, layers=bare, require_sandbox=True)
    monkeypatch.setenv("HYBRIDFLOW_SANDBOX", "require")
    with pytest.raises(SandboxUnavailable, match="lacks network"):
        RewardFunction(_file(tmp_path, GOOD), workers=1, layers=bare)


@pytest.mark.parametrize("kind", ["userns", "userns-no-proc"])
def test_the_user_namespace_sandbox_of_pods(tmp_path, monkeypatch, kind):
    """What a non-root pod gets where user namespaces are allowed (run here as root, so the uid outside stays the
    driver's): no network, no credentials, its own /proc (or none, where /proc cannot be mounted)."""
    if not shutil.which("bwrap"):
        pytest.skip("bwrap is not installed")
    layers = sandbox.Layers(shutil.which("bwrap"), userns=True, proc=kind == "userns", how=kind)
    if (why := sandbox.try_layers(layers, reward_sandbox.WORKER_CHECK, Limits())) is not None:
        pytest.skip(f"user namespaces refused here: {why}")
    monkeypatch.setenv("RAY_AUTH_TOKEN", SECRET)
    with RewardFunction(_attacks(tmp_path), workers=1, timeout_seconds=10, layers=layers) as fn:
        out = _run(fn, ["connect:1.1.1.1:53", "environ", "scan", f"sees:{os.getpid()}", f"write:{tmp_path}/x",
                        "uid", "ok"])
    errors = {e.index: e.error for e in out.errors}
    assert "Network is unreachable" in errors[0] and out.scores[1:4] == [0.0, 0.0, 0.0], (out.scores, errors)
    assert "Read-only file system" in errors[4] and out.scores[5:] == [65534.0, 1.0], errors


def test_workers_started_from_a_thread_outlive_it(tmp_path):
    """A parent-death signal fires when the *thread* that started a process ends: sandboxes are started from one
    long-lived thread, so a pool made (or a worker replaced) in a short-lived thread keeps its workers."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("fn", RewardFunction(_file(tmp_path, GOOD), workers=1)))
    t.start()
    t.join()
    with box["fn"] as fn:
        time.sleep(0.5)
        assert fn._procs[0].proc.poll() is None, "the worker died with the thread that started it"
        assert _score(fn, ["72"]).scores == [1.0]


# --- The pipe back to the driver: the user's code runs in the worker process, so it can write onto the worker's
# reply pipe (a dup of its stdout among its fds). What it writes there is parsed as JSON only, never unpickled, and
# never taken for a reply: a crafted pickle runs nothing in the driver, a forged reply scores nothing.

FORGER = """
import os, pickle, struct, sys, time


class _Escape:
    '''Unpickled, creates the marker file: in the driver's /tmp, which no sandbox can see or write.'''
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _forged(n):
    return b"".join(b'{"id": "%d", "kind": "ok", "value": [1.0, {"forged": 1.0}], "cpu": 0}\\n' % i for i in range(n))


def _own_id():
    # the id of the call being answered, from the worker's frames: a forgery the driver cannot tell from its reply
    f = sys._getframe()
    while f is not None:
        for v in list(f.f_locals.values()):
            if isinstance(v, dict) and v.get("op") == "call":
                return v["id"].encode()
        f = f.f_back


def _writes(what, marker):
    payload = pickle.dumps(_Escape(marker))
    return {
        # the pickle framed as multiprocessing.connection frames it (a 4-byte length first), then a forged reply
        "pickle": lambda: struct.pack("!i", len(payload)) + payload + _forged(1),
        "forge": lambda: _forged(3) + b'{"kind": "ok", "value": [1.0, {}], "cpu": 0}\\n',  # guessed ids, or none
        "half": lambda: b'{"id": "',  # half a line, then it hangs
        "deep": lambda: b"[" * 100000 + b"\\n",  # JSON nested past what the parser recurses into
        "own-id": lambda: b'{"id": "%s", "kind": "ok", "value": [1%s, {}], "cpu": 0}\\n' % (_own_id(), b"0" * 400),
    }.get(what, lambda: None)()


def compute_score(data_source, solution_str, ground_truth, extra_info):
    writes = _writes(solution_str, extra_info["marker"])
    for fd in range(1, 31) if writes else ():
        try:
            os.write(fd, writes)
        except OSError:  # not open, or not for writing
            pass
    while solution_str == "half":
        time.sleep(1)
    return 0.5 if writes else 1.0
"""


@pytest.mark.timeout(120)  # a reply the driver misreads must not hang it either (pickle framing did)
@pytest.mark.parametrize("workers", [1, 2])
def test_what_the_reward_code_writes_onto_the_pipe_is_never_unpickled_nor_a_reply(tmp_path, workers):
    marker = tmp_path / "unpickled-in-the-driver"
    with RewardFunction(_file(tmp_path, FORGER, "forger.py"), workers=workers, timeout_seconds=5,
                        error_score=-1.0) as fn:
        first = _run(fn, ["ok", "pickle"], marker=str(marker))
        assert not marker.exists(), "the driver unpickled what the reward code wrote"
        out = _run(fn, ["ok", "forge", "ok", "pickle", "ok"], marker=str(marker))
        errors = {e.index: e.error for e in first.errors + out.errors}
        # not JSON: that sample's error (its worker is replaced); JSON with another id: skipped, the function's own
        assert first.scores == [1.0, -1.0] and out.scores == [1.0, 0.5, 1.0, -1.0, 1.0], errors
        assert set(errors) == {1, 3} and all("the reward code wrote onto it" in e for e in errors.values()), errors
        assert "forged" not in out.extras
        assert _run(fn, ["ok"] * 4, marker=str(marker)).scores == [1.0] * 4  # the pool goes on
    assert not marker.exists()


def test_a_reply_forged_with_the_calls_own_id_still_scores_only_a_finite_number(tmp_path):
    """Code that finds its call's id in the worker's frames can forge that call's reply (its own sample, which it
    scores anyway): what it sends is checked again, and the worker's real reply, read later, is skipped. JSON too
    deep to parse is that sample's error."""
    with RewardFunction(_file(tmp_path, FORGER, "forger.py"), workers=1, timeout_seconds=5, error_score=-1.0) as fn:
        out = _run(fn, ["ok", "own-id", "ok", "deep", "ok"], marker=str(tmp_path / "marker"))
    errors = {e.index: e.error for e in out.errors}
    assert out.scores == [1.0, -1.0, 1.0, -1.0, 1.0], errors
    assert "the reward worker's reply is not a score: [1000" in errors[1], errors
    assert "the reward code wrote onto it" in errors[3], errors


def test_half_a_line_on_the_pipe_costs_one_deadline(tmp_path):
    """The driver reads whole lines with a deadline: half of one, then silence, is that sample's timeout."""
    with RewardFunction(_file(tmp_path, FORGER, "forger.py"), workers=2, timeout_seconds=1.5) as fn:
        t0 = time.monotonic()
        out = _run(fn, ["half", "ok", "ok", "ok"], marker=str(tmp_path / "marker"))
        took = time.monotonic() - t0
    assert out.scores == [0.0, 1.0, 1.0, 1.0] and [e.index for e in out.errors] == [0], out.errors
    assert "timed out after 1.5 s" in out.errors[0].error
    assert took < 1.5 + 10, took


def test_validate_loads_the_reward_file_in_its_sandbox_and_names_what_fails_at_load(tmp_path):
    """A reward file that parses but cannot load (an import the sandbox lacks, a name that is not a function) is a
    problem of `hybridflow validate` and `run` before anything starts (trainer.preflight.loaded_code_problems), not
    a job failure once the job has built its reward workers."""
    from hybridflow.api import RLHFJob
    from hybridflow.trainer.preflight import check_runtime_paths, loaded_code_problems

    def problems(body):
        path = _file(tmp_path, body)
        job = RLHFJob.model_validate({"spec": {"models": {"actor": {"source": "smollm2"}, "reward": {"function": {
            "path": str(path)}}}, "data": {"task": "products"}, "trainer": {"checkpointDir": str(tmp_path / "c")}}})
        assert check_runtime_paths(job) == []  # it parses, and binds compute_score
        return loaded_code_problems(job)

    (missing,) = problems("import a_module_the_sandbox_lacks\n\ndef compute_score(data_source, solution_str, "
                          "ground_truth, extra_info):\n    return 1.0\n")
    assert missing.startswith("spec.models.reward.function: ") and "loading it failed: ModuleNotFoundError: No " \
        "module named 'a_module_the_sandbox_lacks' at reward.py:1" in missing, missing
    (bound,) = problems("compute_score = 3\n")
    assert "'compute_score' is not a function in the file" in bound, bound
    assert problems("def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n") == []
