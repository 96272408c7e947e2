"""Agentic RL: multi-turn rollouts in which the model calls tools and acts in environments, between its turns.

The modules, by job: protocol (what the rollout needs of tools and environment sessions, as data and Protocols),
registry (the registered tools and environments, by name), toolcalls (parsing `<tool_call>` JSON out of a turn and
rendering tools and observations, pure), tool_file (a user's tools file, read without running it), local (tools and
sessions in sandboxes on this machine), wire (the JSON-lines protocol spoken with a sandboxed worker), tool_worker
and env_worker (what runs inside each sandbox: standard library only), loop (many episodes at once over one
generation engine), envs (the built-in environments). The environment pool's HTTP server and client (remote,
server) speak the same protocol over the network.

A user's own agent program (spec.rollout.agent.program) instead of the loop: endpoint (an OpenAI-compatible server
on a Unix socket, recording each call's exact token ids) with openai_wire (its requests and responses, pure),
trajectory (an episode's calls assembled into what is trained, pure), program_loop (many programs at once over one
generation engine), program (each run in a sandbox of its own) and program_worker (what runs inside it).
"""
