"""Triton kernels of the course, one module per op family.

Each module keeps, in this order: the ``@triton.jit`` kernel(s), the launcher with the bare op
name (``gelu(x)``), and the PyTorch reference (``gelu_ref(x)``). Its docstring lists its version
ladder, one line per version. Import a module explicitly (``from course_utils.kernels import
elementwise``): importing this package compiles nothing.
"""
