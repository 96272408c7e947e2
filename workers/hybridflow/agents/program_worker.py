"""One run of a user's agent program (spec.rollout.agent.program), inside its own sandbox
(`python -m hybridflow.agents.program_worker`): reads one request {"path", "source", "sample", "socket_path",
"token"}, loads the file, calls `await run(client, sample)` with `client` an openai.AsyncOpenAI whose every request
goes over the endpoint's Unix socket (the sandbox has no network: that socket is its only way out), answers one
reply, {"reward", "metrics"} or {"error"}, and exits. The driver (hybridflow.agents.program.LocalPrograms) kills it
at its deadline.

What the program returns is turned into plain numbers here, so that only JSON goes back, and anything else is an
error naming what was returned: the episode's reward must be a finite number. What the program prints goes to
stderr (protocol_streams), never onto the protocol pipe: the driver shows its last lines with a failed run's error
(hybridflow.agents.program.StderrTail). Loads the standard library, the openai client and httpx."""
from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import traceback
from pathlib import Path
from typing import Any

from hybridflow import wire
from hybridflow.agents._user_code import describe, load_module, protocol_streams


class BadReturn(TypeError):
    """`run` returned something that is not an episode's reward."""


def _number(value: Any, what: str) -> float:
    """A finite float from `value` (bools count as 0 and 1: `return answer == truth` is a reward), else BadReturn."""
    if not isinstance(value, numbers.Real):
        raise BadReturn(f"{what} must be a finite number, got {type(value).__name__} {value!r:.80}")
    try:
        out = float(value)
    except (OverflowError, ValueError):
        out = math.nan
    if not math.isfinite(out):
        raise BadReturn(f"{what} must be a finite number, got {value!r:.80}")
    return out


def plain_result(result: Any) -> dict[str, Any]:
    """run's return value as the reply: a number (the reward), or a dict with a numeric "reward" and other numeric
    metrics. Raises BadReturn naming what was returned."""
    if isinstance(result, dict):
        if "reward" not in result:
            raise BadReturn(f"run returned a dict without 'reward' (its keys: {', '.join(map(str, result))[:200]})")
        metrics = {str(k): _number(v, f"metric {k!r}") for k, v in result.items() if k != "reward"}
        return {"reward": _number(result["reward"], "the reward (its 'reward')"), "metrics": metrics}
    return {"reward": _number(result, "the reward run returned"), "metrics": {}}


def where(err: BaseException, path: str) -> str:
    """`describe(err)`, at the innermost line of the user's file when the error passed through it (an error raised
    inside the openai client says where the program called it), else where describe finds it."""
    lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == path]
    cause = err.__cause__  # the client's "Connection error." says why only here
    why = f" (from {type(cause).__name__}: {cause})" if cause is not None and str(cause) not in str(err) else ""
    if not lines:
        return describe(err) + why
    return f"{type(err).__name__}: {err}{why} at {Path(path).name}:{lines[-1]}"


def client_for(socket_path: str, token: str) -> Any:
    """The program's client: the job's endpoint over its Unix socket, authenticated with the episode's token. No
    retries: a failed call is the program's to handle, and the deadline is the run's."""
    import httpx
    import openai

    from hybridflow.agents.protocol import EndpointAddress

    transport = httpx.AsyncHTTPTransport(uds=socket_path)
    return openai.AsyncOpenAI(base_url=EndpointAddress.BASE_URL, api_key=token, max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, timeout=None))


def _kind(fn: Any) -> str:
    return "a plain function (not async def)" if inspect.isfunction(inspect.unwrap(fn)) else type(fn).__name__


async def _run(fn: Any, client: Any, sample: dict[str, Any]) -> Any:
    try:
        return await fn(client, sample)
    finally:
        await client.close()


def run_program(request: dict[str, Any]) -> dict[str, Any]:
    path = str(request["path"])
    try:
        module = load_module(path, str(request["source"]))
        fn = getattr(module, "run", None)
        if fn is None or not inspect.iscoroutinefunction(inspect.unwrap(fn)):
            raise TypeError(f"{Path(path).name} must define `async def run(client, sample)`, "
                            + ("it defines none" if fn is None else f"its run is {_kind(fn)}"))
    except BaseException as err:  # noqa: BLE001 - the file does not load: reported with its line
        return {"error": f"the agent program did not load: {where(err, path)}"}
    line = getattr(getattr(inspect.unwrap(fn), "__code__", None), "co_firstlineno", None)
    try:
        result = asyncio.run(_run(fn, client_for(str(request["socket_path"]), str(request["token"])),
                                  dict(request.get("sample") or {})))
    except BaseException as err:  # noqa: BLE001 - the program's failure is the episode's error
        return {"error": where(err, path)}
    try:
        return plain_result(result)
    except BadReturn as err:
        return {"error": f"{err} (run at {Path(path).name}:{line})"}


def main() -> None:
    proto_in, proto_out = protocol_streams()
    reply = run_program(wire.receive(proto_in))
    wire.send(proto_out, reply)


if __name__ == "__main__":
    main()
