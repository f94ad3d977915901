"""What a translation plans beside the recipe: verl's batch sizes as TRL's layout (`BatchPlan`, filled by `batches`)
and the vLLM server to start (`VLLMServer`, filled by `rollout`). Kept apart so `translation` can hold them without
importing the concern modules that fill them."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BatchPlan:
    """verl's batch sizes as TRL's layout (see `plan_batches`)."""

    world_size: int
    num_generations: int
    train_batch_size: int
    ppo_mini_batch_size: int
    ppo_epochs: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    max_tokens_per_microbatch: int | None
    filter_groups_oversample: int
    notes: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def updates_per_rollout(self) -> int:
        """Optimizer steps per verl rollout step (one generation batch): K = train / mini x ppo_epochs."""
        return self.steps_per_generation // self.gradient_accumulation_steps * self.ppo_epochs

    @property
    def responses_per_update(self) -> int:
        return self.per_device_train_batch_size * self.world_size * self.gradient_accumulation_steps

    @property
    def responses_per_rollout(self) -> int:
        return self.per_device_train_batch_size * self.world_size * self.steps_per_generation


@dataclass
class VLLMServer:
    """The vLLM server for the rollout settings, as scripts/start_vllm_server.sh and `trl vllm-serve` take it."""

    model: str
    tensor_parallel_size: int
    data_parallel_size: int
    gpu_memory_utilization: float
    max_model_len: int
    dtype: str
    extra_args: list[str] = field(default_factory=list)

    def environment(self) -> dict[str, str]:
        return {
            "MODEL_PATH": self.model,
            "TP": str(self.tensor_parallel_size),
            "DP": str(self.data_parallel_size),
            "GPU_MEMORY_UTILIZATION": f"{self.gpu_memory_utilization:g}",
            "MAX_MODEL_LEN": str(self.max_model_len),
            "DTYPE": self.dtype,
        }

    def script_command(self) -> str:
        assignments = [f"{name}={shlex.quote(value)}" for name, value in self.environment().items()]
        return " ".join([*assignments, "scripts/start_vllm_server.sh", *map(shlex.quote, self.extra_args)])

    def trl_command(self) -> str:
        return (
            f"trl vllm-serve --model {shlex.quote(self.model)} --tensor_parallel_size {self.tensor_parallel_size} "
            f"--data_parallel_size {self.data_parallel_size} --gpu_memory_utilization "
            f"{self.gpu_memory_utilization:g} --max_model_len {self.max_model_len} --dtype {self.dtype}"
        )
