"""Where a job's tools, environment sessions and agent program run, from its spec: in sandboxes on this machine, or
in the job's environment pool (spec.environments) when the operator handed its replicas' addresses to this process
(tools and environments only: the pool does not run agent programs yet, and the operator refuses a Kubernetes job
with one, api.rules.kubernetes_unsupported_problems)."""
from __future__ import annotations

from typing import Sequence

from hybridflow.agents.local import EnvironmentCode, LocalSessions, LocalTools
from hybridflow.agents.program import LocalPrograms, ProgramSettings
from hybridflow.agents.protocol import AgentSettings, Places
from hybridflow.agents.registry import ENVIRONMENTS, TOOLS, ToolSpec
from hybridflow.agents.tool_file import ToolFileError, read_tools_file
from hybridflow.sandbox_pool import pool_from_env


class ProgramsUnsupported(RuntimeError):
    """The places this job was given cannot run its agent program."""


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
    """The sandbox pool's replicas when this process was given them, else this machine's sandboxes. Raises
    ProgramsUnsupported for an agent program with a pool (a spec the operator accepted before it refused them)."""
    client = pool_from_env()
    if client is None:
        return local_places(agent, private)
    if agent.program:
        raise ProgramsUnsupported("spec.rollout.agent.program: the sandbox pool (a Kubernetes job's) does not run "
                                  "agent programs yet; run the job with `hybridflow run`")
    from hybridflow.agents.remote import remote_places

    return remote_places(agent, client)
