"""`hybridflow validate` and `run`, before anything starts: the agent's tools file, environment file and program
loaded the way their workers will load them, each in a sandbox of its own (hybridflow.agents.check_worker), never in
this process. What only running them can tell (an import the sandbox lacks, a class the file does not define, reset
or step missing or taking other arguments, a tool a decorator changed, a program without `async def run(client,
sample)`) is found here, as a problem naming the spec field, the file and the line, instead of in every episode once
the workers have started.

Not on Kubernetes' driver: the job's user code never runs in a pod holding its credentials; there the sandbox pool
loads it, and a file that does not load stops the job at its first episode (EnvironmentLoadError)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hybridflow import wire
from hybridflow.agents import check_worker
from hybridflow.agents.local import LOAD_SECONDS, _probe, _Worker
from hybridflow.agents.program import ProgramSettings
from hybridflow.agents.protocol import Info
from hybridflow.agents.tool_file import ToolFileError, read_tools_file
from hybridflow.sandbox import Limits

LIMITS = Limits(cpu_seconds=120, memory_bytes=2 << 30, processes=32)


def loaded_file_problems(agent: ProgramSettings, private: Sequence[str] = ()) -> list[str]:
    """'<field>: <file>:<line>: <what is wrong>' for each problem of the agent's files found by loading them in
    the sandbox (the sandbox's refusal, when it is required and incomplete, raises SandboxUnavailable as a job's
    start would). Files that do not parse are left to the static checks (hybridflow.trainer.preflight). Each file
    must load within what its workers give it: an environment session LOAD_SECONDS, a tool call its whole deadline
    (spec.rollout.agent.toolTimeoutSeconds: every call loads the file, then runs the tool)."""
    out: list[str] = []
    if agent.tools_file:
        try:
            tools = read_tools_file(agent.tools_file)
        except ToolFileError:
            tools = {}  # reported by the static checks
        if tools:
            request = {"tools": {n: {"line": t.line, "parameters": list(t.parameters.get("properties", {}))}
                                 for n, t in tools.items()}}
            out += _check("spec.rollout.agent.toolsFile", agent.tools_file, request, private,
                          agent.tool_timeout_seconds, "spec.rollout.agent.toolTimeoutSeconds, the deadline of each "
                          "call, which loads the file and then runs the tool")
    if agent.program:
        out += _check("spec.rollout.agent.program", agent.program, {"program": True}, private, LOAD_SECONDS,
                      "what the check gives it to load; each run's deadline is programTimeoutSeconds")
    if agent.environment_file:
        out += _check("spec.rollout.agent.environmentFile", agent.environment_file,
                      {"class": agent.environment_class}, private, LOAD_SECONDS, "what each episode's session "
                      "gives it to load")
    return out


def _check(field: str, path: str, request: Info, private: Sequence[str], timeout: float, limit: str) -> list[str]:
    p = Path(path)
    try:
        source = p.read_text()
    except (OSError, UnicodeDecodeError):
        return []  # reported by the static checks
    layers = _probe(None, "the agent's tools and environment")
    worker = _Worker(check_worker.__name__, LIMITS, layers, str(p.resolve()), private)
    try:
        reply = worker.call({"path": str(p.resolve()), "source": source, **request}, timeout)
    except wire.WireTimeout:
        return [f"{field}: {p}: loading it in the sandbox took more than {timeout:g} s ({limit}); what its top "
                "level runs must end sooner"]
    except wire.WireError as err:
        return [f"{field}: {p}: loading it in the sandbox failed: {err}; {worker.death()}"]
    finally:
        worker.kill()
    return [f"{field}: {p}:{x['line']}: {x['message']}" if x.get("line") else f"{field}: {p}: {x['message']}"
            for x in reply.get("problems", [])]

