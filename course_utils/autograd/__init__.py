"""Autograd for the course's kernels (chapter 11): each op a ``torch.autograd.Function`` whose
forward and backward are Triton kernels of the course, so that a model can train through them.

- :mod:`.elementwise`: bias + GELU (+ dropout: the keep mask is regenerated in backward from the seed)
- :mod:`.registry`: the ops a model uses (``layer_norm``, ``linear_gelu``, ``attention``, ...), one
  set from torch and one from the course, so that the same model runs on either.

Modules are imported on demand: importing this package compiles nothing.
"""
