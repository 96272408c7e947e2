"""Built-in environments (standard library only: each runs inside a sandbox, as a user's environment file does)."""
