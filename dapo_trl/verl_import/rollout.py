"""Generation: sampling, validation sampling, the vLLM server (`VLLMServer`), and multi-turn tool calling."""

from __future__ import annotations

import os
from pathlib import Path

from .plans import VLLMServer
from .translation import APPROXIMATED, MAPPED, NOT_NEEDED, UNSUPPORTED, Translation, as_boolean, recipe_line, show_value

# Greedy validation (verl's val_kwargs temperature 0 / do_sample False): vLLM samples greedily below 1e-5.
GREEDY_TEMPERATURE = 1e-6


def map_rollout(t: Translation) -> None:
    rollout = "actor_rollout_ref.rollout."
    engine = str(t.value(rollout + "name"))
    if engine in ("vllm", "sglang"):
        t.set(use_vllm=True, vllm_mode="server", vllm_importance_sampling_correction=False)
        t.record(
            rollout + "name",
            MAPPED if engine == "vllm" else APPROXIMATED,
            "use_vllm: true, vllm_mode: server",
            "generation on a vLLM server (vllm_server.sh)" + ("" if engine == "vllm" else "; verl used SGLang"),
        )
        t.default(
            "algorithm.rollout_correction.rollout_is",
            MAPPED,
            "vllm_importance_sampling_correction: false",
            "verl applies no rollout importance correction unless algorithm.rollout_correction says so "
            "(TRL's default is on)",
        )
    else:
        t.set(use_vllm=False)
        t.mark(rollout + "name", MAPPED, "use_vllm: false", "generation with transformers")
    temperature = float(t.value(rollout + "temperature"))
    top_p = float(t.value(rollout + "top_p"))
    top_k = int(t.value(rollout + "top_k"))
    t.set(temperature=temperature, top_p=top_p, top_k=max(top_k, 0))
    t.mark(rollout + "temperature", MAPPED, recipe_line("temperature", temperature), "sampling temperature")
    t.mark(rollout + "top_p", MAPPED, recipe_line("top_p", top_p), "nucleus sampling")
    t.mark(rollout + "top_k", MAPPED, recipe_line("top_k", max(top_k, 0)), "-1 (verl) = 0 (TRL): no top-k")
    if as_boolean(t.value(rollout + "do_sample")):
        t.mark(rollout + "do_sample", MAPPED, "(sampling)", "sampled rollouts")
    else:
        t.mark(
            rollout + "do_sample", UNSUPPORTED, "", "greedy training rollouts make every group constant", blocking=True
        )
    if as_boolean(t.value(rollout + "ignore_eos")):
        t.mark(rollout + "ignore_eos", UNSUPPORTED, "", "generation past EOS is not supported", blocking=True)
    else:
        t.mark(rollout + "ignore_eos", NOT_NEEDED, how="off")

    # Validation sampling. verl's vLLM/SGLang rollouts (its agent loop) sample with val_kwargs' temperature and
    # ignore val_kwargs.do_sample; its transformers rollout decodes greedily when do_sample is off.
    val = rollout + "val_kwargs."
    sampled = as_boolean(t.value(val + "do_sample")) or engine in ("vllm", "sglang")
    greedy = not sampled or float(t.value(val + "temperature")) == 0
    val_temperature = GREEDY_TEMPERATURE if greedy else float(t.value(val + "temperature"))
    val_top_p = float(t.value(val + "top_p"))
    samples = int(t.value(val + "n"))
    t.set(eval_num_samples=samples, eval_temperature=val_temperature, eval_top_p=val_top_p)
    greedy_how = (
        "greedy validation (verl: temperature 0, or do_sample off with the transformers rollout): eval_temperature "
        "1e-6, which vLLM samples greedily and transformers nearly so"
    )
    t.record(val + "n", MAPPED, recipe_line("eval_num_samples", samples), "responses per validation prompt (avg@n)")
    t.record(
        val + "temperature",
        APPROXIMATED if greedy else MAPPED,
        recipe_line("eval_temperature", val_temperature),
        greedy_how if greedy else "validation temperature",
    )
    t.record(val + "top_p", MAPPED, recipe_line("eval_top_p", val_top_p), "validation nucleus sampling")
    if engine in ("vllm", "sglang"):
        t.mark(
            val + "do_sample", NOT_NEEDED, how="verl's vLLM/SGLang rollout ignores it: val_kwargs.temperature decides"
        )
    else:
        t.mark(
            val + "do_sample",
            APPROXIMATED if greedy else MAPPED,
            "see val_kwargs.temperature",
            greedy_how if greedy else "sampled validation",
        )
    val_top_k = int(t.value(val + "top_k"))
    t.mark(
        val + "top_k",
        NOT_NEEDED if val_top_k <= 0 else UNSUPPORTED,
        "",
        "-1: no top-k" if val_top_k <= 0 else "validation top-k is not configurable",
    )

    # vLLM server.
    tp = int(t.value(rollout + "tensor_model_parallel_size"))
    dp = int(t.value(rollout + "data_parallel_size"))
    memory = float(t.value(rollout + "gpu_memory_utilization"))
    explicit_length = t.value(rollout + "max_model_len")
    length = (
        int(explicit_length)
        if explicit_length
        else int(t.recipe["max_prompt_length"]) + int(t.recipe["max_completion_length"])
    )
    extra: list[str] = []
    flags = {
        "max_num_batched_tokens": "--max-num-batched-tokens",
        "max_num_seqs": "--max-num-seqs",
    }
    for name, flag in flags.items():
        if t.given(rollout + name):
            extra += [flag, str(t.value(rollout + name))]
            t.mark(rollout + name, MAPPED, f"vllm_server.sh {flag} {t.value(rollout + name)}", "vLLM engine setting")
    switches = {"enable_chunked_prefill": "chunked-prefill", "enable_prefix_caching": "prefix-caching"}
    for name, flag in switches.items():
        if t.given(rollout + name):
            on = as_boolean(t.value(rollout + name))
            extra.append(f"--{'' if on else 'no-'}enable-{flag}")
            t.mark(rollout + name, MAPPED, f"vllm_server.sh {extra[-1]}", "vLLM engine setting")
    if as_boolean(t.value(rollout + "enforce_eager")):
        extra.append("--enforce-eager")
        t.mark(rollout + "enforce_eager", MAPPED, "vllm_server.sh --enforce-eager", "vLLM engine setting")
    else:
        t.mark(rollout + "enforce_eager", NOT_NEEDED, how="off")
    for key in [k for k in t.found.values if k.startswith(rollout + "engine_kwargs.vllm.")]:
        flag = "--" + key.rsplit(".", 1)[-1].replace("_", "-")
        value = t.found.values[key]
        extra += [flag] if value is True else [flag, show_value(value)]
        t.mark(key, APPROXIMATED, f"vllm_server.sh {flag}", "passed to vllm serve under the same name")
    expert_parallel = rollout + "expert_parallel_size"
    if t.given(expert_parallel) and int(t.value(expert_parallel)) > 1:
        # verl's vLLM rollout passes enable_expert_parallel and asserts expert_parallel_size = TP x DP: vLLM splits a
        # MoE model's experts over all TP x DP GPUs of the engine.
        ep, gpus = int(t.value(expert_parallel)), tp * dp
        extra.append("--enable-expert-parallel")
        how = f"vLLM's expert parallelism: the experts split over TP x DP = {gpus} GPUs"
        if ep != gpus:
            how += f" (verl requires expert_parallel_size = TP x DP, here {ep})"
        t.mark(expert_parallel, MAPPED if ep == gpus else APPROXIMATED, "vllm_server.sh --enable-expert-parallel", how)
    model = str(t.recipe.get("model_name_or_path", "MODEL_PATH"))
    t.vllm = VLLMServer(model, tp, dp, memory, length, str(t.value(rollout + "dtype")), extra)
    if engine in ("vllm", "sglang"):
        t.record(rollout + "tensor_model_parallel_size", MAPPED, f"vllm_server.sh TP={tp}", "tensor parallel size")
        t.record(
            rollout + "gpu_memory_utilization",
            MAPPED,
            f"vllm_server.sh GPU_MEMORY_UTILIZATION={memory:g}",
            "KV-cache share of the server's GPUs",
        )
        t.mark(rollout + "data_parallel_size", MAPPED, f"vllm_server.sh DP={dp}", "engine replicas")
        t.mark(rollout + "max_model_len", MAPPED, f"vllm_server.sh MAX_MODEL_LEN={length}", "context length")
        t.mark(rollout + "dtype", MAPPED, f"vllm_server.sh DTYPE={t.value(rollout + 'dtype')}", "rollout dtype")
    else:
        for name in (
            "tensor_model_parallel_size",
            "gpu_memory_utilization",
            "data_parallel_size",
            "max_model_len",
            "dtype",
        ):
            t.mark(rollout + name, NOT_NEEDED, how=f"no vLLM: verl's {engine} rollout generates with transformers")
    _map_multi_turn(t)


def _map_multi_turn(t: Translation) -> None:
    turns = "actor_rollout_ref.rollout.multi_turn."
    config_path = t.value(turns + "tool_config_path")
    enabled = as_boolean(t.value(turns + "enable"))
    if not config_path:
        t.mark_all(turns + "*", NOT_NEEDED, how="no tools (multi_turn.tool_config_path unset)")
        return
    t.set(tool_config=str(config_path), chat_template="qwen2_5")
    located = _locate(str(config_path), t.found.source)
    how = "verl's tool YAML, read by train_dapo.py --tool_config (implies --tools code_interpreter)"
    if located is not None:
        from ..tools.verl_config import ToolConfigError, load_verl_tool_config

        try:
            settings = load_verl_tool_config(located, world_size=t.batch.world_size)
        except ToolConfigError as error:
            t.mark(turns + "tool_config_path", UNSUPPORTED, "", str(error), blocking=True)
        else:
            t.files["tool_config.yaml"] = located
            t.set(tool_config="tool_config.yaml")
            how += f"; copied into the output ({'; '.join(settings.notes)})"
    else:
        how += f"; {config_path} was not found here: put verl's file at that path (relative to where you run)"
    t.mark(turns + "tool_config_path", MAPPED, "tool_config: <that YAML>", how)
    t.mark(
        turns + "enable",
        MAPPED if enabled else APPROXIMATED,
        "(tools on)",
        "multi-turn tool calling" if enabled else "verl's multi_turn.enable is off but a tool config is set",
    )
    fmt = str(t.value(turns + "format"))
    t.record(
        turns + "format",
        MAPPED if fmt == "hermes" else APPROXIMATED,
        "chat_template: qwen2_5",
        "Hermes tool calls (<tool_call>...</tool_call>) through Qwen2.5's template; drop chat_template to keep "
        "a model's own template if it renders tool calls",
    )
    assistant = t.value(turns + "max_assistant_turns")
    user = t.value(turns + "max_user_turns")
    limits = [int(assistant) - 1] if assistant else []
    limits += [int(user)] if user else []
    rounds = max(min(limits), 0) if limits else None
    t.set(max_tool_calling_iterations=rounds)
    t.record(
        turns + "max_assistant_turns",
        MAPPED,
        recipe_line("max_tool_calling_iterations", rounds),
        "tool rounds = assistant turns - 1 (the last turn answers)" if assistant else "null: no limit",
    )
    t.mark(
        turns + "max_user_turns",
        MAPPED,
        recipe_line("max_tool_calling_iterations", rounds),
        "tool replies are verl's user turns: the tighter of the two limits",
    )
    chars = int(t.value(turns + "max_tool_response_length"))
    t.set(tool_max_output_chars=max(chars, 64))
    t.record(
        turns + "max_tool_response_length",
        MAPPED if chars >= 64 else APPROXIMATED,
        recipe_line("tool_max_output_chars", max(chars, 64)),
        "characters of a tool reply the model reads",
    )
    side = str(t.value(turns + "tool_response_truncate_side"))
    t.mark(
        turns + "tool_response_truncate_side",
        MAPPED if side == "middle" else APPROXIMATED,
        "(head and tail kept)",
        "long replies lose their middle" + ("" if side == "middle" else f"; verl cut the {side} side"),
    )
    parallel = int(t.value(turns + "max_parallel_calls"))
    t.record(
        turns + "max_parallel_calls",
        APPROXIMATED,
        "(every call of a turn runs)",
        f"verl runs at most {parallel} tool call(s) per turn; TRL runs every call the turn makes",
    )
    if t.value(turns + "interaction_config_path"):
        t.mark(
            turns + "interaction_config_path",
            UNSUPPORTED,
            "",
            "verl interactions (simulated users) are not supported",
            blocking=True,
        )


def _locate(path: str, source: str) -> Path | None:
    """A relative path of the verl run found from here or from the input's folder (and its parents)."""
    candidate = Path(os.path.expanduser(path))
    if candidate.is_absolute():
        return candidate if candidate.is_file() else None
    bases = [Path.cwd(), *Path(source).resolve().parents]
    for base in bases:
        if (base / candidate).is_file():
            return base / candidate
    return None
