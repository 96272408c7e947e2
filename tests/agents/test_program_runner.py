"""A user's agent program (spec.rollout.agent.program) run by LocalPrograms, each run in a real sandbox, against a
small HTTP server on a Unix socket that stands in for the job's endpoint (FakeEndpointForTheRunner: the real
endpoint, hybridflow.agents.endpoint, is tested with these programs at integration). What the program returns comes
back as the episode's reward and metrics; what it does wrong comes back as the episode's error, naming its file and
line, counted as the program's failure (loop.PROGRAM), and ends with the last lines of what it wrote to stderr (its
print()s and logging), bounded and sanitized, none of it shown for a run that succeeds; the sandbox still has no
network, the socket is its only way out."""
from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import subprocess
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Iterator, cast

import pytest

from hybridflow import sandbox
from hybridflow.agents import program as program_mod
from hybridflow.agents.loop import NOT_RUN, PROGRAM, EpisodeSettings
from hybridflow.agents.program import TAIL_CHARS, TAIL_LINES, LocalPrograms, tail_text, with_stderr
from hybridflow.agents.program_loop import EngineFailed, run_program_episodes
from hybridflow.agents.protocol import EndpointAddress

TOKEN = "episode-token-1"
SAMPLE = {"prompt": "What is 6 * 7?", "ground_truth": "42", "data_source": "test", "extra_info": {"i": 3}}
LAYERS = sandbox.probe(program_mod.WORKER_CHECK)


class FakeEndpointForTheRunner(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """A stand-in for the job's endpoint, just enough of OpenAI's chat completions for the runner's tests: checks the
    bearer token, answers `answer` as the assistant's message, records each request's body."""

    daemon_threads = True

    def __init__(self, path: str, answer: str = "42") -> None:
        self.answer, self.requests = answer, []  # type: ignore[var-annotated]
        super().__init__(path, _Handler)
        os.chmod(path, 0o666)  # the sandbox runs as a uid of its own; the token is the authentication


class _Handler(BaseHTTPRequestHandler):
    server: FakeEndpointForTheRunner

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._send(401, {"error": {"message": "bad token"}})
        self.server.requests.append(body)
        self._send(200, {"id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": self.server.answer}}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def _send(self, code: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def address_string(self) -> str:
        return "unix"

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[tuple[FakeEndpointForTheRunner, EndpointAddress]]:
    d = tmp_path / "endpoint"
    d.mkdir(mode=0o755)
    server = FakeEndpointForTheRunner(str(d / "api.sock"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, EndpointAddress(str(d / "api.sock"), TOKEN)
    server.shutdown()
    server.server_close()


def programs(tmp_path: Path, body: str) -> LocalPrograms:
    path = tmp_path / "code" / "agent.py"  # a sibling of the endpoint's directory: its own directory is bound in
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return LocalPrograms(path, layers=LAYERS)


ASK = """\
import sys

async def run(client, sample):
    print("noise on stdout", flush=True)
    sys.stdout.write('{"reward": 99}\\n')
    answer = await client.chat.completions.create(model="policy",
                                                  messages=[{"role": "user", "content": sample["prompt"]}])
    text = answer.choices[0].message.content
    return {"reward": text == sample["ground_truth"], "calls": 1, "extra_i": sample["extra_info"]["i"]}
"""


def test_reward_and_metrics_come_back(tmp_path: Path, endpoint: Any) -> None:
    server, address = endpoint
    result = programs(tmp_path, ASK).run(SAMPLE, address, timeout=60)
    assert result.error is None, result.error
    assert (result.reward, result.metrics, result.failure) == (1.0, {"calls": 1.0, "extra_i": 3.0}, None)
    assert server.requests[0]["messages"] == [{"role": "user", "content": "What is 6 * 7?"}]


def test_a_program_that_raises_names_its_file_and_line(tmp_path: Path, endpoint: Any) -> None:
    result = programs(tmp_path, """\
        async def run(client, sample):
            x = 1
            raise ValueError("no plan")
    """).run(SAMPLE, endpoint[1], timeout=60)
    assert result.failure == PROGRAM and result.reward is None
    assert result.error == "ValueError: no plan at agent.py:3"


def test_a_wrong_token_is_the_programs_error_at_its_call(tmp_path: Path, endpoint: Any) -> None:
    result = programs(tmp_path, ASK).run(SAMPLE, EndpointAddress(endpoint[1].socket_path, "stolen"), timeout=60)
    assert result.failure == PROGRAM
    assert result.error.startswith("AuthenticationError") and "agent.py:6" in result.error, result.error


def test_a_program_past_its_deadline_is_killed(tmp_path: Path, endpoint: Any) -> None:
    runner = programs(tmp_path, """\
        import asyncio

        async def run(client, sample):
            await asyncio.sleep(600)
    """)
    t0 = time.monotonic()
    result = runner.run(SAMPLE, endpoint[1], timeout=4)
    assert time.monotonic() - t0 < 4 + 4
    assert result.failure == PROGRAM
    assert result.error == ("the agent program agent.py timed out after 4 s "
                            "(spec.rollout.agent.programTimeoutSeconds)")
    assert not runner._live


@pytest.mark.parametrize("returned, says", [
    ("float('nan')", "the reward run returned must be a finite number, got nan"),
    ("'1.0'", "the reward run returned must be a finite number, got str '1.0'"),
    ("{'score': 1}", "run returned a dict without 'reward' (its keys: score)"),
    ("{'reward': 1, 'turns': 'two'}", "metric 'turns' must be a finite number, got str 'two'"),
    ("None", "the reward run returned must be a finite number, got NoneType None"),
])
def test_what_is_not_a_reward_is_reported(tmp_path: Path, endpoint: Any, returned: str, says: str) -> None:
    result = programs(tmp_path, f"""\
        async def run(client, sample):
            return {returned}
    """).run(SAMPLE, endpoint[1], timeout=60)
    assert (result.failure, result.error) == (PROGRAM, f"{says} (run at agent.py:1)")


def test_a_file_that_does_not_load_or_has_no_async_run(tmp_path: Path, endpoint: Any) -> None:
    missing = programs(tmp_path, "import no_such_module_here\n").run(SAMPLE, endpoint[1], timeout=60)
    assert missing.failure == PROGRAM
    assert missing.error == ("the agent program did not load: ModuleNotFoundError: No module named "
                             "'no_such_module_here' at agent.py:1")
    sync = programs(tmp_path, "def run(client, sample):\n    return 1\n").run(SAMPLE, endpoint[1], timeout=60)
    assert sync.error == ("the agent program did not load: TypeError: agent.py must define `async def run(client, "
                          "sample)`, its run is a plain function (not async def)")


def test_the_socket_is_the_only_way_out(tmp_path: Path, endpoint: Any) -> None:
    """A TCP server on the machine's loopback: the program cannot reach it (the sandbox's network namespace has a
    loopback of its own), while its calls over the bound socket (read-only) work."""
    if "network" in dict(LAYERS.missing):
        pytest.fail(f"the sandbox has no network layer here: {LAYERS.describe()}")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    result = programs(tmp_path, f"""\
        import socket

        async def run(client, sample):
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=3).close()
                tcp = 1
            except OSError:
                tcp = 0
            answer = await client.chat.completions.create(model="p", messages=[{{"role": "user", "content": "hi"}}])
            return {{"reward": 1, "tcp": tcp, "answered": answer.choices[0].message.content == "42"}}
    """).run(SAMPLE, endpoint[1], timeout=60)
    assert result.error is None, result.error
    assert result.metrics == {"tcp": 0.0, "answered": 1.0}
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()


def test_a_socket_the_sandbox_cannot_open_is_not_the_programs_failure(tmp_path: Path, endpoint: Any) -> None:
    if not LAYERS.other_uid:
        pytest.skip("the sandbox runs as the driver's uid here")
    os.chmod(endpoint[1].socket_path, 0o600)
    result = programs(tmp_path, ASK).run(SAMPLE, endpoint[1], timeout=60)
    assert result.failure == NOT_RUN and "not writable by others (mode 600)" in result.error


def test_a_sandbox_that_cannot_start_is_not_run(tmp_path: Path, endpoint: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(sandbox, "spawn", refuse)
    result = programs(tmp_path, ASK).run(SAMPLE, endpoint[1], timeout=60)
    assert result.failure == NOT_RUN and "could not start" in result.error


def test_a_program_whose_pipe_closed_before_its_sandbox_exited_is_reported_by_its_exit_status(
        tmp_path: Path, endpoint: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reply pipe closes a moment before the sandbox's launcher exits with the program's status (under load,
    longer): the driver waits for that status (local._Worker.death), never reporting a program that exited, or that
    a sandbox limit killed, as one that "stopped answering". A stand-in for the sandbox makes the moment a second."""
    def late_exit(argv: Any, limits: Any, layers: Any, **popen: Any) -> sandbox.Sandboxed:
        return sandbox.Sandboxed(subprocess.Popen(["sh", "-c", "exec 1>&-; sleep 1; exit 3"], start_new_session=True,
                                                  stdin=popen["stdin"], stdout=popen["stdout"]))

    monkeypatch.setattr(sandbox, "spawn", late_exit)
    result = programs(tmp_path, ASK).run(SAMPLE, endpoint[1], timeout=60)
    assert result.failure == PROGRAM
    assert result.error.startswith("the agent program agent.py failed after "), result.error
    assert result.error.endswith(": the worker closed its pipe; it exited with status 3"), result.error


# -- the program's stderr in its failure ----------------------------------------------------------------------------

PRINTS = """\
import logging
import sys

logging.basicConfig(format="%(levelname)s %(message)s")
log = logging.getLogger("agent"); log.setLevel(logging.INFO)
"""


@pytest.mark.parametrize("ends, says", [
    ("raise ValueError('no plan')", "ValueError: no plan at agent.py:13"),
    ("return {'score': 1}", "run returned a dict without 'reward' (its keys: score) (run at agent.py:7)"),
    ("import os; os._exit(3)", "the agent program agent.py failed after "),
    ("import asyncio; await asyncio.sleep(600)", "the agent program agent.py timed out after 10 s "
                                                  "(spec.rollout.agent.programTimeoutSeconds)"),
], ids=["raises", "bad-return", "crash", "deadline"])
def test_a_failed_runs_error_ends_with_what_the_program_printed(tmp_path: Path, endpoint: Any, ends: str,
                                                                 says: str) -> None:
    result = programs(tmp_path, PRINTS + f"""
async def run(client, sample):
    print("thinking about", sample["prompt"], flush=True)
    log.info("calling the model")
    answer = await client.chat.completions.create(model="p", messages=[{{"role": "user", "content": "hi"}}])
    print("the model said", answer.choices[0].message.content, file=sys.stderr, flush=True)
    print("\\x1b[31mred\\x1b[0m\\tand\\x07 a bell\\rprogress 100%", flush=True)
    {ends}
""").run(SAMPLE, endpoint[1], timeout=10 if "sleep" in ends else 60)
    assert result.failure == PROGRAM and result.reward is None
    error, _, tail = result.error.partition(" (the program's stderr, ")
    assert error.startswith(says), result.error
    assert tail == ("its last 4 lines:\n"
                    "  | thinking about What is 6 * 7?\n"
                    "  | INFO calling the model\n"
                    "  | the model said 42\n"
                    "  | progress 100%\n"
                    ")"), result.error


def test_a_run_that_succeeds_shows_no_stderr_and_one_that_prints_much_is_not_blocked(
        tmp_path: Path, endpoint: Any, caplog: pytest.LogCaptureFixture) -> None:
    """4 MB of stderr (a pipe holds 64 KiB): the run ends as fast as it prints; on success nothing of it is logged
    or returned, on failure only its last TAIL_LINES lines within TAIL_CHARS characters."""
    body = """\
import sys

async def run(client, sample):
    for i in range(40000):
        print(f"line {i} " + "x" * 50, file=sys.stderr)
    if sample["ground_truth"] == "fail":
        raise RuntimeError("after much output")
    return 1
"""
    runner = programs(tmp_path, body)
    caplog.set_level(logging.DEBUG)
    t0 = time.monotonic()
    ok = runner.run(SAMPLE, endpoint[1], timeout=60)
    assert (ok.error, ok.reward) == (None, 1.0)
    assert time.monotonic() - t0 < 30
    assert not [r for r in caplog.records if "line 39999" in r.getMessage()]
    failed = runner.run(SAMPLE | {"ground_truth": "fail"}, endpoint[1], timeout=60)
    error, _, tail = failed.error.partition(" (the program's stderr, ")
    assert error == "RuntimeError: after much output at agent.py:7"
    lines = tail.split("\n")
    assert lines[0] == f"its last {TAIL_LINES} lines:" and lines[-1] == ")"
    assert len(lines) == TAIL_LINES + 2 and len(tail) <= TAIL_CHARS + 8 * TAIL_LINES
    assert lines[-2] == "  | line 39999 " + "x" * 50


def test_a_program_that_prints_nothing_fails_with_its_error_alone(tmp_path: Path, endpoint: Any) -> None:
    result = programs(tmp_path, "async def run(client, sample):\n    raise KeyError('k')\n").run(
        SAMPLE, endpoint[1], timeout=60)
    assert result.error == "KeyError: 'k' at agent.py:2"


def test_the_tail_is_sanitized_and_bounded() -> None:
    raw = ("partial first line\n"
           "\x1b]0;a title\x07\x1b[1;32mgreen\x1b[0m text\n"
           "bidi \u202eevil\u202c and \u2028 separator\n"
           "nul \x00 and \x1b[2K\x1b[1Gdel \x7f and c1 \x9b done\n"
           "a\r\n"
           "10%\r50%\r100%\n"
           "\tindented\n").encode() + b"bad utf-8 \xff\xfe\n\n\n"
    assert tail_text(raw, cut=True).split("\n") == [
        "green text", "bidi ?evil? and ? separator", "nul ? and del ? and c1 ? done", "a", "100%",
        "    indented", "bad utf-8 \ufffd\ufffd"]
    assert tail_text(raw).split("\n")[0] == "partial first line"
    many = "".join(f"{i}\n" for i in range(100)).encode()
    assert tail_text(many).split("\n") == [str(i) for i in range(100 - TAIL_LINES, 100)]
    wide = tail_text(("y" * 5000 + "\nlast\n").encode())
    assert len(wide) == TAIL_CHARS and wide.startswith("...y") and wide.endswith("y\nlast")
    assert tail_text(b"") == tail_text(b"\n \n") == ""


def test_the_error_and_its_stderr() -> None:
    assert with_stderr("E", "") == "E"
    assert with_stderr("E", "one") == "E (the program's stderr, its last 1 line:\n  | one\n)"
    assert with_stderr("E", "a\nb") == "E (the program's stderr, its last 2 lines:\n  | a\n  | b\n)"


def test_a_pipe_that_cannot_be_read_leaves_no_tail() -> None:
    assert program_mod.StderrTail(None).text(0.1) == ""


class _Codec:
    """Just enough of an ObservationCodec for the real endpoint's first call of an episode: any messages are the
    prompt [1, 2, 3]; any ids read "42"; 0 ends a turn; a vocabulary of 16 ids."""

    stop_token_ids = [0]
    tokenizer = range(16)

    def prompt_ids(self, messages: Any, tools: Any) -> list[int]:
        return [1, 2, 3]

    def decode(self, ids: Any) -> str:
        return "42"


class _Model:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def generate(self, rows: Any, contexts: Any, max_tokens: Any) -> list[tuple[list[int], list[float]]]:
        if self.fail:
            raise ValueError("CUDA error: an illegal memory access")
        return [([5, 0], [-0.1, -0.2]) for _ in rows]


def test_an_engine_error_kills_the_programs_names_the_rows_and_leaves_the_programs_usable(tmp_path: Path) -> None:
    """The engine raises at row 0's request while row 1's program runs on without calling the model: the rollout
    fails at once (row 1's program killed, not waited for to its deadline), naming row 0 and its sample; the job's
    next rollout runs on the same LocalPrograms."""
    runner = programs(tmp_path, """\
        import asyncio

        async def run(client, sample):
            if sample["extra_info"]["i"] == 1:
                await asyncio.sleep(600)
            answer = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
            return {"reward": answer.choices[0].message.content == sample["ground_truth"]}
    """)
    samples = [SAMPLE | {"extra_info": {"i": 0}}, SAMPLE | {"ground_truth": "7", "extra_info": {"i": 1}}]
    settings, codec = EpisodeSettings(64, concurrent=2), cast(Any, _Codec())
    t0 = time.monotonic()
    with pytest.raises(EngineFailed) as failed:
        run_program_episodes(samples, _Model(fail=True), codec, runner, settings, timeout=60)
    assert time.monotonic() - t0 < 30 and not runner._live
    assert str(failed.value) == ("the engine failed on agent programs' requests of rows 0; the first, sample 0 "
                                 "(ground truth '42', data source 'test'): ValueError: CUDA error: an illegal memory "
                                 "access (the rollout's programs were stopped)")
    assert isinstance(failed.value.__cause__, ValueError)
    ((e,),) = run_program_episodes(samples[:1], _Model(fail=False), codec, runner, settings, timeout=60)
    assert (e.error, e.env_reward, e.tokens, e.loss_mask) == (None, 1.0, [5, 0], [1, 1])


def test_the_stderr_thread_and_its_pipe_end_even_while_a_process_that_outlived_the_kill_holds_it_open():
    import os

    from hybridflow.agents.program import StderrTail

    r, w = os.pipe()  # the write end stays open: a writer that outlived the kill
    try:
        tail = StderrTail(os.fdopen(r, "rb"))
        os.write(w, b"last words\n")
        assert tail.text(0.5) == "last words"  # no EOF: what came by then
        tail.close()
        assert not tail._thread.is_alive() and tail._stream.closed
    finally:
        os.close(w)
