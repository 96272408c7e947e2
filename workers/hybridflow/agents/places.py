"""Where a job's tools, environment sessions and agent program run, from its spec: in sandboxes on this machine, or
in the job's sandbox pool (spec.environments) when the operator handed its replicas' addresses to this process. An
agent program run in the pool reaches the rollout's endpoint on TCP at this pod's address (Places.listen), relayed
by its replica (hybridflow.agents.pool_programs)."""
from __future__ import annotations

import os
from typing import Sequence

from hybridflow.agents.local import EnvironmentCode, LocalSessions, LocalTools
from hybridflow.agents.program import LocalPrograms, ProgramSettings
from hybridflow.agents.protocol import AgentSettings, Listen, Places
from hybridflow.agents.registry import ENVIRONMENTS, TOOLS, ToolSpec
from hybridflow.agents.tool_file import ToolFileError, read_tools_file
from hybridflow.sandbox_pool import POD_IP_ENV, endpoint_ports_from_env, pool_from_env


def job_tools(agent: AgentSettings) -> dict[str, ToolSpec]:
    """The tools the model is offered: the named built-ins, then the user's file's. Raises ToolFileError (naming
    the file and line) for a file's tool that has a listed built-in's name."""
    tools = {name: TOOLS[name] for name in agent.tools}
    if agent.tools_file:
        for name, spec in read_tools_file(agent.tools_file).items():
            if name in tools:
                raise ToolFileError(f"{agent.tools_file}:{spec.line}: tool '{name}' has the name of the built-in "
                                    "tool in spec.rollout.agent.tools; rename it, or drop the built-in")
            tools[name] = spec
    return tools


def environment_code(agent: AgentSettings) -> EnvironmentCode | None:
    if agent.environment_file:
        return EnvironmentCode.from_file(agent.environment_file, agent.environment_class)
    if agent.environment:
        return EnvironmentCode(target=ENVIRONMENTS[agent.environment])
    return None


def local_places(agent: ProgramSettings, private: Sequence[str] = ()) -> Places:
    """This machine's sandboxes for the job's tools and environment, or its agent program (the spec allows a
    program alone), none of which can read the `private` paths."""
    if agent.program:
        return Places(programs=LocalPrograms(agent.program, private=private))
    tools = job_tools(agent)
    code = environment_code(agent)
    return Places(LocalTools(tools, agent.tool_timeout_seconds, private=private) if tools else None,
                  LocalSessions(code, agent.step_timeout_seconds, private=private) if code is not None else None)


def job_places(agent: ProgramSettings, private: Sequence[str] = ()) -> Places:
    """The sandbox pool's replicas when this process was given them, else this machine's sandboxes."""
    client = pool_from_env()
    if client is None:
        return local_places(agent, private)
    if agent.program:
        from hybridflow.agents.remote_programs import RemotePrograms

        listen = Listen(os.environ.get(POD_IP_ENV) or "127.0.0.1", endpoint_ports_from_env())
        return Places(programs=RemotePrograms(client), request_counts=client.request_counts, listen=listen)
    from hybridflow.agents.remote import remote_places

    return remote_places(agent, client)
