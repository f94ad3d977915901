"""The rollout and its engines: streaming dynamic sampling and generation overlapped with training.

- `rollout_stream` (the reorder buffer: groups accepted in prompt-stream order), `stream_plan` (each group's key and
  seed, the look-ahead, which rows each process trains);
- `rollout_driver` (the thread that admits seeded group requests and owns the engine's weights), `rollout_engine`
  (the engines' protocol and a group's result);
- `server_engine` (a vLLM server's client), `server_http` (its HTTP), `server_pause` (a server paused for an in-flight
  load, always resumed), `server_answers` (its answers, whole or streamed with each token's weights version),
  `server_progress` (the watchdog that times a server out by its progress, not a response's length),
  `colocate_engine` (colocated vLLM's);
- `rollout_setup` (builds them and deals with the trainer), `vllm_server_api` (a vLLM server's HTTP API: bounded
  requests, named failures, the weight files it reloads), `vllm_backends` (TRL's vLLM backend, patched: timeouts,
  shared-storage weight sync, CPU colocate; chosen once from the run's arguments).
"""
