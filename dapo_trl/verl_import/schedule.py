"""The learning-rate schedule and the run's length: verl counts them in rollout steps, TRL in optimizer steps (x K).
`map_rollout_steps_to_optimizer_steps` maps any such count (also the checkpoint and validation frequencies).
"""

from __future__ import annotations

from .translation import APPROXIMATED, MAPPED, NOT_NEEDED, UNSUPPORTED, Translation, recipe_line


def map_rollout_steps_to_optimizer_steps(
    t: Translation,
    key: str,
    status: str,
    field: str,
    rollout_steps: int,
    *,
    row: str,
    how: str,
    strategy: str | None = None,
) -> int:
    """verl's `key`, a count of N rollout steps, becomes the DAPOConfig `field` in optimizer steps, N x K (K optimizer
    steps per rollout step): set `field` (and `<strategy>_strategy: steps`), record the key, with `how` where its
    "{span}" reads "N rollout steps x K=K", and add the step row `row`. N = 0 leaves `field` at its default and adds
    no row. Returns N x K."""
    per_rollout = t.batch.updates_per_rollout
    steps = rollout_steps * per_rollout
    target = recipe_line(field, steps)
    if strategy is not None:
        target = f"{strategy}_strategy: steps, {target}"
    t.record(key, status, target, how.format(span=f"{rollout_steps} rollout steps x K={per_rollout}"))
    if steps:
        if strategy is not None:
            t.set(**{f"{strategy}_strategy": "steps"})
        t.set(**{field: steps})
        t.step_rows.append(
            (
                row,
                f"{key.rsplit('.', 1)[-1]} = {rollout_steps} rollout steps",
                f"{field} = {rollout_steps} x {per_rollout} = {steps}",
            )
        )
    return steps


def map_schedule(t: Translation) -> None:
    """Learning-rate schedule and run length; verl counts them in rollout steps, TRL in optimizer steps (x K)."""
    optim = "actor_rollout_ref.actor.optim."
    style_key, style = t.first(optim + "warmup_style")
    scheduler = style if style is not None else t.value(optim + "lr_scheduler_type")
    scheduler_key = style_key if style is not None else optim + "lr_scheduler_type"
    warmup_steps = int(t.value(optim + "lr_warmup_steps"))
    ratio = float(t.value(optim + "lr_warmup_steps_ratio") or 0.0)
    if warmup_steps >= 0:
        warmup: float = map_rollout_steps_to_optimizer_steps(
            t,
            optim + "lr_warmup_steps",
            APPROXIMATED,
            "warmup_steps",
            warmup_steps,
            row="LR warm-up",
            how="{span} optimizer steps; verl raises the LR once per rollout step (a staircase), TRL every "
            "optimizer step (a ramp over the same span)",
        )
        t.mark(optim + "lr_warmup_steps_ratio", NOT_NEEDED, how="lr_warmup_steps is set and wins, as in verl")
    else:
        warmup = ratio
        if ratio:
            t.set(warmup_steps=ratio)
        t.mark(optim + "lr_warmup_steps", NOT_NEEDED, how="-1: the ratio applies")
        t.mark(
            optim + "lr_warmup_steps_ratio",
            MAPPED if ratio == 0 else APPROXIMATED,
            recipe_line("warmup_steps", ratio),
            "a warmup_steps below 1 is a share of the run's steps, so the same share of the run",
        )
    if scheduler == "constant":
        t.set(lr_scheduler_type="constant_with_warmup" if warmup else "constant")
        t.record(
            scheduler_key,
            MAPPED,
            recipe_line("lr_scheduler_type", t.recipe["lr_scheduler_type"]),
            "constant after the warm-up",
        )
        t.mark(optim + "min_lr_ratio", NOT_NEEDED, how="cosine schedule only")
        t.mark(optim + "num_cycles", NOT_NEEDED, how="cosine schedule only")
    elif scheduler == "cosine":
        minimum = float(t.value(optim + "min_lr_ratio") or 0.0)
        cycles = float(t.value(optim + "num_cycles"))
        kwargs: dict[str, float] = {} if cycles == 0.5 else {"num_cycles": cycles}
        if minimum > 0:
            t.set(lr_scheduler_type="cosine_with_min_lr")
            kwargs["min_lr_rate"] = minimum
        else:
            t.set(lr_scheduler_type="cosine")
        if kwargs:
            t.set(lr_scheduler_kwargs=kwargs)
        t.record(
            scheduler_key,
            APPROXIMATED,
            recipe_line("lr_scheduler_type", t.recipe["lr_scheduler_type"]),
            "the same cosine over the run, decayed per optimizer step instead of per rollout step",
        )
        t.mark(optim + "min_lr_ratio", MAPPED, recipe_line("lr_scheduler_kwargs.min_lr_rate", minimum), "LR floor")
        t.mark(optim + "num_cycles", MAPPED, recipe_line("lr_scheduler_kwargs.num_cycles", cycles), "cosine waves")
    else:
        t.record(
            scheduler_key,
            UNSUPPORTED,
            "",
            f"LR schedule {scheduler!r}: verl's FSDP actor has constant and cosine only",
            blocking=True,
        )
    if style is None:
        t.mark(style_key, NOT_NEEDED, how="null: lr_scheduler_type applies")
    betas = t.value(optim + "betas")
    if t.given(optim + "betas") and isinstance(betas, list) and len(betas) == 2:
        t.set(adam_beta1=float(betas[0]), adam_beta2=float(betas[1]))
        t.mark(optim + "betas", MAPPED, f"adam_beta1: {betas[0]}, adam_beta2: {betas[1]}", "AdamW betas")

    total = t.value("trainer.total_training_steps")
    epochs = t.value("trainer.total_epochs")
    if total is not None and int(total) > 0:
        map_rollout_steps_to_optimizer_steps(
            t, "trainer.total_training_steps", MAPPED, "max_steps", int(total), row="run length", how="{span}"
        )
        t.mark("trainer.total_epochs", NOT_NEEDED, how="total_training_steps is set and wins, as in verl")
    else:
        t.set(num_train_epochs=float(epochs))
        dedup = ""
        if str(t.recipe.get("dataset_name", "")).startswith("dapo-math-17k"):
            dedup = (
                " verl reads the data file as it is (the hub copy of DAPO-Math-17k repeats every problem about 100 "
                "times), dapo-trl drops repeated prompts, so one verl epoch there is about 100 epochs here."
            )
        t.record(
            "trainer.total_epochs",
            APPROXIMATED,
            recipe_line("num_train_epochs", epochs),
            "passes over the training prompts, counted by the Trainer in optimizer steps; with dynamic "
            "sampling verl's epoch also counts the prompts drawn for extra rounds, which here come from a "
            "separate stream." + dedup + " Set --max_steps (rollout steps x K) for the length you want.",
        )
        t.mark("trainer.total_training_steps", NOT_NEEDED, how="unset: total_epochs sets the length")
