"""verl's `trainer.*` keys (logging, checkpoints, validation, resuming) and the accelerate config
(`plan_accelerate`).
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from .model_data import model_size_billions
from .schedule import map_rollout_steps_to_optimizer_steps
from .translation import APPROXIMATED, MAPPED, UNSUPPORTED, Translation, as_boolean, as_list, recipe_line

REPO = Path(__file__).resolve().parent.parent.parent
ACCELERATE_TEMPLATES = REPO / "configs" / "accelerate"
# DDP keeps the whole model, its gradients and AdamW's two moments on every GPU: about 16 bytes per parameter in
# mixed precision, 48 GB at 3B before activations, the reference model and vLLM. From there on shard (ZeRO-3), as
# verl's FSDP always does.
ZERO3_MIN_BILLIONS = 3.0


def map_trainer(t: Translation) -> None:
    per_rollout = t.batch.updates_per_rollout
    loggers = [str(name) for name in as_list(t.value("trainer.logger"))]
    known = {
        "wandb": "wandb",
        "tensorboard": "tensorboard",
        "mlflow": "mlflow",
        "swanlab": "swanlab",
        "trackio": "trackio",
    }
    report_to = [known[name] for name in loggers if name in known] or ["none"]
    t.set(report_to=report_to if len(report_to) > 1 else report_to[0])
    others = [name for name in loggers if name not in known and name != "console"]
    t.record(
        "trainer.logger",
        APPROXIMATED if others else MAPPED,
        recipe_line("report_to", report_to),
        "console logging is the Trainer's own" + (f"; {others} have no counterpart" if others else ""),
    )
    project = t.value("trainer.project_name")
    experiment = t.value("trainer.experiment_name")
    t.set(run_name=str(experiment), project=str(project))
    t.record("trainer.experiment_name", MAPPED, recipe_line("run_name", experiment), "the run's name in the loggers")
    t.record(
        "trainer.project_name",
        APPROXIMATED,
        recipe_line("project", project),
        "TrainingArguments' project is used by Trackio; for wandb export WANDB_PROJECT as well",
    )
    output_dir = str(t.value("trainer.default_local_dir"))
    output_dir = output_dir.replace("${trainer.project_name}", str(project)).replace(
        "${trainer.experiment_name}", str(experiment)
    )
    t.set(output_dir=output_dir)
    t.record("trainer.default_local_dir", MAPPED, recipe_line("output_dir", output_dir), "checkpoints and the model")

    save = int(t.value("trainer.save_freq") or -1)
    if save > 0:
        map_rollout_steps_to_optimizer_steps(
            t,
            "trainer.save_freq",
            MAPPED,
            "save_steps",
            save,
            row="checkpoint every",
            how="every {span} optimizer steps",
            strategy="save",
        )
    else:
        t.set(save_strategy="no")
        t.record(
            "trainer.save_freq",
            MAPPED,
            "save_strategy: 'no'",
            "no intermediate checkpoints (train_dapo.py still saves the final model)",
        )
    has_eval = "eval_dataset_name" in t.recipe
    test = int(t.value("trainer.test_freq") or -1)
    if test > 0 and has_eval:
        map_rollout_steps_to_optimizer_steps(
            t,
            "trainer.test_freq",
            APPROXIMATED,
            "eval_steps",
            test,
            row="validation every",
            how="every {span}; verl also validates after the last step, the Trainer only on multiples of eval_steps",
            strategy="eval",
        )
    else:
        t.set(eval_strategy="no")
        t.mark(
            "trainer.test_freq",
            MAPPED if test <= 0 else APPROXIMATED,
            "eval_strategy: 'no'",
            "no periodic validation" + ("" if test <= 0 else " (no data.val_files to validate on)"),
        )
    before = as_boolean(t.value("trainer.val_before_train")) and has_eval
    t.set(val_before_train=before)
    t.record(
        "trainer.val_before_train",
        MAPPED,
        recipe_line("val_before_train", before),
        "validate once before the first step" + ("" if has_eval else " (no validation set: off)"),
    )
    if has_eval:
        # TRL's eval batch must hold whole groups: per_device_eval_batch_size x processes divisible by
        # num_generations. A multiple of num_generations (at least TRL's 8) holds for any number of processes.
        groups = t.batch.num_generations
        t.set(per_device_eval_batch_size=groups * math.ceil(8 / groups))
        t.notes.append(
            f"per_device_eval_batch_size {t.recipe['per_device_eval_batch_size']}: TRL's eval batches must hold "
            f"whole groups of num_generations={groups} on any number of processes"
        )
    t.set(logging_steps=per_rollout)
    t.step_rows.append(("metrics logged every", "rollout step", f"logging_steps = K = {per_rollout}"))
    mode = str(t.value("trainer.resume_mode"))
    if mode == "disable":
        t.mark("trainer.resume_mode", MAPPED, "(no resume)", "start from scratch")
    else:
        t.mark(
            "trainer.resume_mode",
            APPROXIMATED,
            "(resume by hand)",
            f"verl resumes {mode} from its own checkpoints; here pass --resume_from_checkpoint "
            "OUTPUT_DIR/checkpoint-N (dapo-trl checkpoints; verl's cannot be loaded)",
        )
    if t.value("trainer.resume_from_path"):
        t.mark(
            "trainer.resume_from_path",
            UNSUPPORTED,
            "",
            "verl checkpoints cannot be loaded: merge it to a "
            "Hugging Face model with verl's model merger and pass it as model_name_or_path",
        )
    generations = int(t.value("trainer.log_val_generations") or 0)
    if generations > 0:
        t.set(eval_samples_to_log=generations)
        t.mark(
            "trainer.log_val_generations",
            APPROXIMATED,
            recipe_line("eval_samples_to_log", generations),
            "validation responses of that many prompts are written to output_dir/eval_samples/*.jsonl "
            "(verl sends them to the logger)",
        )
    if as_boolean(t.value("trainer.val_only")):
        t.mark(
            "trainer.val_only", UNSUPPORTED, "", "validation-only runs: use python -m dapo_trl.evaluate", blocking=True
        )
    for key in ("trainer.rollout_data_dir", "trainer.validation_data_dir", "trainer.default_hdfs_dir"):
        if t.value(key):
            t.mark(
                key,
                UNSUPPORTED,
                "",
                "no dumps of rollouts to a folder or HDFS copies here (validation samples "
                "go to output_dir/eval_samples)",
            )


def plan_accelerate(t: Translation) -> None:
    """ZeRO-3 (with CPU offload) when verl offloads, ZeRO-3 for models of ZERO3_MIN_BILLIONS or more (or of unknown
    size: verl's FSDP shards always), else DDP; from configs/accelerate/*.yaml."""
    offload_param = as_boolean(t.value("actor_rollout_ref.actor.fsdp_config.param_offload"))
    offload_optimizer = as_boolean(t.value("actor_rollout_ref.actor.fsdp_config.optimizer_offload"))
    nnodes, world = int(t.value("trainer.nnodes")), t.batch.world_size
    size = model_size_billions(t.recipe.get("model_name_or_path"))
    if offload_param or offload_optimizer:
        template = "zero3_offload_1node_8gpu.yaml"
        offloaded = " and ".join(
            name for name, on in (("param_offload", offload_param), ("optimizer_offload", offload_optimizer)) if on
        )
        rule = f"ZeRO-3 with CPU offload: the script sets fsdp_config.{offloaded}"
        if not (offload_param and offload_optimizer):
            rule += " (the DeepSpeed config offloads both parameters and optimizer state)"
    elif size is None:
        template = "zero3_1node_8gpu.yaml"
        rule = "ZeRO-3: the model's size is not in its path, so it is sharded as verl's FSDP shards it"
    elif size >= ZERO3_MIN_BILLIONS:
        template = "zero3_1node_8gpu.yaml"
        rule = f"ZeRO-3: {size:g}B parameters (from the model path) >= {ZERO3_MIN_BILLIONS:g}B"
    else:
        template = "single_gpu.yaml"
        rule = f"DDP: {size:g}B parameters (from the model path) < {ZERO3_MIN_BILLIONS:g}B fit on every GPU"
    config = yaml.safe_load((ACCELERATE_TEMPLATES / template).read_text(encoding="utf-8"))
    if template == "single_gpu.yaml" and world > 1:
        config["distributed_type"] = "MULTI_GPU"
    config["num_machines"] = nnodes
    config["num_processes"] = world
    t.accelerate = config
    t.accelerate_rule = f"{rule} (template configs/accelerate/{template})"
    for key in (
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    ):
        t.mark(key, MAPPED, f"accelerate.yaml distributed_type: {config['distributed_type']}", rule)
    t.mark(
        "actor_rollout_ref.actor.strategy",
        MAPPED,
        f"accelerate.yaml distributed_type: {config['distributed_type']}",
        rule,
    )
