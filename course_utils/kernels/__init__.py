"""The teaching shelf: Triton kernels a student reads, one module per op family.

Each module keeps, in this order: the ``@triton.jit`` teaching kernel(s) under public names
(``gelu_kernel``, ``softmax_row_kernel``), plain ``kernel[grid](...)`` launchers named
``<op>_teaching``, and the PyTorch reference ``<op>_ref``; its docstring lists the version ladder,
one line per version. The fast paths ``make bench`` times live in :mod:`course_utils.tuned` (and, as
PyTorch operators, in :mod:`course_utils.ops`); importing this shelf never imports them. Import a module
explicitly (``from course_utils.kernels import elementwise``): importing this package compiles nothing.
"""
