"""Shared plumbing with no DAPO in it: `http` (one HTTP helper with timeouts and retries, for the judge, the
SandboxFusion client and the vLLM server client) and `killable_pool` (a process pool whose workers are killed when a
call passes its deadline). Light on purpose: math-verify's worker processes import from here."""
