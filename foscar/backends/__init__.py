"""Launchers: validate kernel-specific constraints, allocate/cache workspaces, compute grids."""

import contextlib

import torch


def on_device(device: torch.device):
    """Triton launches on the current CUDA device's stream: make it ``device`` for the launch
    (a no-op when it already is, or off CUDA)."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
