"""Shared plumbing with no DAPO in it: `http` (one HTTP helper with timeouts and retries, for the judge, the
SandboxFusion client and the vLLM server client), `killable_pool` (a process pool whose workers are killed when a
call passes its deadline) and `transformers_compat` (field names that changed across the supported transformers).
Light on purpose: math-verify's worker processes import from here."""
