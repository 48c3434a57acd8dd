"""What every side of Springback shares: the API client and its plumbing.

- `channel`: the gRPC channel to the coordinators (addresses, TLS, bearer
  token, retries of idempotent calls on UNAVAILABLE, deadlines).
- `api`: `Client`, the job-control API for Python programs, and `ApiError`.
- `errors`: the one exception hierarchy and its mapping to gRPC status codes.
- `spec`: job-spec parsing and validation (the client checks before sending,
  the coordinator again on receipt).
- `layout`: the parallel layout's rules (defaults, which worlds fit, the dp
  split, rank <-> coordinate <-> piece), for the spec, planner and ranks.
- `env`: the environment variables the agent sets for its ranks.
- `metrics`: the Prometheus `/metrics` endpoint served by coordinator and agent.
- `summary`: the JSON views of API objects (CLI `--json`, dashboard).

It imports only the generated API (`springback.v1`) and libraries; the
coordinator, the agent, the training library and the CLI import it.
Submodules are imported explicitly (this file imports nothing), so a training
script that needs `env` does not pull in gRPC stubs it does not use.
"""
