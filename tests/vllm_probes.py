"""Log-probability probes for the vLLM tests: does the engine, after a weight sync, score like the trainer's model?

Test code (tests/scripts/vllm_run.py), run in the vLLM venv; the engine-side probes import vLLM lazily.
"""

from __future__ import annotations

from typing import Any

import torch

from dapo_trl.training.rollout.vllm_server_api import server_request


def served_model_name(base_url: str, timeout: float = 30.0) -> str:
    """The model id the server answers to (GET /v1/models), from any process."""
    return server_request("GET", f"{base_url.rstrip('/')}/v1/models", timeout).json()["data"][0]["id"]


def server_sequence_logprobs(
    base_url: str, model: str, token_ids: list[int], timeout: float = 120.0
) -> list[float | None]:
    """The server's log-probability of each token of `token_ids` given the ones before (first is None)."""
    payload = {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    choice = server_request("POST", f"{base_url.rstrip('/')}/v1/completions", timeout, json=payload).json()["choices"][
        0
    ]
    out: list[float | None] = []
    for position, entry in enumerate(choice["prompt_logprobs"]):
        out.append(None if entry is None else entry[str(token_ids[position])]["logprob"])
    return out


@torch.no_grad()
def model_sequence_logprobs(model: torch.nn.Module, token_ids: list[int]) -> list[float]:
    """The trainer model's log-probability of each token of `token_ids` after the first (float32, no sampling)."""
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], device=device)
    logits = model(input_ids=ids).logits.float()
    logps = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logps.tolist()


def engine_sequence_logprobs(llm: Any, token_ids: list[int]) -> list[float | None]:
    """An in-process vLLM `LLM`'s log-probability of each token of `token_ids` given the ones before (first None)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
    output = llm.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False)[0]
    out: list[float | None] = []
    for position, entry in enumerate(output.prompt_logprobs):
        out.append(None if entry is None else entry[token_ids[position]].logprob)
    return out
