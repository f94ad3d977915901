"""In-flight weight updates against a real vLLM server: versions switch inside responses, checked token by token.

Usage: python vllm_in_flight.py OUT MODEL_DIR BASE_URL
The server runs MODEL_DIR in float32 and dev mode (as tests/test_vllm.py starts it). Two weights versions are written
to shared storage: 0, the model's own, and 1, every parameter moved by 2% noise. For each KV-cache mode
(`rollout_in_flight_kv_cache`: recompute, keep), groups of 4 responses of 64 tokens (EOS ignored) start under version
0; once they are well under way the engine loads version 1 with them running (`VLLMServerEngine(in_flight_updates=
True)`: pause with requests kept, reload, resume). Every generated token is then re-scored by the trainer's model
under both versions (teacher forcing, the whole context), and OUT/in_flight.json gets, per mode and per version the
engine assigned, the largest and mean gap between the engine's sampling log-prob and each re-score. Tokens before the
switch were sampled by version 0: their gap to version 0 is float32 noise. Tokens after it: with `recompute` the
server recomputed the KV cache with version 1, so their gap to version 1 is float32 noise too; with `keep` they were
sampled over the KV cache version 0 wrote for the earlier tokens, and their gap to a full version-1 re-score is what
the importance weight absorbs. `resume`: the groups are kept as a checkpoint keeps them (`partial_groups`), the
engine dropped, and a new one continues each completion from its kept tokens under version 1: every completion
must hold its kept tokens then the rest (`kept_tokens_then_continued`), nothing sampled twice.

`switches` (the last argument, instead of the modes above): with `keep` the pauses keep the prefix cache, so a new
request whose prompt shares blocks with one computed under an older version would reuse that version's KV. A long
group (a 300-token prompt: vLLM-CPU caches whole blocks of 128 tokens) runs under version 0 while versions 1, 2 and 3
load in flight (each 2% noise away from the one before); after each load a new group of the same prompt starts and
is re-scored under the version it started under. OUT/switches.json gets each one's gap, with the engine's per-version
`cache_salt` (what it sends) and without it (the prompt's blocks from version 0 reused).
"""

import json
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from dapo_trl.training.rollout.rollout_engine import GroupRequest, RequestSampling
from dapo_trl.training.rollout.server_engine import VLLMServerEngine
from dapo_trl.training.rollout.vllm_server_api import reload_server_weights, save_weights

GROUPS, N, TOKENS, PROMPT = 2, 4, 64, [5, 6, 7, 8, 9]
MODES = ("recompute", "keep", "resume")


def token_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def switch_inside_responses(root: Path, base_url: str, model, moved, mode: str) -> dict:
    """Start groups under version 0, load version 1 while they run (or, `resume`, keep them as a checkpoint would,
    drop the engine and continue them under version 1 from a new one), and measure each token against both
    versions."""
    sampling = RequestSampling(n=N, max_tokens=TOKENS, extra={"ignore_eos": True})

    def new_engine() -> VLLMServerEngine:
        return VLLMServerEngine(
            base_url, sampling, GROUPS, 120, root, reload_server_weights, root, True, keep_kv_cache=mode == "keep"
        )

    engine = new_engine()
    engine.load_weights(0)  # nothing runs: the usual reload
    results, finished = {}, threading.Event()

    def done(request, result):
        results[request.key] = result
        if len(results) == GROUPS:
            finished.set()

    requests = [GroupRequest(("stream", group), PROMPT, 100 + group, version=0) for group in range(GROUPS)]
    for request in requests:
        engine.start(request, done)
    deadline = time.monotonic() + 120
    while engine._received < GROUPS * N * 24 * 200 and not results:  # ~24 tokens into every response
        assert time.monotonic() < deadline, "the server generated nothing"
        time.sleep(0.01)
    assert not results, f"the groups ended before the switch: {results}"
    started, kept = time.monotonic(), {}
    if mode == "resume":  # a checkpoint keeps them; the run dies; a new one continues them under version 1
        kept = engine.partial_groups()
        engine.close()
        engine = new_engine()
        engine.load_weights(1)
        for request in requests:
            engine.start(replace(request, version=1, partial=kept[request.key]), done)
    else:
        engine.load_weights(1)
    pause_seconds = time.monotonic() - started
    assert finished.wait(300), "the groups did not finish after the switch"
    engine.close()
    report = {"pause_reload_resume_seconds": pause_seconds, "switched_completions": 0, "tokens": {}}
    if kept:
        report["kept_tokens_then_continued"] = all(
            results[key].completion_ids[i][: len(partial.token_ids[i])] == partial.token_ids[i].tolist()
            and len(results[key].completion_ids[i]) == TOKENS
            for key, partial in kept.items()
            for i in range(N)
        )
    gaps = {0: {0: [], 1: []}, 1: {0: [], 1: []}}  # assigned version -> re-scored under version -> gaps
    for result in results.values():
        if isinstance(result, BaseException):
            raise result
        for completion, ids in enumerate(result.completion_ids):
            versions = result.token_versions(completion)
            report["switched_completions"] += int(len(set(versions.tolist())) > 1)
            engine_logprobs = torch.tensor(result.logprobs[completion])
            for version, weights in ((0, model), (1, moved)):
                gap = (engine_logprobs - token_logprobs(weights, PROMPT, ids)).abs()
                for assigned in (0, 1):
                    gaps[assigned][version].extend(gap[torch.from_numpy(versions == assigned)].tolist())
    for assigned, by_version in gaps.items():
        report["tokens"][f"sampled_by_v{assigned}"] = {
            "count": len(by_version[0]),
            **{
                f"gap_to_v{version}_{stat}": (max(values) if stat == "max" else sum(values) / len(values))
                if values
                else None
                for version, values in by_version.items()
                for stat in ("max", "mean")
            },
        }
    return report


LONG_PROMPT = [5 + index % 200 for index in range(300)]
SWITCHES = 3


class SwitchesEngine(VLLMServerEngine):
    """The anchor group samples long enough to run through every switch; `salted=False` drops the per-version
    `cache_salt` (what `keep` did before)."""

    salted = True

    def request_payload(self, request):
        payload = super().request_payload(request)
        if request.key[0] == "anchor":
            payload["max_tokens"] = 700  # with the 300-token prompt, within the tiny model's 1024 positions
        if not self.salted:
            payload.pop("cache_salt", None)
        return payload


def fresh_groups_after_switches(root: Path, base_url: str, versions: list, salted: bool) -> list[dict]:
    """See the module docstring (`switches`): per switch, the new group's gap to its own version's re-score."""
    engine = SwitchesEngine(
        base_url,
        RequestSampling(n=N, max_tokens=32, extra={"ignore_eos": True}),
        GROUPS,
        120,
        root,
        reload_server_weights,
        root,
        True,
        keep_kv_cache=True,
    )
    engine.salted = salted
    engine.load_weights(0)  # nothing runs: the usual reload (the prefix cache reset)
    results, events = {}, {}

    def done(request, result):
        results[request.key] = result
        events.setdefault(request.key, threading.Event()).set()

    anchor = GroupRequest(("anchor", 0), LONG_PROMPT, 7, version=0)  # runs through every switch
    engine.start(replace(anchor), done)
    deadline = time.monotonic() + 120
    while engine._received < 2000:
        assert time.monotonic() < deadline, "the server generated nothing"
        time.sleep(0.01)
    report = []
    for version in range(1, SWITCHES + 1):
        assert engine.running(), "the anchor group ended: the load would not be in flight"
        engine.load_weights(version)  # pause (prefix cache kept), reload, resume
        fresh = GroupRequest(("fresh", version), LONG_PROMPT, 100 + version, version=version)
        events[fresh.key] = threading.Event()
        engine.start(fresh, done)
        assert events[fresh.key].wait(120), "the new group did not finish"
    engine.close()
    for version in range(1, SWITCHES + 1):  # re-scored once the anchor is no longer needed
        result = results[("fresh", version)]
        if isinstance(result, BaseException):
            raise result
        gaps = [
            (torch.tensor(result.logprobs[i]) - token_logprobs(versions[version], LONG_PROMPT, ids)).abs()
            for i, ids in enumerate(result.completion_ids)
        ]
        gap = torch.cat(gaps)
        report.append({"switches": version, "gap_max": gap.max().item(), "gap_mean": gap.mean().item()})
    return report


def switches(out: Path, model_dir: str, base_url: str) -> None:
    torch.manual_seed(0)
    versions = [AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()]
    for _ in range(SWITCHES):
        moved = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        moved.load_state_dict(versions[-1].state_dict())
        with torch.no_grad():
            for parameter in moved.parameters():
                parameter.add_(0.02 * parameter.abs().mean() * torch.randn_like(parameter))
        versions.append(moved)
    root = Path(tempfile.mkdtemp(prefix="in-flight-switches-"))
    for version, model in enumerate(versions):
        save_weights(model.named_parameters(), root / f"v{version}")
    report = {
        "salted": fresh_groups_after_switches(root, base_url, versions, salted=True),
        "unsalted": fresh_groups_after_switches(root, base_url, versions, salted=False),
    }
    (out / "switches.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def main(out: Path, model_dir: str, base_url: str) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    moved = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in moved.parameters():
            parameter.add_(0.02 * parameter.abs().mean() * torch.randn_like(parameter))
    root = Path(tempfile.mkdtemp(prefix="in-flight-"))
    save_weights(model.named_parameters(), root / "v0")
    save_weights(moved.named_parameters(), root / "v1")
    report = {mode: switch_inside_responses(root, base_url, model, moved, mode) for mode in MODES}
    (out / "in_flight.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    output = Path(sys.argv[1])
    output.mkdir(parents=True, exist_ok=True)
    (switches if sys.argv[4:] == ["switches"] else main)(output, sys.argv[2], sys.argv[3])
