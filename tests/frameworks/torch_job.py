"""An unmodified PyTorch job on the volume: ``save N`` or ``load`` on one node.

Run as a subprocess, so that each action starts from a fresh interpreter the way a
restarted training job does. ``save N`` trains a small model for N steps and, after each
step, writes the step's checkpoint twice, as PyTorch users do: a ``torch.save`` file and a
``torch.distributed.checkpoint`` (DCP) directory. ``load`` finds the newest step on the
volume, loads both checkpoints into fresh objects and compares every tensor with the same
training recomputed here. Prints one JSON line.

Training is deterministic (fixed seed, fixed inputs, one CPU thread), so the expected
values of step N are the values after N optimizer steps, recomputed by whoever checks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

ROOT = "checkpoints"  # under the mountpoint: <ROOT>/step-<N>/{model.pt,dcp/}


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer at step 0: about 0.5 M parameters, 6 MiB with Adam's state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.LayerNorm(256))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 256, generator=gen), torch.randn(32, 256, generator=gen)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def trained(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer = build()
    for step in range(1, steps + 1):
        train_step(model, optimizer, step)
    return model, optimizer


class AppState(Stateful):
    """The wrapper the DCP tutorial recommends: DCP calls it to save and to load in place."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


def step_dir(mnt: Path, step: int) -> Path:
    return mnt / ROOT / f"step-{step}"


def save(mnt: Path, steps: int) -> dict:
    model, optimizer = build()
    for step in range(1, steps + 1):
        train_step(model, optimizer, step)
        out = step_dir(mnt, step)
        out.mkdir(parents=True)
        # torch.save opens the file, writes the archive and closes it: tierfs's default
        # ``file:*.pt`` rule commits the file on that close, as step <N> (the last number
        # in its path).
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, out / "model.pt")
        # DCP writes its data files, then ``.metadata.tmp``, and renames that to
        # ``.metadata`` last: the ``marker:.metadata`` rule commits the directory on the
        # rename, into the same step (a second root of step <N>).
        dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=out / "dcp")
    return {"saved": list(range(1, steps + 1))}


def same(a: Any, b: Any) -> tuple[bool, int]:
    """Whether two state trees are equal, tensors compared exactly; and how many tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return ok, 1
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return False, 0
        results = [same(a[k], b[k]) for k in a]
        return all(r[0] for r in results), sum(r[1] for r in results)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return False, 0
        results = [same(x, y) for x, y in zip(a, b, strict=True)]
        return all(r[0] for r in results), sum(r[1] for r in results)
    return a == b, 0


def load(mnt: Path) -> dict:
    steps = sorted(int(p.name.removeprefix("step-")) for p in (mnt / ROOT).glob("step-*"))
    step = steps[-1]
    expected_model, expected_optim = trained(step)
    expected = {"model": expected_model.state_dict(), "optim": expected_optim.state_dict()}

    pt = torch.load(step_dir(mnt, step) / "model.pt", weights_only=True)
    pt_equal, pt_tensors = same({"model": pt["model"], "optim": pt["optim"]}, expected)

    # Fresh objects whose values differ from the expected ones until DCP loads into them.
    model, optimizer = build()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-1.0)
    dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=step_dir(mnt, step) / "dcp")
    loaded = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp_equal, dcp_tensors = same(loaded, expected)
    return {
        "steps": steps,
        "step": step,
        "pt_step": pt["step"],
        "pt_equal": pt_equal,
        "pt_tensors": pt_tensors,
        "dcp_equal": dcp_equal,
        "dcp_tensors": dcp_tensors,
    }


def main() -> None:
    torch.set_num_threads(1)  # one thread: bit-identical training in every process
    mnt, action = Path(sys.argv[1]), sys.argv[2]
    out = save(mnt, int(sys.argv[3])) if action == "save" else load(mnt)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
