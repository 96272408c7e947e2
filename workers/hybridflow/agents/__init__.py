"""Agentic RL: multi-turn rollouts in which the model calls tools and acts in environments, between its turns.

The modules, by job: protocol (what the rollout needs of tools and environment sessions, as data and Protocols),
registry (the registered tools and environments, by name), toolcalls (parsing `<tool_call>` JSON out of a turn and
rendering tools and observations, pure), tool_file (a user's tools file, read without running it), local (tools and
sessions in sandboxes on this machine), wire (the JSON-lines protocol spoken with a sandboxed worker), tool_worker
and env_worker (what runs inside each sandbox: standard library only), loop (many episodes at once over one
generation engine), envs (the built-in environments). The environment pool's HTTP server and client (remote,
server) speak the same protocol over the network.
"""
