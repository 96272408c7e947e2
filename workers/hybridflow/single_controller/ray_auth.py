"""Token authentication for a Ray this process starts on its own machine (`hybridflow run`, and client.local's runs,
which are `hybridflow run`): a fresh random token per run, as the operator gives each job's pods a token of their
own (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN). Without it, anyone who reaches the node's Ray ports (another user of the
machine, a neighbour on its network) could submit work to the run; and Ray's own default for a new local cluster is
one token for every run of a user, kept in ~/.ray/auth_token."""
from __future__ import annotations

import os
import secrets

RAY_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def fresh_ray_token() -> dict[str, str | None]:
    """Token authentication, with a fresh random token, for the Ray this process starts next (its GCS, raylet and
    workers inherit the environment): another user of the machine cannot submit work to it, nor can a process
    holding the token of an earlier run (Ray's default token lives on in ~/.ray/auth_token). Set as the operator
    sets it for a job's pods (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN). Returns what it replaced (`restore_ray_auth`)."""
    saved = {k: os.environ.get(k) for k in RAY_AUTH_ENV}
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    _reload_ray_auth()
    return saved


def restore_ray_auth(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _reload_ray_auth()


def _reload_ray_auth() -> None:
    """Ray caches its config and token when first imported; a later change of the environment needs a reload."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # a Ray without token authentication (or none): nothing cached
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
