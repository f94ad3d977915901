"""Dynamic sampling's fresh prompts: an endless, seeded, resumable stream over a map-style or an iterable train set.

Every process builds the same stream from the same seed and draws the same prompts, so all processes agree on the
extra rounds' prompts without communicating (the sampler gathers rows from all processes and slices them by position).
Each stream's position is a small `state_dict()`, saved with checkpoints, from which it continues exactly.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import torch

# Keeps the streams' permutations apart from the dataloader's (both start from `args.seed`).
STREAM_SEED_OFFSET = 7919


class PromptStream:
    """Dataset indices of a map-style dataset: one fresh permutation per pass over the data.

    Its position is two integers.
    """

    def __init__(self, dataset_size: int, seed: int, shuffle: bool = True):
        if dataset_size < 1:
            raise ValueError("dynamic sampling needs a non-empty train_dataset to draw fresh prompts from")
        self.dataset_size = dataset_size
        self.seed = seed
        self.shuffle = shuffle
        self.pass_index = 0
        self.offset = 0
        self._order = self._permutation(0)

    def _permutation(self, pass_index: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator().manual_seed(self.seed + STREAM_SEED_OFFSET * (pass_index + 1))
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def draw(self, count: int) -> list[int]:
        """The next `count` indices, continuing into a new permutation when a pass ends."""
        indices = []
        while len(indices) < count:
            if self.offset == self.dataset_size:
                self.pass_index += 1
                self.offset = 0
                self._order = self._permutation(self.pass_index)
            take = min(count - len(indices), self.dataset_size - self.offset)
            indices.extend(self._order[self.offset : self.offset + take])
            self.offset += take
        return indices

    def state_dict(self) -> dict[str, int]:
        return {"pass_index": self.pass_index, "offset": self.offset, "dataset_size": self.dataset_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("dataset_size") != self.dataset_size:
            raise ValueError(
                f"checkpoint's prompt stream covers {state.get('dataset_size', 'an iterable')} prompts, the "
                f"train_dataset has {self.dataset_size}: resume with the same dataset (and max_prompt_length filter)."
            )
        self.pass_index, self.offset = state["pass_index"], state["offset"]
        self._order = self._permutation(self.pass_index)


class IterablePromptStream:
    """Rows of a `datasets.IterableDataset`, read pass after pass: shards in a seeded order, rows through a seeded
    shuffle buffer of `buffer_size` rows; every row once per pass.

    `IterableDataset.shuffle` is not used for this: its `state_dict()` drops the buffer's content and restarts its
    random generator, so a resumed run would skip some prompts, repeat others and draw a different order. Here the
    position is exact: the shard order's pass, the current shard's own `state_dict()` (exact for an unshuffled
    stream), the buffered rows and the random generator's state. Without `shuffle`, rows come in stream order.
    """

    def __init__(self, dataset: Any, seed: int, buffer_size: int = 1000, shuffle: bool = True):
        if buffer_size < 1:
            raise ValueError(f"the prompt stream's buffer_size={buffer_size} must be >= 1")
        self.dataset = dataset
        self.seed = seed
        self.buffer_size = buffer_size if shuffle else 1
        self.shuffle = shuffle
        self.num_shards = getattr(dataset, "num_shards", 1) if hasattr(dataset, "shard") else 1
        self.rng = random.Random(seed + STREAM_SEED_OFFSET)
        self.pass_index, self.shard_cursor, self.buffer = 0, 0, []
        self._open(shard_state=None)

    def _shard_order(self, pass_index: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_shards))
        generator = torch.Generator().manual_seed(self.seed + STREAM_SEED_OFFSET * (pass_index + 1))
        return torch.randperm(self.num_shards, generator=generator).tolist()

    def _open(self, shard_state: dict | None) -> None:
        """Start reading the shard at `shard_cursor` of this pass's order (None past the last shard)."""
        if self.shard_cursor >= self.num_shards:
            self._shard, self._rows = None, iter(())
            return
        index = self._shard_order(self.pass_index)[self.shard_cursor]
        # A fresh dataset object per shard and pass: a loaded state_dict sticks to the object it was loaded into.
        sharded = hasattr(self.dataset, "shard")
        self._shard = self.dataset.shard(self.num_shards, index) if sharded else copy.deepcopy(self.dataset)
        if shard_state is not None:
            self._shard.load_state_dict(shard_state)
        self._rows = iter(self._shard)

    def _next_source_row(self) -> dict | None:
        """The next row of this pass from the source, or None once every shard of the pass is read."""
        while self._shard is not None:
            row = next(self._rows, None)
            if row is not None:
                return row
            self.shard_cursor += 1
            self._open(shard_state=None)
        return None

    def _fill(self) -> None:
        while len(self.buffer) < self.buffer_size:
            row = self._next_source_row()
            if row is None:
                return
            self.buffer.append(row)

    def draw(self, count: int) -> list[dict]:
        """The next `count` rows, continuing into a new pass (a new shard order) when one ends."""
        rows: list[dict] = []
        empty_passes = 0
        while len(rows) < count:
            self._fill()
            if not self.buffer:
                empty_passes += 1
                if empty_passes > 1:
                    raise ValueError("dynamic sampling needs a non-empty train_dataset to draw fresh prompts from")
                self.pass_index, self.shard_cursor = self.pass_index + 1, 0
                self._open(shard_state=None)
                continue
            empty_passes = 0
            index = self.rng.randrange(len(self.buffer)) if self.shuffle else 0
            self.buffer[index], self.buffer[-1] = self.buffer[-1], self.buffer[index]
            rows.append(self.buffer.pop())
        return rows

    def state_dict(self) -> dict[str, Any]:
        shard_state = self._shard.state_dict() if self._shard is not None else None
        return {
            "iterable": True,
            "pass_index": self.pass_index,
            "shard_cursor": self.shard_cursor,
            "shard_state": shard_state,
            "buffer": list(self.buffer),
            "rng": self.rng.getstate(),
            "num_shards": self.num_shards,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state.get("iterable") or state["num_shards"] != self.num_shards:
            raise ValueError(
                "checkpoint's prompt stream is not from an IterableDataset with "
                f"{self.num_shards} shards: resume with the same train_dataset."
            )
        self.pass_index, self.shard_cursor = state["pass_index"], state["shard_cursor"]
        self.buffer = list(state["buffer"])
        self.rng.setstate(state["rng"])
        self._open(shard_state=state["shard_state"])


class WholeStream(torch.utils.data.IterableDataset):
    """A `datasets.IterableDataset` as a plain torch one, so that accelerate gives every process the whole stream and
    keeps for each its contiguous slice of every global batch (`IterableDatasetShard`).

    GRPOTrainer bakes the group layout into the stream (`repeat_iterable_dataset`: each prompt repeated
    num_generations times, each generation batch `steps_per_generation` times) and relies on that slicing. But
    accelerate splits a `datasets.IterableDataset` with at least as many shards as processes by shard instead, each
    process repeating its own prompts: a group that straddles two processes then holds two prompts, and with
    steps_per_generation > 1 some prompts are trained twice and others never. `set_epoch` still reaches the stream.
    """

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __iter__(self):
        return iter(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)


def whole_stream(dataset: Any, num_processes: int) -> Any:
    """`WholeStream(dataset)` for a `datasets.IterableDataset` read by several processes; else the dataset itself."""
    from datasets import IterableDataset

    return WholeStream(dataset) if num_processes > 1 and isinstance(dataset, IterableDataset) else dataset


def trainable_prompts(trainer: Any, dataset: Any) -> Any:
    """The train set without prompts longer than max_prompt_length (`overlong_prompt_policy`: dropped and counted,
    or an error), measured as TRL renders them (chat template, its kwargs, tools); agreed by every process."""
    args = trainer.args
    if args.max_prompt_length is None or dataset is None:
        return dataset
    from accelerate.utils import gather_object

    from ...data import filter_overlong_prompts

    return filter_overlong_prompts(
        dataset,
        trainer.processing_class,
        args.max_prompt_length,
        policy=args.overlong_prompt_policy,
        chat_template_kwargs=trainer.chat_template_kwargs,
        tools=trainer.tools or None,
        chat_template=trainer.chat_template,
        gather=gather_object if trainer.accelerator.num_processes > 1 else None,
    )
