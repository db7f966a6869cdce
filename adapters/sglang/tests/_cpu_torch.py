"""Test-only: let the registry's CUDA build of torchvision import next to the CPU build of torch.

SGLang's ``disaggregation.utils`` imports its model configs, which import ``torchvision.transforms``. The
registry's torchvision wheel is built against CUDA torch; with CPU torch its C extension does not load and
its import fails while registering fake kernels for two operators it never defined. Declaring their
schemas first lets the pure-Python part import (nothing here runs a torchvision operator). A real SGLang
deployment has CUDA torch and needs none of this.
"""

from __future__ import annotations


def allow_cpu_torchvision() -> None:
    import torch

    for op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:     # already defined (the extension loaded, or called twice)
            pass
