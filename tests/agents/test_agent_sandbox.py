"""The agent's sandbox under attack through the model's own turns: each attack is model text holding a `<tool_call>`
(the built-in `python` tool, or a user tool from a tools file the test writes), parsed with parse_tool_calls and run
with LocalTools.call exactly as the episode loop does, or an environment step of a user environment file run through
run_episodes. Each attack fails, and its failure is the tool's answer (a ToolResult the model reads) or the
episode's reported error: never an exception in the driver, never a process left on the machine."""
from __future__ import annotations

import http.server
import json
import os
import textwrap
import threading
import time
import tracemalloc
import urllib.request
import uuid
from pathlib import Path

import pytest

from hybridflow import sandbox, wire
from hybridflow.agents import local, tool_worker
from hybridflow.agents.local import EnvironmentCode, LocalSessions, LocalTools
from hybridflow.agents.loop import EpisodeSettings, run_episodes
from hybridflow.agents.protocol import ToolResult
from hybridflow.agents.registry import TOOLS
from hybridflow.agents.tool_file import read_tools_file
from hybridflow.agents.toolcalls import parse_tool_calls
from hybridflow.sandbox import launcher
from support.agent_doubles import CharCodec, ScriptedPolicyDouble
from support.process_watch import ProcessWatch, kill_pids, pids_with, wait_gone

from support.paths import ROOT

LAYERS = sandbox.probe(local.WORKER_CHECK)  # what LocalTools and LocalSessions get on this machine
SECRET = "hf-agent-secret-" + uuid.uuid4().hex
DEADLINE = 2.0  # the hanging tools' deadline
MARGIN = 3.0  # what killing a sandbox and answering may add to it


def needs(*layers: str) -> None:
    """Skip where this machine's sandbox lacks a layer the test attacks; fail instead where the whole sandbox is
    expected: required (HYBRIDFLOW_SANDBOX=require), or as root (CI: bwrap is installed, `make install-tools`)."""
    missing = dict(LAYERS.missing)
    gone = [f"{x} ({missing[x]})" for x in layers if x in missing]
    if gone:
        why = f"the agent's sandbox lacks {'; '.join(gone)}: {LAYERS.describe()}"
        if sandbox.required() or os.geteuid() == 0:
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def tools() -> LocalTools:
    return LocalTools({"python": TOOLS["python"]}, timeout_seconds=10)


@pytest.fixture(scope="module")
def hasty() -> LocalTools:
    """The same tool with a short deadline, for the attacks that hang."""
    return LocalTools({"python": TOOLS["python"]}, timeout_seconds=DEADLINE)


def _turn(name: str, arguments: dict) -> str:
    return f"Let me check.\n<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _call(tools: LocalTools, code: str, name: str = "python", **arguments) -> ToolResult:
    """The model's turn holding one tool call, parsed and run as the loop runs it; the answer must be a ToolResult
    (an exception here fails the test: the loop would have lost its rollout)."""
    (call,) = parse_tool_calls(_turn(name, {"code": textwrap.dedent(code)} if code else arguments))
    assert call.error is None, call.error
    result = tools.call(call.name, call.arguments)
    assert isinstance(result, ToolResult), result
    return result


def _lines(result: ToolResult) -> dict[str, str]:
    """The attack's report: 'key value' lines it printed."""
    return dict(line.split(" ", 1) for line in result.text.strip().splitlines() if " " in line)


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` on the machine (what the driver started and still holds)."""
    parents: dict[int, int] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    parents[int(p)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        kids = [c for c, pp in parents.items() if pp == parent]
        out.update(kids)
        todo.extend(kids)
    return out


class _Server:
    """A real HTTP server of the driver's on 127.0.0.1, counting the requests that reach it."""

    def __init__(self) -> None:
        self.hits = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.hits += 1
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"reached")

            def log_message(self, *_) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "_Server":
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# -- network, credentials, filesystem, processes ----------------------------------------------------------------------

def test_no_network_to_the_drivers_loopback_or_outside(tools):
    needs("network")
    with _Server() as server:
        url = f"http://127.0.0.1:{server.port}/"
        assert urllib.request.urlopen(url, timeout=5).read() == b"reached"  # it answers the driver
        server.hits = 0
        result = _call(tools, f"""
            import socket, urllib.error, urllib.request
            for key, url in [("loopback", {url!r}), ("outside", "http://1.1.1.1:80/")]:
                try:
                    print(key, "REACHED", urllib.request.urlopen(url, timeout=3).read())
                except urllib.error.HTTPError as e:  # a server answered
                    print(key, "REACHED", e.code)
                except OSError as e:
                    print(key, getattr(e, "reason", e))
            print("interfaces", sorted(n for _, n in socket.if_nameindex()))
            """)
    seen = _lines(result)
    assert result.error is None and "REACHED" not in result.text, result.text
    assert "Connection refused" in seen["loopback"], result.text  # its own loopback: nothing listens there
    assert "Network is unreachable" in seen["outside"], result.text  # no route out
    assert seen["interfaces"] == "['lo']" and server.hits == 0, (seen, server.hits)


def test_no_credentials_from_the_environment_the_home_or_a_secrets_dir(tools, monkeypatch):
    needs("processes", "environment", "filesystem")
    for k in ("AWS_SECRET_ACCESS_KEY", "RAY_AUTH_TOKEN", "HF_TOKEN"):
        monkeypatch.setenv(k, SECRET)
    tag = uuid.uuid4().hex
    home, secrets = Path(f"/var/tmp/hf-agent-home-{tag}"), Path(f"/var/tmp/hf-agent-secrets-{tag}")
    try:
        for d in (home, secrets):  # world-readable, outside /tmp: only hiding stops a read
            d.mkdir()
            d.chmod(0o755)
            (d / "token").write_text(SECRET)
            (d / "token").chmod(0o644)
        monkeypatch.setenv("HOME", str(home))  # the driver's home
        monkeypatch.setattr(launcher, "SECRET_DIRS", (*sandbox.SECRET_DIRS, str(secrets)))  # like /var/run/secrets
        me = os.getpid()
        result = _call(tools, f"""
            import os
            secret = {SECRET!r}
            def found(path):
                try:
                    with open(path, errors="replace") as f:
                        return secret in f.read()
                except OSError as e:
                    return type(e).__name__
            print("environ", any(secret in v for v in os.environ.values()))
            print("self", found("/proc/self/environ"))
            print("driver", found("/proc/{me}/environ"))
            print("scan", sum(found(f"/proc/{{p}}/environ") is True for p in os.listdir("/proc") if p.isdigit()))
            print("home", found({str(home / "token")!r}), os.listdir({str(home)!r}))
            print("secrets", found({str(secrets / "token")!r}), os.listdir({str(secrets)!r}))
            """)
    finally:
        for d in (home, secrets):
            (d / "token").unlink(missing_ok=True)
            d.rmdir()
    seen = _lines(result)
    assert result.error is None and SECRET not in result.text, result.text
    assert seen == {"environ": "False", "self": "False", "driver": "FileNotFoundError", "scan": "0",
                    "home": "FileNotFoundError []", "secrets": "FileNotFoundError []"}, result.text


USER_TOOLS = '''
def save(path: str, text: str = ""):
    """Appends text to a file (the model picks the path)."""
    with open(path, "a") as f:
        f.write(text)
    return "saved"
'''


def test_no_writes_to_the_repo_or_the_drivers_files_and_a_private_tmp(tools, tmp_path, monkeypatch):
    """A user tool whose path argument the model picks (the tools file's own directory is bound read-only), and
    the python tool writing into the driver's files; its own /tmp works, and is gone with its call."""
    needs("filesystem")
    tag = uuid.uuid4().hex
    tmp_path.chmod(0o755)  # what the sandbox sees of it: the tools file's directory, read-only
    tools_file = tmp_path / "tools.py"
    tools_file.write_text(USER_TOOLS)
    home = Path(f"/var/tmp/hf-agent-home-{tag}")
    home.mkdir()
    (home / "notes").write_text("mine")
    monkeypatch.setenv("HOME", str(home))
    targets = [tools_file, tmp_path / "escaped", ROOT / "pyproject.toml", ROOT / f"escaped-{tag}",
               home / "notes", Path(f"/var/tmp/escaped-{tag}")]
    before = {t: t.read_bytes() for t in targets if t.exists()}
    user = LocalTools(read_tools_file(tools_file), timeout_seconds=10)
    try:
        answers = [_call(user, "", "save", path=str(t), text="escaped") for t in targets]
        own = _call(tools, f"""
            import os
            for t in {[str(t) for t in targets]!r}:
                try:
                    open(t, "a").close()
                    print(t, "WROTE")
                except OSError as e:
                    print(t, e.strerror)
            with open("/tmp/own-{tag}", "w") as f:
                f.write("{tag}")
            print("own", open("/tmp/own-{tag}").read(), os.getcwd())
            """)
        again = _call(tools, f"import os\nprint('again', os.path.exists('/tmp/own-{tag}'), os.listdir('.'))")
        for t, a in zip(targets, answers):
            assert a.error and a.text.startswith("Error: ") and ("Read-only file system" in a.text or
                                                                 "Permission denied" in a.text), (t, a)
        seen = _lines(own)
        assert "WROTE" not in own.text, own.text
        for t in targets:  # the driver's /tmp is not even there: its /tmp is a fresh one
            expected = ("No such file or directory",) if t.is_relative_to(tmp_path) else (
                "Read-only file system", "Permission denied")
            assert seen[str(t)] in expected, own.text
        assert {t: t.read_bytes() for t in targets if t.exists()} == before, "a write escaped"
        assert seen["own"] == f"{tag} {sandbox.WORKDIR}", own.text  # its /tmp works
        assert _lines(again)["again"] == "False []" and not Path(f"/tmp/own-{tag}").exists()  # and is its own
    finally:
        (home / "notes").unlink()
        home.rmdir()
        for t in (ROOT / f"escaped-{tag}", Path(f"/var/tmp/escaped-{tag}"), tmp_path / "escaped"):
            t.unlink(missing_ok=True)


READ_TOOLS = '''
def read(path: str):
    """Reads a file (the model picks the path)."""
    with open(path) as f:
        return f"[{f.read()}]"


class Environment:
    """Answers each action, a path, with what that file holds."""

    def reset(self, sample):
        return ""

    def step(self, action):
        try:
            with open(action) as f:
                return f"[{f.read()}]", 0.0, False, {}
        except OSError as e:
            return type(e).__name__, 0.0, False, {}
'''


def test_the_jobs_data_and_checkpoints_are_out_of_its_tools_and_environments_sight():
    """The answers a tool could read instead of working the problem out: the job's prompt files (one beside the
    tools file, in the directory the sandbox binds for it; others under a glob) and its checkpoint directory (the
    step and rollout logs), all world-readable. Through the python tool, a user tool and an environment step the
    files cannot be opened and the directory is empty; a file beside them that is not the job's reads as it is."""
    needs("filesystem")
    from hybridflow.api import JobSpec
    from hybridflow.data.files import job_private_paths

    tag = uuid.uuid4().hex
    root = Path(f"/var/tmp/hf-agent-job-{tag}")  # outside /tmp, which a sandbox does not see anyway
    answer = f"answer-{tag}"
    files = {"tools.py": READ_TOOLS, "eval.jsonl": answer, "notes.txt": "kept", "data/train-0.jsonl": answer,
             "data/train-1.jsonl": answer, "runs/steps.jsonl": answer, "runs/rollouts/step_00000001.jsonl": answer}
    try:
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
        for d in [p for p in root.rglob("*") if p.is_dir()] + [root]:
            d.chmod(0o755)
        for f in (p for p in root.rglob("*") if p.is_file()):
            f.chmod(0o644)
        spec = JobSpec.model_validate({
            "models": {"actor": {"source": "smollm2"}, "reward": {"type": "scorer", "scorers": [{"name": "math"}]}},
            "data": {"source": "files", "train": [str(root / "data" / "train-*.jsonl")],
                     "eval": str(root / "eval.jsonl")},
            "trainer": {"checkpointDir": str(root / "runs")}})
        private = job_private_paths(spec)
        assert set(private) == {str(root / "data" / "train-0.jsonl"), str(root / "data" / "train-1.jsonl"),
                                str(root / "eval.jsonl"), str(root / "runs")}
        targets = [root / n for n in ("eval.jsonl", "data/train-0.jsonl", "runs/steps.jsonl",
                                      "runs/rollouts/step_00000001.jsonl", "notes.txt")]
        python = LocalTools({"python": TOOLS["python"]}, timeout_seconds=10, private=private)
        own = _call(python, f"""
            import os
            for t in {[str(t) for t in targets]!r}:
                try:
                    print(t, repr(open(t).read()))
                except OSError as e:
                    print(t, type(e).__name__)
            print("runs", os.listdir({str(root / "runs")!r}))
            """)
        seen = _lines(own)
        assert answer not in own.text, own.text
        # a private file is /dev/null, which bwrap's nodev bind will not open
        assert [seen[str(t)] for t in targets] == [
            "PermissionError", "PermissionError", "FileNotFoundError", "FileNotFoundError", "'kept'"], own.text
        assert seen["runs"] == "[]", own.text

        user = LocalTools(read_tools_file(root / "tools.py"), timeout_seconds=10, private=private)
        answers = [_call(user, "", "read", path=str(t)).text for t in targets]
        assert all("Permission denied" in a for a in answers[:2]) and answers[4] == "[kept]", answers
        assert all("No such file or directory" in a for a in answers[2:4]), answers

        sessions = LocalSessions(EnvironmentCode.from_file(root / "tools.py", "Environment"), step_timeout_seconds=10,
                                 private=private)
        try:
            sid, _ = sessions.open({"prompt": "p"})
            steps = [sessions.step(sid, str(t)).text for t in targets]
        finally:
            sessions.shutdown()
        assert steps == ["PermissionError", "PermissionError", "FileNotFoundError", "FileNotFoundError", "[kept]"], steps
    finally:
        for f in sorted(root.rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() else f.unlink()
        root.rmdir()


def test_it_cannot_see_or_signal_the_driver(tools):
    needs("processes")
    me = os.getpid()
    result = _call(tools, f"""
        import os
        try:
            os.kill({me}, 0)
            print("signal", "SENT")
        except OSError as e:
            print("signal", type(e).__name__)
        print("proc", os.path.exists("/proc/{me}"))
        cmds = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    cmds.append(open(f"/proc/{{p}}/cmdline", "rb").read())
                except OSError:
                    pass
        print("pytest", any(b"pytest" in c for c in cmds))
        """)
    assert _lines(result) == {"signal": "ProcessLookupError", "proc": "False", "pytest": "False"}, result.text


# -- deadlines and process limits -----------------------------------------------------------------------------------

HANG = """
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)", {marker!r}])  # tagged, to be found
    {hang}
    """


@pytest.mark.parametrize("hang", ["while True: pass", "time.sleep(1000)"])
def test_a_hanging_tool_times_out_at_its_deadline_and_leaves_nothing(hasty, hang):
    needs("processes")
    marker = "hf-agent-hang-" + uuid.uuid4().hex
    _call(hasty, "print('warm')")  # the sandboxes' spawner thread is the driver's for good: not a leftover
    kids = _descendants(os.getpid())
    try:
        with ProcessWatch(marker) as watch:
            t0 = time.monotonic()
            result = _call(hasty, HANG.format(marker=marker, hang=hang))
            took = time.monotonic() - t0
        assert result.timed_out and result.error == "timed out", result
        assert result.text == f"Error: the python tool timed out after {DEADLINE:g} s.", result.text
        assert DEADLINE <= took < DEADLINE + MARGIN, took
        assert watch.seen == 1, "the tagged child never showed: nothing could have been left behind"
        assert wait_gone(marker, 2) == [], "a process outlived its tool call"
        assert _descendants(os.getpid()) == kids
    finally:
        kill_pids(pids_with(marker))


BOMB = """
import os, time
for _ in range(7):  # up to 128 processes without a process limit: bounded, to keep the machine fine
    try:
        os.fork()
    except OSError:
        pass
time.sleep(1000)
"""

DETACH = """
    import os, sys, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(1000)", {marker!r}])
        os._exit(0)
    os.wait()
    for _ in range(100):  # until it runs, seen from inside
        if any({marker!r}.encode() in open(f"/proc/{{p}}/cmdline", "rb").read()
               for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{{p}}/cmdline")):
            break
        time.sleep(0.05)
    time.sleep(0.3)  # for the test's watch
    print("detached", {marker!r})
    """


def test_a_fork_bomb_is_held_by_the_process_limit_and_nothing_is_left(hasty):
    needs("limits", "user", "processes")
    marker = "hf-agent-bomb-" + uuid.uuid4().hex
    _call(hasty, "print('warm')")
    kids = _descendants(os.getpid())
    try:
        with ProcessWatch(marker, python=True) as watch:
            result = _call(hasty, f"""
                import subprocess, sys, time
                subprocess.Popen([sys.executable, "-c", {BOMB!r}, {marker!r}])
                time.sleep(1000)
                """)
        assert result.timed_out, result
        assert 2 < watch.seen <= hasty.limits.processes, watch.seen  # it forked, up to the sandbox's limit
        assert wait_gone(marker, 2) == [], "a fork outlived its tool call"
        assert _descendants(os.getpid()) == kids
    finally:
        kill_pids(pids_with(marker))


def test_a_setsid_double_fork_does_not_outlive_its_call(tools):
    needs("processes")
    marker = "hf-agent-detach-" + uuid.uuid4().hex
    _call(tools, "print('warm')")
    kids = _descendants(os.getpid())
    try:
        with ProcessWatch(marker) as watch:
            result = _call(tools, DETACH.format(marker=marker))
        assert result.error is None and result.text == f"detached {marker}\n", result
        assert watch.seen == 1, "the detached child never showed on the machine"
        assert wait_gone(marker, 2) == [], "a detached child outlived its tool call"
        assert _descendants(os.getpid()) == kids
    finally:
        kill_pids(pids_with(marker))


# -- memory and output ----------------------------------------------------------------------------------------------

def test_allocating_8_gib_is_a_memory_error_answer(tools):
    needs("limits")
    result = _call(tools, "x = bytearray(8 << 30)\nprint('ALLOCATED', len(x))")
    assert result.error is None and "MemoryError" in result.text and "ALLOCATED" not in result.text, result.text
    assert _call(tools, "print(6 * 7)").text == "42\n"  # and the next call is fine


def _driver_peak(fn) -> tuple[ToolResult, int]:
    """The call's result and the most the driver's Python heap grew while it ran."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        return result, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_huge_output_is_cut_and_the_driver_holds_little_of_it(tools):
    needs("limits")
    result, peak = _driver_peak(lambda: _call(tools, "print('x' * 50_000_000)"))
    assert result.error is None and result.text.startswith("x" * tool_worker.MAX_OUTPUT), result.text[-200:]
    assert result.text.endswith(f"[... {50_000_001 - tool_worker.MAX_OUTPUT} more characters cut]"), result.text[-80:]
    assert peak < 1 << 20, peak


# -- the protocol pipe: only JSON, only its text --------------------------------------------------------------------

def _to_every_fd(payload: bytes | str, then: str = "print('the real answer')") -> str:
    """The tool writes `payload` (bytes, or a Python expression making them) to fds 1..10, one of which is the
    worker's dup of its protocol pipe."""
    return f"""
        import os
        for fd in range(1, 11):
            try:
                os.write(fd, {payload if isinstance(payload, str) else repr(payload)})
            except OSError:
                pass
        {then}
        """


@pytest.mark.parametrize("payload,why", [
    (b"\x00\xffgarbage, not JSON\n", "not JSON"),
    (b"[1, 2, 3]\n", "sent list, not an object"),
    (b'{"ok": "half a line', "timed out"),  # and then hangs: one deadline
])
def test_garbage_on_the_protocol_pipe_is_the_tools_error(hasty, payload, why):
    result = _call(hasty, _to_every_fd(payload, "import time; time.sleep(1000)" if why == "timed out" else
                                       "print('the real answer')"))
    assert result.error and why in result.text and "the real answer" not in result.text, result


def test_a_forged_reply_is_only_ever_the_tools_text(tools):
    """A forged JSON reply reaches the driver before the real one: it can say what the tool answers (the model's
    code may print anything anyway), not more: no timeout, no seconds, no other field, and no more than MAX_OUTPUT."""
    forged = json.dumps({"ok": "FORGED" + "A" * 200_000, "timed_out": True, "seconds": 1e9, "error": None}) + "\n"
    result, peak = _driver_peak(lambda: _call(tools, _to_every_fd(forged.encode())))
    assert not result.timed_out and result.seconds < 10 and result.error is None, result.text[:80]
    n = tool_worker.MAX_OUTPUT  # the driver cuts it too
    assert result.text == "FORGED" + "A" * (n - 6) + f"\n[... {200_006 - n} more characters cut]", len(result.text)
    huge = _to_every_fd('b"x" * (50 << 20)')  # no newline: one line past MAX_LINE
    result, peak = _driver_peak(lambda: _call(tools, huge))
    assert result.error and f"over {wire.MAX_LINE} bytes" in result.text, result.text[:200]
    assert peak < 8 * wire.MAX_LINE, peak  # not the 50 MiB it wrote


# -- environment steps ----------------------------------------------------------------------------------------------

ENVIRONMENT = '''
import socket, time


class Environment:
    def reset(self, sample):
        self.port, self.turns = sample["port"], 0
        return "go"

    def step(self, action):
        self.turns += 1
        if action == "net":
            socket.create_connection(("127.0.0.1", self.port), timeout=3).close()
            return "reached the driver", 1.0, True, {}
        if action == "hang":
            time.sleep(1000)
        if action == "raise":
            raise RuntimeError("the environment's own bug")
        return f"turn {self.turns}", 0.5, self.turns >= 3, {}
'''


def test_failing_environment_steps_end_their_episodes_reported_and_others_go_on(tmp_path):
    """A user environment whose step reaches for the driver's server, hangs, or raises: each of those episodes
    ends with the step's error (reported with its sample), the healthy one plays its three turns meanwhile, and no
    sandbox is left."""
    needs("network", "processes")
    env_file = tmp_path / "env.py"
    env_file.write_text(ENVIRONMENT)
    sessions = LocalSessions(EnvironmentCode.from_file(env_file, "Environment"), step_timeout_seconds=DEADLINE)
    kids = _descendants(os.getpid())
    policy = ScriptedPolicyDouble({0: ["net"], 1: ["hang"], 2: ["raise"], 3: ["ok", "ok", "ok"]})
    try:
        with _Server() as server:
            t0 = time.monotonic()
            episodes = run_episodes([[1]] * 4, [{"port": server.port}] * 4, policy, CharCodec(),
                                    EpisodeSettings(300, max_turns=4, has_environment=True), sessions=sessions)
            took = time.monotonic() - t0
        net, hang, boom, healthy = episodes
        assert net.error and "raised ConnectionRefusedError" in net.error and net.env_reward == 0.0, net.error
        assert server.hits == 0
        assert hang.error == f"the environment's step timed out after {DEADLINE:g} s", hang.error
        assert boom.error == "the environment's step raised RuntimeError: the environment's own bug at env.py:18"
        assert healthy.error is None and (healthy.env_steps, healthy.env_reward) == (3, 1.5), healthy
        assert "[turn 2]" in CharCodec().decode(healthy.tokens)
        assert took < DEADLINE + MARGIN, took
        assert not sessions._open and wait_gone(str(tmp_path), 2) == [], "a session's sandbox was left"
        assert _descendants(os.getpid()) == kids
    finally:
        sessions.shutdown()
        kill_pids(pids_with(str(tmp_path)))
