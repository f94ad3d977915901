"""DAPOConfig (dapo_trl/config/): defaults, validation messages, GRPOConfig compatibility.

Its flags and YAML recipes on the command line are tests/test_cli_arguments.py's."""

import pytest
from trl import GRPOConfig

from dapo_trl import DAPOConfig


def make(tmp_path, **overrides):
    return DAPOConfig(output_dir=str(tmp_path), report_to="none", **overrides)


def test_dapo_defaults(tmp_path):
    config = make(tmp_path)
    assert isinstance(config, GRPOConfig)
    assert config.loss_type == "dapo"
    assert (config.epsilon, config.epsilon_high) == (0.2, 0.28)
    assert config.beta == 0.0 and config.temperature == 1.0 and config.learning_rate == 1e-6
    assert config.apply_overlong_penalty and config.overlong_penalty_factor == 1.0
    assert config.overlong_buffer_len == int(0.2 * config.max_completion_length)
    assert config.delta is None and config.clip_ratio_c is None
    assert config.filter_groups_enable and config.max_filter_gen_batches == 10


def test_the_process_group_outwaits_a_round_of_a_vllm_server(tmp_path):
    """With a vLLM server the other processes wait in TRL's broadcast for a whole generation round (25-50 minutes at
    the paper's settings): transformers' 1800 s would end the run there. A value the user sets is kept."""
    server = make(tmp_path, use_vllm=True, vllm_mode="server")
    assert server.ddp_timeout == 7200 and server.ddp_timeout_delta.total_seconds() == 7200
    assert make(tmp_path).ddp_timeout == 1800  # every process generates: nobody waits for a round
    assert make(tmp_path, use_vllm=True, vllm_mode="server", ddp_timeout=600).ddp_timeout == 600


def test_tensorboard_is_the_default_logger(tmp_path):
    assert DAPOConfig(output_dir=str(tmp_path)).report_to == ["tensorboard"]


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"max_completion_length": 64, "overlong_buffer_len": 65}, "overlong_buffer_len"),
        ({"overlong_penalty_factor": -1.0}, "overlong_penalty_factor"),
        ({"clip_ratio_c": 1.2}, "clip_ratio_c"),
        ({"clip_ratio_c": 3.0, "delta": 2.0}, "clip_ratio_c"),
        ({"loss_type": "ppo"}, "loss_type"),
        ({"epsilon": 1.5}, "epsilon"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"max_filter_gen_batches": -1}, "max_filter_gen_batches"),
        ({"filter_groups_shuffle_buffer_size": 0}, "filter_groups_shuffle_buffer_size"),
        ({"max_prompt_length": 0}, "max_prompt_length"),
        ({"overlong_prompt_policy": "truncate"}, "overlong_prompt_policy"),
        ({"entropy_coeff": 0.1, "entropy_coef": 0.2}, "entropy_coeff"),
    ],
)
def test_bad_values_name_the_field(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        make(tmp_path, **overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        {"gradient_accumulation_steps": 2, "steps_per_generation": 3},  # an optimizer step spans two generations
        {"gradient_accumulation_steps": 3, "steps_per_generation": 1},
        {"filter_groups_enable": True, "scale_rewards": "batch"},
        {"filter_groups_enable": True, "multi_objective_aggregation": "normalize_then_sum"},
    ],
)
def test_grpo_config_layouts_are_accepted(tmp_path, overrides):
    """Drop-in: what GRPOConfig accepts, DAPOConfig accepts (the trainer makes these exact)."""
    config = make(tmp_path, **overrides)
    trl_fields = {key: value for key, value in overrides.items() if key in GRPOConfig.__dataclass_fields__}
    GRPOConfig(output_dir=str(tmp_path), report_to="none", bf16=False, use_cpu=True, **trl_fields)
    assert all(getattr(config, key) == value for key, value in overrides.items())


def test_dual_clip_maps_to_trl_delta(tmp_path):
    config = make(tmp_path, clip_ratio_c=3.0)
    assert config.delta == 3.0


def test_entropy_coeff_alias(tmp_path):
    assert make(tmp_path, entropy_coeff=0.01).entropy_coef == 0.01


def test_overlong_penalty_can_be_switched_off_with_any_buffer(tmp_path):
    config = make(tmp_path, apply_overlong_penalty=False, max_completion_length=8, overlong_buffer_len=100)
    assert not config.apply_overlong_penalty
