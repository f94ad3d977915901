"""What DAPOTrainer adds around TRL's tool loop: parallel tool calls, cleanup, and tool metrics.

TRL executes a turn's tool calls one after another, even async ones. `ToolRuntime.on_turn` parses each turn just
generated with TRL's own `parse_response` and starts every code_interpreter call at once (behind the sandbox's
gate); TRL's sequential call then picks up the finished result, so a turn's tool time is its slowest call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..rewards import tool_turns
from .code_interpreter import CodeInterpreter, interpreter_of


class ToolRuntime:
    """Per-trainer tool state: the sandboxed interpreters behind the tools, and the generation's turn counter."""

    def __init__(self, tools: Sequence[Callable], tokenizer: Any, max_rounds: int | None):
        self.tools = list(tools)
        self.tokenizer = tokenizer
        self.max_rounds = max_rounds
        self.interpreters: dict[str, CodeInterpreter] = {
            tool.__name__: interpreter_of(tool) for tool in self.tools if interpreter_of(tool)
        }
        self.turn = 0

    def begin_generation(self) -> None:
        self.turn = 0

    def end_generation(self) -> None:
        """Drop prefetched executions nobody asked for (rows TRL rolled back or stopped)."""
        for interpreter in self.interpreters.values():
            interpreter.discard_prefetched()

    def on_turn(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> None:
        """Start every code_interpreter call of the turn just generated, before TRL asks for them.

        Calls of the last allowed turn are not started: TRL will not execute them.
        """
        turn = self.turn
        self.turn += 1
        if not self.interpreters or len(prompt_ids) != len(completion_ids):
            return
        if self.max_rounds is not None and turn >= self.max_rounds:
            return
        from trl.chat_template_utils import parse_response

        for prefix, ids in zip(prompt_ids, completion_ids, strict=True):
            if not ids:
                continue
            message = parse_response(self.tokenizer, ids, prefix=prefix, tools=self.tools)
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                interpreter = self.interpreters.get(function.get("name"))
                arguments = function.get("arguments")
                if interpreter is not None and isinstance(arguments, dict) and set(arguments) == {"code"}:
                    interpreter.prefetch(arguments["code"])

    def metrics(self, completions: list, accelerator: Any) -> dict[str, float]:
        """Tool rounds per response (ReTool's turns) and how sandbox executions ended, over all processes."""
        device = accelerator.device
        rounds = accelerator.gather(torch.tensor([(tool_turns(c) - 2) / 2 for c in completions], device=device))
        metrics = {
            "tools/rounds_per_response": rounds.mean().item(),
            "tools/max_rounds_per_response": rounds.max().item(),
            "tools/responses_with_tool_use": (rounds > 0).float().mean().item(),
        }
        if not self.interpreters:
            return metrics
        totals: Counter = Counter()
        for interpreter in self.interpreters.values():
            totals.update(interpreter.stats())
        names = sorted(totals)
        counts = torch.tensor([totals[name] for name in names], device=device, dtype=torch.float64)
        counts = accelerator.reduce(counts, reduction="sum")
        totals = dict(zip(names, counts.tolist(), strict=True))
        executions = totals.pop("calls")
        seconds = totals.pop("seconds")
        metrics["tools/executions"] = executions
        metrics["tools/exec_seconds_mean"] = seconds / executions if executions else 0.0
        for status, count in totals.items():
            if status != "ok":
                metrics[f"tools/{status}_rate"] = count / executions if executions else 0.0
        return metrics
