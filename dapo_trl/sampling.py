"""The trainer's own prompt stream for dynamic sampling's extra rounds (never the Trainer's dataloader)."""

from __future__ import annotations

import torch

# Keeps the stream's permutations apart from the dataloader's (both start from `args.seed`).
_STREAM_SEED_OFFSET = 7919


class PromptStream:
    """An endless, seeded stream of dataset indices: one fresh permutation per pass over the data.

    Every process builds the same stream from the same seed and draws the same indices, so all processes agree
    on the extra rounds' prompts without communicating. Its position is two integers, saved with checkpoints.
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
        generator = torch.Generator().manual_seed(self.seed + _STREAM_SEED_OFFSET * (pass_index + 1))
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

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["dataset_size"] != self.dataset_size:
            raise ValueError(
                f"checkpoint's prompt stream covers {state['dataset_size']} prompts, the train_dataset has "
                f"{self.dataset_size}: resume with the same dataset (and max_prompt_length filter)."
            )
        self.pass_index, self.offset = state["pass_index"], state["offset"]
        self._order = self._permutation(self.pass_index)
