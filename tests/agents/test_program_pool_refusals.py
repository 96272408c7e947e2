"""What the sandbox pool's agent programs refuse (hybridflow.agents.pool_programs, remote_programs): a replica's
relay connects only where a rollout's endpoint may be (an IP address that is no link-local, multicast or unspecified
one, on the endpoints' ports where the pool was given them: a holder of the sandbox token may not point it at the
pod's own loopback or the cloud's metadata service), and a refusal of the job's token or request stops the rollout
(PoolError) instead of failing every episode uncounted. A real pool server (PoolServer) on 127.0.0.1; its programs a
recording double (these runs must never start)."""
from __future__ import annotations

from typing import Any, Callable

import pytest

from hybridflow.agents.codec import ObservationCodec
from hybridflow.agents.loop import EpisodeSettings
from hybridflow.agents.pool_programs import PoolPrograms
from hybridflow.agents.program_loop import run_program_episodes
from hybridflow.agents.protocol import EndpointAddress, Info, Listen, ProgramResult
from hybridflow.agents.relay import allowed_target
from hybridflow.agents.remote_programs import RemotePrograms
from hybridflow.agents.server import PoolServer, PoolService
from hybridflow.sandbox_pool import PoolClient, PoolError

TOKEN = "the-jobs-sandbox-token"
PORTS = (8400, 8463)
SAMPLE = {"prompt": "What is 2 + 2?", "ground_truth": 1, "data_source": "d", "extra_info": {}}


class RecordingPrograms:
    """Programs that record each run they were asked for and answer a reward."""

    def __init__(self) -> None:
        self.runs: list[EndpointAddress] = []

    def run(self, sample: Info, endpoint: EndpointAddress, timeout: float) -> ProgramResult:
        self.runs.append(endpoint)
        return ProgramResult(reward=1.0)

    def close(self) -> None:
        pass


class NoModel:
    """loop.Model that no request may reach."""

    def generate(self, rows: Any, contexts: Any, max_tokens: Any) -> list:
        raise AssertionError("no program ran, so no call reaches the model")


@pytest.fixture
def serve(request: pytest.FixtureRequest) -> Callable[[PoolService], PoolServer]:
    """Starts a pool server on 127.0.0.1 over a service; each is stopped after the test."""
    def start(service: PoolService) -> PoolServer:
        server = PoolServer(service, TOKEN)
        server.start()
        request.addfinalizer(server.stop)
        return server
    return start


@pytest.fixture
def programs() -> RecordingPrograms:
    return RecordingPrograms()


@pytest.fixture
def replica(serve, programs: RecordingPrograms) -> PoolServer:
    """A replica serving programs, told the endpoints' ports (as the operator's ENDPOINT_PORTS_ENV tells it)."""
    return serve(PoolService(None, None, programs=PoolPrograms(programs, 10.0, PORTS)))


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8100",  # the pool's own server, on the pod's loopback (no NetworkPolicy sees it)
    "http://10.0.0.7:6379",  # a gang pod's Ray port: outside the endpoints' ports
    "http://169.254.169.254:8400",  # the cloud's metadata service
    "http://[::ffff:169.254.169.254]:8400",  # the same, as an IPv4-mapped IPv6 address
    "http://0.0.0.0:8400", "http://224.0.0.1:8400",
    "http://kubernetes.default.svc:8443",  # a name to resolve
])
def test_the_relay_connects_only_to_an_endpoints_address(replica, programs, url) -> None:
    code, out = PoolClient([replica.url], TOKEN).request(
        0, "POST", "/v1/programs/run", {"sample": SAMPLE, "endpoint": url, "token": "t"}, 10)
    assert code == 400 and ("relay does not connect" in out["error"] or "must be an IP address" in out["error"])
    assert programs.runs == []  # refused before any sandbox or socket


def test_an_endpoint_on_a_pod_address_and_port_of_the_range_is_relayed() -> None:
    assert allowed_target("http://10.0.0.7:8400", PORTS) == ("10.0.0.7", 8400)
    assert allowed_target("http://[fd00::7]:8463", PORTS) == ("fd00::7", 8463)
    assert allowed_target("http://127.0.0.1:40000", None) == ("127.0.0.1", 40000)  # no range given (on a machine)
    with pytest.raises(ValueError, match="outside the rollout endpoints' ports 8400-8463"):
        allowed_target("http://10.0.0.7:8464", PORTS)


def test_a_refused_token_or_request_stops_the_rollout_rather_than_failing_every_episode_uncounted(
        serve, replica, programs) -> None:
    endpoint = EndpointAddress("/nowhere", "episode-token", "http://127.0.0.1:8400")
    none = serve(PoolService(None, None)).url  # a replica that serves no program (404)
    with pytest.raises(PoolError, match="404"):
        RemotePrograms(PoolClient([none], TOKEN)).run(SAMPLE, endpoint, 10)
    with pytest.raises(PoolError, match="401"):  # the pool and the job disagree on the sandbox token
        RemotePrograms(PoolClient([replica.url], "another-token")).run(SAMPLE, endpoint, 10)
    remote = RemotePrograms(PoolClient([replica.url], TOKEN))
    with pytest.raises(PoolError, match="400"):  # an endpoint outside the ports the replica was given
        remote.run(SAMPLE, EndpointAddress("/nowhere", "episode-token", "http://127.0.0.1:40000"), 10)
    assert remote.running_counts() == {replica.url: 0}
    assert programs.runs == []


@pytest.fixture(scope="module")
def codec(model_cache) -> ObservationCodec:
    from transformers import AutoTokenizer

    from hybridflow.api.sources import ModelSource
    from hybridflow.models.builders import materialize

    tok = AutoTokenizer.from_pretrained(materialize(ModelSource(source="smollm2"), model_cache, 0))
    return ObservationCodec(tok, tok.chat_template, [tok.eos_token_id])


def test_the_rollout_of_programs_raises_the_pools_refusal(serve, codec) -> None:
    programs = RemotePrograms(PoolClient([serve(PoolService(None, None)).url], TOKEN))
    with pytest.raises(PoolError, match="agent program"):
        run_program_episodes([SAMPLE, SAMPLE], NoModel(), codec, programs, EpisodeSettings(16), timeout=10,
                             listen=Listen("127.0.0.1"))


def test_a_program_has_at_most_max_connections_relayed_at_once() -> None:
    """A program that opens connection after connection (its sandbox allows it a thousand files) holds at most
    MAX_CONNECTIONS of them relayed, two of the replica's threads each; one more is closed as it connects."""
    import socket
    import threading
    import time

    from hybridflow.agents.relay import MAX_CONNECTIONS, Relay

    def pumps() -> int:
        return sum(t.name == "agent-relay-pump" for t in threading.enumerate())

    with socket.socket() as endpoint:  # the rollout's endpoint: it takes each connection and waits
        endpoint.bind(("127.0.0.1", 0))
        endpoint.listen(4 * MAX_CONNECTIONS)
        before, held = pumps(), []
        with Relay(endpoint.getsockname()[:2]) as relay:
            try:
                for _ in range(MAX_CONNECTIONS + 20):
                    c = socket.socket(socket.AF_UNIX)
                    c.connect(relay.socket_path)
                    c.settimeout(10)
                    held.append(c)
                deadline = time.monotonic() + 10
                while pumps() - before < 2 * MAX_CONNECTIONS and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.3)
                assert pumps() - before == 2 * MAX_CONNECTIONS
                assert held[-1].recv(1) == b""  # one past the bound: closed as it connected
            finally:
                for c in held:
                    c.close()


def test_the_endpoint_listens_on_an_ipv6_pod_address(codec) -> None:
    """A pod's address may be IPv6 (an IPv6 or dual-stack cluster's POD_IP): the listener binds it, and its URL is
    one the pool's relay accepts."""
    import http.client

    from hybridflow.agents.endpoint import Endpoint, EndpointSettings

    with Endpoint(codec, EndpointSettings(16), Listen("::1")) as endpoint:
        assert endpoint.url is not None and endpoint.url.startswith("http://[::1]:")
        host, port = allowed_target(endpoint.url, None)
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {endpoint.open(0)}"})
        assert conn.getresponse().status == 200
        conn.close()
