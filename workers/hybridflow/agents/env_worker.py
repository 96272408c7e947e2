"""One environment session, inside its own sandbox (`python -m hybridflow.agents.env_worker`): loads the environment
class (a built-in's "module:class" or the user's file), makes one instance, then answers reset and step calls, one
JSON line each way, until the driver closes the pipe. It turns what the user's code returns into plain values
here, so that only JSON goes back. Standard library only."""
from __future__ import annotations

import math
import numbers
from typing import Any

from hybridflow import wire
from hybridflow.agents._user_code import describe, load, protocol_streams


def _plain(info: Any) -> dict[str, Any]:
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise TypeError(f"info must be a dict, got {type(info).__name__}")
    return {str(k): v if isinstance(v, (str, bool, int, float)) or v is None else repr(v) for k, v in info.items()}


def _step_reply(result: Any) -> dict[str, Any]:
    if not isinstance(result, tuple) or len(result) != 4:
        raise TypeError(f"step must return (observation, reward, done, info), got {type(result).__name__}")
    observation, reward, done, info = result
    if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise TypeError(f"the reward must be a finite number, got {reward!r:.80}")
    return {"text": "" if observation is None else str(observation), "reward": float(reward), "done": bool(done),
            "info": _plain(info)}


def main() -> None:
    proto_in, proto_out = protocol_streams()
    try:
        env = load(wire.receive(proto_in), "class")()
        wire.send(proto_out, {"ready": True})
    except BaseException as err:  # noqa: BLE001 - reported to the driver, with the file and line
        wire.send(proto_out, {"error": describe(err)})
        return
    while True:
        try:
            call = wire.receive(proto_in)
        except wire.WireError:
            return
        try:
            if call["op"] == "reset":
                first = env.reset(call["sample"])
                wire.send(proto_out, {"text": "" if first is None else str(first)})
            else:
                wire.send(proto_out, _step_reply(env.step(str(call["action"]))))
        except BaseException as err:  # noqa: BLE001 - the user's exception ends the episode, reported
            wire.send(proto_out, {"error": describe(err)})


if __name__ == "__main__":
    main()
