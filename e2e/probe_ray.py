"""Run inside a pod that is not part of a job: can it reach the job's Ray head without the job's token?

Prints one JSON line: the job agent's answer to an unauthenticated job submission (Ray's per-node dashboard agent,
`POST /api/job_agent/jobs/`, which would run a shell entrypoint), and GCS's answer to a gRPC call made without a
token, with a wrong one and (when PROBE_TOKEN is set) with the right one: the control that shows the network path
is open and only the token decides. The scenario passes this file's text to `python3 -c`, so it needs nothing but
the worker image.
"""
import json
import os
import sys
import time
import urllib.error
import urllib.request

import grpc
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc


def submit_job(host: str, port: int) -> object:
    body = json.dumps({"entrypoint": "touch /tmp/probe-ran", "submission_id": "probe"}).encode()
    req = urllib.request.Request(f"http://{host}:{port}/api/job_agent/jobs/", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError as err:
        return f"unreachable: {err}"


def gcs_call(host: str, port: int, token: str | None) -> str:
    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        meta = [("authorization", f"Bearer {token}")] if token else []
        stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=10, metadata=meta)
        return "OK"
    except grpc.RpcError as err:
        return err.code().name
    finally:
        channel.close()


def answered(probe, *args, patience: float = 60.0) -> object:
    """The probe's first real answer: the head may still be starting Ray's agents when this pod runs."""
    deadline = time.time() + patience
    while True:
        answer = probe(*args)
        if not (str(answer).startswith("unreachable") or answer == "UNAVAILABLE") or time.time() > deadline:
            return answer
        time.sleep(1)


if __name__ == "__main__":
    host, gcs_port, agent_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out = {"job_agent": answered(submit_job, host, agent_port), "gcs_without_token": gcs_call(host, gcs_port, None),
           "gcs_with_a_wrong_token": gcs_call(host, gcs_port, "0" * 64)}
    if os.environ.get("PROBE_TOKEN"):
        out["gcs_with_the_token"] = gcs_call(host, gcs_port, os.environ["PROBE_TOKEN"])
    print(json.dumps(out))
