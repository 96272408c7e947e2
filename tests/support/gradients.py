"""The gradients an engine's optimizer step took. `TrainLoop.train_mini_batch` frees them once it stepped (they live
in the update only), so a test that compares them records them as the step begins."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import torch


@contextlib.contextmanager
def gradients_at_step(optimizer: torch.optim.Optimizer, params: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                      keep: Callable[[torch.Tensor], torch.Tensor] = lambda g: g.detach().clone()
                      ) -> Iterator[dict[str, torch.Tensor]]:
    """A dict that holds `keep(p.grad)` of each of `params()` (None where a parameter has none) as `optimizer`'s
    next step begins; its step pre-hook is removed on leaving, even on failure."""
    got: dict[str, torch.Tensor] = {}

    def record(*_: object) -> None:
        got.update({n: None if p.grad is None else keep(p.grad) for n, p in params()})

    handle = optimizer.register_step_pre_hook(record)
    try:
        yield got
    finally:
        handle.remove()
