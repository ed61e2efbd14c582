"""Kernels written in CUDA C++ for comparison with the Triton ones (sources in ``*.cu`` beside this file)."""
