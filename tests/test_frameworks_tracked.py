"""Framework objects wherever a checkpoint meets them: a torch module, optimizer, LR
scheduler or GradScaler and a registered JAX pytree node held by a ``cv.Module`` or
tracked by a ``cv.Trackable`` are saved and restored as ``cv.Checkpoint`` saves its own
arguments; tied torch weights stay tied through a restore onto the meta device."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptvar as cv

torch = pytest.importorskip("torch", reason="PyTorch is not installed (the test extra has it)")


class TiedLM(torch.nn.Module):  # type: ignore[misc]
    """An embedding and an output head sharing one weight (as GPT-2's lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.body = torch.nn.Linear(4, 4)
        self.lm_head = torch.nn.Linear(4, 6, bias=False)
        self.lm_head.weight = self.embed.weight


def test_tied_weights_stay_tied_on_a_meta_restore(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    path = cv.Checkpoint(model=model).save(tmp_path / "ckpt")
    with torch.device("meta"):
        lazy = TiedLM()
    assert lazy.lm_head.weight is lazy.embed.weight
    cv.Checkpoint(model=lazy).restore(path).assert_consumed()
    assert not lazy.embed.weight.is_meta
    assert lazy.lm_head.weight is lazy.embed.weight  # one parameter, as before the save
    assert torch.equal(lazy.embed.weight, model.embed.weight)
    assert torch.equal(lazy.body.weight, model.body.weight)
    with torch.no_grad():
        lazy.embed.weight[0, 0] = 42.0
    assert lazy.lm_head.weight[0, 0].item() == 42.0
