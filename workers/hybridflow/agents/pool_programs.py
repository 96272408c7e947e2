"""The sandbox pool's side of agent programs (POST /v1/programs/run, hybridflow.agents.server): one episode's program
run in a sandbox of this replica exactly as `hybridflow run` runs it (hybridflow.agents.program.LocalPrograms: the
same limits, deadline, stderr tail and failure kinds), except that the socket bound into its sandbox is one of this
process's (hybridflow.agents.relay.Relay) relaying to the rollout's endpoint over TCP, at the address the request
names (an IP address, on one of the endpoints' ports: relay.allowed_target); the request also carries the
episode's bearer token, which the program's client sends with each call.

The deadline is this replica's own spec's (spec.rollout.agent.programTimeoutSeconds), never the request's."""
from __future__ import annotations

from dataclasses import asdict

from hybridflow.agents.loop import NOT_RUN
from hybridflow.agents.protocol import EndpointAddress, Info, ProgramResult, Programs
from hybridflow.agents.relay import Relay, allowed_target


class PoolPrograms:
    """`run(body)`: {sample, endpoint: "http://host:port", token} -> the ProgramResult as JSON. Raises ValueError
    for a request that lacks a field or names no endpoint the relay may reach (relay.allowed_target; the server's
    400)."""

    def __init__(self, programs: Programs, timeout_seconds: float, ports: tuple[int, int] | None = None) -> None:
        """`ports`: the rollout endpoints' ports (ENDPOINT_PORTS_ENV) the relay may connect to (None: any)."""
        self.programs, self.timeout, self.ports = programs, timeout_seconds, ports

    def run(self, body: Info) -> Info:
        sample, url, token = body.get("sample"), body.get("endpoint"), body.get("token")
        if not isinstance(sample, dict):
            raise ValueError("field 'sample' must be an object")
        if not isinstance(url, str) or not isinstance(token, str) or not token:
            raise ValueError("fields 'endpoint' (http://host:port) and 'token' (the episode's) must be strings")
        target = allowed_target(url, self.ports)
        try:
            relay = Relay(target)
        except OSError as err:  # this machine could not make the socket: not the program's failure
            return asdict(ProgramResult(error=f"the agent program's socket could not be made: {err}", failure=NOT_RUN))
        with relay:
            return asdict(self.programs.run(sample, EndpointAddress(relay.socket_path, token, url), self.timeout))

    def close(self) -> None:
        self.programs.close()
