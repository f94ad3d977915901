"""verl's batch sizes as TRL's batch layout: `plan_batches` (the arithmetic) and `map_batches` (the keys)."""

from __future__ import annotations

import math

from .plans import BatchPlan
from .translation import APPROXIMATED, MAPPED, NOT_NEEDED, UNSUPPORTED, Translation, as_boolean, recipe_line


def _largest_divisor_at_most(number: int, limit: int) -> int:
    return max(d for d in range(1, min(number, max(1, limit)) + 1) if number % d == 0)


def plan_batches(
    *,
    train_batch_size: int,
    num_generations: int,
    ppo_mini_batch_size: int,
    world_size: int,
    ppo_epochs: int = 1,
    micro_batch_per_gpu: int | None = None,
    use_dynamic_bsz: bool = False,
    max_token_len_per_gpu: int | None = None,
    gen_batch_size: int | None = None,
    sequence_parallel_size: int = 1,
) -> BatchPlan:
    """TRL's batch layout for verl's sizes.

    verl: `train_batch_size` prompts per rollout step, each with n = `rollout.n` responses; `ppo_mini_batch_size`
    prompts (x n responses) per optimizer update; `ppo_micro_batch_size_per_gpu` responses per forward (or, with
    `use_dynamic_bsz`, forwards of at most `ppo_max_token_len_per_gpu` tokens); `ppo_epochs` passes.
    TRL, with W = world size: responses per update = per_device_train_batch_size x W x gradient_accumulation_steps
    = mini x n; responses per rollout step = per_device_train_batch_size x W x steps_per_generation = train x n;
    so steps_per_generation = train / mini x gradient_accumulation_steps, and num_iterations = ppo_epochs.
    Each process takes mini x n / W responses per update: in micro-batches of `ppo_micro_batch_size_per_gpu`
    (gradient accumulation over them), or, with `use_dynamic_bsz`, all at once with
    `max_tokens_per_microbatch = ppo_max_token_len_per_gpu` splitting them into token-bounded forwards.
    With Ulysses (sp > 1) a verl micro-batch is what one group of sp GPUs runs together, and a group here runs the
    micro-batches of its sp processes together: per_device_train_batch_size = ppo_micro_batch_size_per_gpu / sp (the
    token budget is already per GPU on both sides: a group's forward holds sp x it).
    """
    notes: list[str] = []
    errors: list[str] = []
    n, world = num_generations, world_size
    mini = ppo_mini_batch_size
    if train_batch_size % mini:
        mini_used = _largest_divisor_at_most(train_batch_size, mini)
        notes.append(
            f"train_batch_size {train_batch_size} is not a multiple of ppo_mini_batch_size {mini} (verl's last "
            f"mini-batch is smaller); used {mini_used} prompts per update, the largest divisor below"
        )
        mini = mini_used
    per_update = mini * n
    if per_update % world:
        why = (
            "verl refuses such a layout too"
            if sequence_parallel_size == 1
            else f"verl's Ulysses groups need only {world // sequence_parallel_size} equal shares, but here every "
            "process holds its own rows"
        )
        errors.append(
            f"responses per update ppo_mini_batch_size x n = {mini} x {n} = {per_update} is not divisible by the "
            f"world size {world} ({why})"
        )
        per_process = max(1, round(per_update / world))
    else:
        per_process = per_update // world
    if use_dynamic_bsz:
        micro, accumulation, budget = per_process, 1, max_token_len_per_gpu
    else:
        budget = None
        if micro_batch_per_gpu is None:
            micro = per_process
            notes.append(
                "no ppo_micro_batch_size_per_gpu (verl requires one without use_dynamic_bsz): one forward "
                "of all the process's responses per update"
            )
        else:
            wanted = max(1, micro_batch_per_gpu // sequence_parallel_size)
            micro = _largest_divisor_at_most(per_process, wanted)
            if micro * sequence_parallel_size != micro_batch_per_gpu:
                sp = sequence_parallel_size
                group = f" ({micro} x sp {sp} per Ulysses group)" if sp > 1 else ""
                notes.append(
                    f"micro-batch {micro} responses per process{group} instead of {micro_batch_per_gpu}: each "
                    f"process takes {per_process} responses per update, and the micro-batch must divide them"
                )
        accumulation = per_process // micro
    updates = train_batch_size // mini
    oversample = 1
    if gen_batch_size is not None and gen_batch_size != train_batch_size:
        ratio = gen_batch_size / train_batch_size
        oversample = max(1, math.ceil(ratio))
        if oversample != ratio:
            notes.append(
                f"gen_batch_size / train_batch_size = {gen_batch_size} / {train_batch_size} = {ratio:g} is not an "
                f"integer: each dynamic-sampling round generates {oversample} generation batches"
            )
    return BatchPlan(
        world_size=world,
        num_generations=n,
        train_batch_size=train_batch_size,
        ppo_mini_batch_size=mini,
        ppo_epochs=ppo_epochs,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=updates * accumulation,
        max_tokens_per_microbatch=budget,
        filter_groups_oversample=oversample,
        notes=tuple(notes),
        errors=tuple(errors),
    )


def map_batches(t: Translation) -> BatchPlan:
    actor = "actor_rollout_ref.actor."
    nnodes, gpus = int(t.value("trainer.nnodes")), int(t.value("trainer.n_gpus_per_node"))
    world = nnodes * gpus
    n = int(t.value("actor_rollout_ref.rollout.n"))
    train = int(t.value("data.train_batch_size"))
    mini = int(t.value(actor + "ppo_mini_batch_size"))
    epochs = int(t.value(actor + "ppo_epochs"))
    dynamic = as_boolean(t.value(actor + "use_dynamic_bsz"))
    budget = int(t.value(actor + "ppo_max_token_len_per_gpu"))
    sequence_parallel = int(t.value(actor + "ulysses_sequence_parallel_size") or 1)
    micro = t.value(actor + "ppo_micro_batch_size_per_gpu")
    micro_key = actor + "ppo_micro_batch_size_per_gpu"
    if micro is None and t.value(actor + "ppo_micro_batch_size") is not None:  # deprecated global micro-batch
        micro_key = actor + "ppo_micro_batch_size"
        micro = max(1, int(t.value(micro_key)) // max(1, world // sequence_parallel))
    gen_key, gen = t.first("data.gen_batch_size")
    plan = plan_batches(
        train_batch_size=train,
        num_generations=n,
        ppo_mini_batch_size=mini,
        world_size=world,
        ppo_epochs=epochs,
        micro_batch_per_gpu=None if micro is None else int(micro),
        use_dynamic_bsz=dynamic,
        max_token_len_per_gpu=budget,
        gen_batch_size=None if gen is None else int(gen),
        sequence_parallel_size=sequence_parallel,
    )
    t.batch = plan
    t.set(
        num_generations=n,
        per_device_train_batch_size=plan.per_device_train_batch_size,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
        steps_per_generation=plan.steps_per_generation,
        num_iterations=epochs,
    )
    if plan.max_tokens_per_microbatch is not None:
        t.set(max_tokens_per_microbatch=plan.max_tokens_per_microbatch)
    layout = (
        f"per_device_train_batch_size: {plan.per_device_train_batch_size}, gradient_accumulation_steps: "
        f"{plan.gradient_accumulation_steps}, steps_per_generation: {plan.steps_per_generation}"
    )
    status = APPROXIMATED if plan.notes else MAPPED
    notes = "; ".join(plan.notes)
    how_rollout = (
        f"responses per rollout step {train} x {n} = {train * n} = {plan.per_device_train_batch_size} x {world} "
        f"processes x {plan.steps_per_generation} steps_per_generation"
    )
    how_update = (
        f"responses per optimizer update {plan.ppo_mini_batch_size} x {n} = {plan.ppo_mini_batch_size * n} = "
        f"{plan.per_device_train_batch_size} x {world} x {plan.gradient_accumulation_steps} accumulation steps"
    )
    blocking = bool(plan.errors)
    t.record("data.train_batch_size", status, layout, how_rollout + (f"; {notes}" if notes else ""), blocking)
    t.record(actor + "ppo_mini_batch_size", status, layout, how_update + "; ".join(["", *plan.errors]), blocking)
    if n >= 2:
        t.record("actor_rollout_ref.rollout.n", MAPPED, recipe_line("num_generations", n), "responses per prompt")
    else:
        t.record(
            "actor_rollout_ref.rollout.n", UNSUPPORTED, "", "GRPO needs at least 2 responses per prompt", blocking=True
        )
    t.record(actor + "ppo_epochs", MAPPED, recipe_line("num_iterations", epochs), "passes over each generation batch")
    t.mark("trainer.nnodes", MAPPED, f"accelerate.yaml num_machines: {nnodes}", f"world size {world}")
    t.mark("trainer.n_gpus_per_node", MAPPED, f"accelerate.yaml num_processes: {world}", f"{nnodes} x {gpus}")
    if dynamic:
        t.mark(
            actor + "use_dynamic_bsz",
            MAPPED,
            recipe_line("max_tokens_per_microbatch", budget),
            "token-bounded forwards: each process's share of an update is split into forwards of at most "
            "ppo_max_token_len_per_gpu real tokens",
        )
        t.mark(
            actor + "ppo_max_token_len_per_gpu",
            MAPPED,
            recipe_line("max_tokens_per_microbatch", budget),
            "real tokens per forward and process"
            + (
                f" (as verl's len x sp: a Ulysses group of {sequence_parallel} processes runs forwards of up to "
                f"{sequence_parallel} x {budget} tokens, each process holding about {budget})"
                if sequence_parallel > 1
                else ""
            ),
        )
        for key in (actor + "ppo_micro_batch_size_per_gpu", actor + "ppo_micro_batch_size"):
            t.mark(key, NOT_NEEDED, how="use_dynamic_bsz=True sizes forwards by tokens instead")
    else:
        t.mark(actor + "use_dynamic_bsz", MAPPED, "max_tokens_per_microbatch: unset", "fixed-size micro-batches")
        other = actor + ("ppo_micro_batch_size" if micro_key.endswith("_per_gpu") else "ppo_micro_batch_size_per_gpu")
        t.mark(other, NOT_NEEDED, how=f"{micro_key.rsplit('.', 1)[-1]} sets the micro-batch")
        t.mark(
            micro_key,
            status,
            recipe_line("per_device_train_batch_size", plan.per_device_train_batch_size),
            "responses per forward and process" + (f"; {notes}" if notes else ""),
        )
    map_sequence_parallel(t, sequence_parallel, world)
    t.step_rows += [
        ("world size", f"nnodes x n_gpus_per_node = {nnodes} x {gpus}", f"{world} processes"),
        (
            "responses per rollout step",
            f"train_batch_size x n = {train} x {n} = {train * n}",
            f"per_device_train_batch_size x W x steps_per_generation = {plan.per_device_train_batch_size} x {world} x "
            f"{plan.steps_per_generation} = {plan.responses_per_rollout}",
        ),
        (
            "responses per optimizer update",
            f"ppo_mini_batch_size x n = {plan.ppo_mini_batch_size} x {n} = {plan.ppo_mini_batch_size * n}",
            f"per_device_train_batch_size x W x gradient_accumulation_steps = {plan.per_device_train_batch_size} x "
            f"{world} x {plan.gradient_accumulation_steps} = {plan.responses_per_update}",
        ),
        (
            "optimizer steps per rollout step (K)",
            f"train_batch_size / ppo_mini_batch_size x ppo_epochs = {train} / {plan.ppo_mini_batch_size} x {epochs}",
            f"steps_per_generation / gradient_accumulation_steps x num_iterations = {plan.steps_per_generation} / "
            f"{plan.gradient_accumulation_steps} x {epochs} = {plan.updates_per_rollout}",
        ),
    ]
    if plan.per_device_train_batch_size * world % n:
        t.notes.append(
            f"per_device_train_batch_size x world size = {plan.per_device_train_batch_size * world} is not a "
            f"multiple of num_generations {n}: a group may span two micro-batches (allowed: the generation batch "
            "holds whole groups, and advantages are computed before the split)"
        )
    return plan


def map_sequence_parallel(t: Translation, size: int, world: int) -> None:
    """verl's Ulysses size (actor; the reference's runs in the same groups here) as `sequence_parallel_size`."""
    actor, ref = "actor_rollout_ref.actor.", "actor_rollout_ref.ref."
    ref_value = t.value(ref + "ulysses_sequence_parallel_size")
    if size == 1:
        t.mark(actor + "ulysses_sequence_parallel_size", NOT_NEEDED, how="1: no sequence parallelism")
    elif world % size:
        t.mark(
            actor + "ulysses_sequence_parallel_size",
            UNSUPPORTED,
            "",
            f"{size} does not divide the world size {world} (verl refuses it too)",
            blocking=True,
        )
    else:
        t.set(sequence_parallel_size=size)
        t.mark(
            actor + "ulysses_sequence_parallel_size",
            MAPPED,
            recipe_line("sequence_parallel_size", size),
            f"Ulysses over groups of {size} processes: every training forward (policy, old and reference "
            "log-probs) is sharded across its group with DeepSpeed's Ulysses attention; the model's query heads "
            f"must be divisible by {size} (checked at start, with the valid sizes listed)",
        )
    if ref_value is not None:
        ref_size = int(ref_value)
        how = "the reference model's forwards run in the policy's sequence-parallel groups"
        if ref_size != size:
            how += f" (sequence_parallel_size {size}, not {ref_size}: the same log-probs, split differently)"
        status = MAPPED if ref_size == size else APPROXIMATED
        t.mark(ref + "ulysses_sequence_parallel_size", status, recipe_line("sequence_parallel_size", size), how)
