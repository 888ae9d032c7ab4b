"""Model factories written to files, as ``automap plan`` and ``automap
estimate`` take them (``<python-file>:<factory>``)."""

from __future__ import annotations

from pathlib import Path

#: A two-layer MLP of width 64 and a batch of 4 on the CPU.
MLP_FACTORY = ("import torch\n"
               "def build():\n"
               "    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),\n"
               "                                torch.nn.Linear(64, 8))\n"
               "    return model, (torch.randn(4, 64),)\n")


def mlp_factory(folder: Path) -> str:
    """The MLP factory written into ``folder``, as the CLI's ``target``."""
    path = folder / "factory.py"
    path.write_text(MLP_FACTORY)
    return f"{path}:build"
