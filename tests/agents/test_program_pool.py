"""Agent programs run in the sandbox pool (a Kubernetes job's): a real pool replica (`hybridflow environments serve`
on 127.0.0.1 in its own process, its program run in a real sandbox by LocalPrograms) runs each episode's program, whose only way out is a socket of the
replica's relaying to the rollout's endpoint on TCP (hybridflow.agents.relay), and the rollout (program_loop with
RemotePrograms) records what the engine wrote: a real generation engine (the HF engine over a tiny random Qwen2 with
SmolLM2's tokenizer). Also: the TCP listener refuses a request without a live episode token, and an episode whose
replica does not answer is run again on another one."""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from support.recording_engine import RecordingEngine, tiny_qwen2_engine
import yaml

from hybridflow.agents.codec import ObservationCodec
from hybridflow.agents.endpoint import Endpoint, EndpointSettings
from hybridflow.agents.loop import LOST, EpisodeSettings
from hybridflow.agents.program_loop import run_program_episodes
from hybridflow.agents.protocol import Listen
from hybridflow.agents.remote_programs import RemotePrograms
from hybridflow.sandbox_pool import TOKEN_ENV, PoolClient
from support.paths import ROOT

TOKEN = "the-jobs-sandbox-token"
LOCAL = Listen("127.0.0.1")

PROGRAM = '''
async def run(client, sample):
    out = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": sample["prompt"]}], max_tokens=8)
    return {"reward": float(sample["ground_truth"]), "chars": len(out.choices[0].message.content or "")}
'''


@pytest.fixture(scope="module")
def tok(model_cache):
    from transformers import AutoTokenizer

    from hybridflow.api.sources import ModelSource
    from hybridflow.models.builders import materialize

    return AutoTokenizer.from_pretrained(materialize(ModelSource(source="smollm2"), model_cache, 0))


@pytest.fixture(scope="module")
def codec(tok) -> ObservationCodec:
    return ObservationCodec(tok, tok.chat_template, [tok.eos_token_id])


@pytest.fixture(scope="module")
def engine(tok, tmp_path_factory):
    return tiny_qwen2_engine(len(tok), tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> Iterator[str]:
    """One replica of the job's sandbox pool serving its program: `hybridflow environments serve` on the job's spec,
    its own process (as a sandbox pod runs it), on 127.0.0.1; its URL."""
    where = tmp_path_factory.mktemp("program")
    (where / "agent.py").write_text(textwrap.dedent(PROGRAM))
    doc = yaml.safe_load((ROOT / "examples" / "smollm2-arithmetic.yaml").read_text())
    doc["spec"]["rollout"]["agent"] = {"program": str(where / "agent.py"), "programTimeoutSeconds": 60}
    (where / "job.json").write_text(json.dumps(doc))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hybridflow.cli", "environments", "serve", "--spec",
                             str(where / "job.json"), "--port", str(port), "--address", "127.0.0.1"],
                            env={**os.environ, TOKEN_ENV: TOKEN}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else proc.returncode
            try:
                if urllib.request.urlopen(f"{url}/healthz", timeout=2).status == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline, f"{url} did not come up"
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: a refused connection, as a replica that went away
    return f"http://127.0.0.1:{port}"


SAMPLES = [{"prompt": "What is 2 + 2?", "ground_truth": 1, "data_source": "d", "extra_info": {}},
           {"prompt": "Name a colour.", "ground_truth": 0.5, "data_source": "d", "extra_info": {}}]


def test_a_program_runs_in_the_pool_and_what_is_trained_is_what_the_engine_wrote(replica, codec, engine) -> None:
    model = RecordingEngine(engine, codec.tokenizer.eos_token_id)
    programs = RemotePrograms(PoolClient([replica], TOKEN))
    rows = run_program_episodes(SAMPLES, model, codec, programs, EpisodeSettings(32, max_turns=2), timeout=60,
                                listen=LOCAL)
    assert [len(r) for r in rows] == [1, 1]
    for i, ((e,), sample) in enumerate(zip(rows, SAMPLES)):
        assert e.error is None, e.error
        assert e.env_reward == sample["ground_truth"] and "chars" in e.metrics
        ((row, context, written),) = [c for c in model.rows() if c[0] == i]
        assert written and e.prompt_ids == context and e.tokens == written  # the engine's ids, never re-tokenized
        assert e.loss_mask == [1] * len(written)
    assert programs.request_counts() == {replica: 2} and programs.running_counts() == {replica: 0}


def test_an_episode_whose_replica_does_not_answer_runs_again_on_another(replica, codec, engine) -> None:
    dead = _dead_url()
    client = PoolClient([dead, replica], TOKEN)
    model = RecordingEngine(engine, codec.tokenizer.eos_token_id)
    (rows,) = run_program_episodes(SAMPLES[:1], model, codec, RemotePrograms(client), EpisodeSettings(32),
                                   timeout=60, listen=LOCAL)
    assert rows[0].error is None and rows[0].env_reward == 1.0
    assert client.failure_counts()[dead] <= 1 and client.request_counts()[replica] == 1
    # every replica gone: the episode is counted as lost (not the program's failure), after its retries
    (lost,) = run_program_episodes(SAMPLES[:1], model, codec, RemotePrograms(PoolClient([dead], TOKEN)),
                                   EpisodeSettings(32), timeout=60, listen=LOCAL)
    assert lost[0].failure == LOST and "lost 3 times" in (lost[0].error or "")


def _get(url: str, auth: str | None) -> int:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/v1/models", headers={"Authorization": auth} if auth else {})
    status = conn.getresponse().status
    conn.close()
    return status


def test_the_tcp_listener_answers_only_a_live_episode_token(codec) -> None:
    with Endpoint(codec, EndpointSettings(16), LOCAL) as endpoint:
        assert endpoint.url is not None and endpoint.url.startswith("http://127.0.0.1:")
        assert Path(endpoint.socket_path).exists()  # the Unix socket too, for programs run on this machine
        token = endpoint.open(0)
        assert _get(endpoint.url, None) == 401
        assert _get(endpoint.url, "Bearer not-a-token") == 401
        assert _get(endpoint.url, f"Bearer {token}") == 200
        endpoint.end(token)
        assert _get(endpoint.url, f"Bearer {token}") == 401  # an ended episode's token is refused
    with Endpoint(codec, EndpointSettings(16)) as local:
        assert local.url is None  # no TCP listener unless asked


def test_the_listener_takes_the_first_free_port_of_its_range(codec) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with Endpoint(codec, EndpointSettings(16), Listen("127.0.0.1", (port, port + 1))) as endpoint:
            assert endpoint.url == f"http://127.0.0.1:{port + 1}"
        with pytest.raises(OSError):
            Endpoint(codec, EndpointSettings(16), Listen("127.0.0.1", (port, port)))
    finally:
        taken.close()


def test_the_pool_refuses_a_run_without_its_token_or_an_endpoint(replica) -> None:
    client = PoolClient([replica], TOKEN)
    code, out = client.request(0, "POST", "/v1/programs/run", {"sample": {}, "endpoint": "unix:/x", "token": "t"}, 10)
    assert code == 400 and "http://host:port" in out["error"]
    conn = http.client.HTTPConnection(*replica.removeprefix("http://").split(":"), timeout=10)
    conn.request("POST", "/v1/programs/run", body=b"{}", headers={"Content-Length": "2"})
    assert conn.getresponse().status == 401
    conn.close()


def test_a_replica_refuses_a_program_file_that_is_not_here(tmp_path) -> None:
    from hybridflow.api import SpecError, parse_job
    from hybridflow.cli.pool_replica import replica_halves

    doc = yaml.safe_load((ROOT / "examples" / "smollm2-arithmetic.yaml").read_text())
    doc["spec"]["rollout"]["agent"] = {"program": str(tmp_path / "agent.py")}
    job = parse_job(doc)
    with pytest.raises(SpecError, match=r"spec.rollout.agent.program: .*agent.py: no such file here"):
        replica_halves(job, "job.yaml", "all")
    (tmp_path / "agent.py").write_text(textwrap.dedent(PROGRAM))
    agent, _ = replica_halves(job, "job.yaml", "all")
    assert agent is not None and agent.program == str(tmp_path / "agent.py")
