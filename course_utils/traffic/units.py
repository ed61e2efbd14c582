"""Units and argument checking of the traffic calculators: dtype sizes, counts, shapes."""

from __future__ import annotations

import math
import operator

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "tf32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "bool": 1,
}
_DTYPE_ALIASES = {
    "fp64": "float64", "double": "float64", "f64": "float64",
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2",
}

OPERAND_KINDS = ("full", "col", "row", "scalar", "input")


def dtype_name(dtype) -> str:
    """Canonical name of a dtype given as a string ('bf16', 'torch.float16') or a torch dtype."""
    text = str(dtype).strip().lower().removeprefix("torch.")
    text = _DTYPE_ALIASES.get(text, text)
    if text not in DTYPE_BYTES:
        raise ValueError(f"dtype: unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)} "
                         f"or an alias {sorted(_DTYPE_ALIASES)}")
    return text


def dtype_bytes(dtype) -> int:
    """Bytes per element: ``dtype_bytes('bf16') == 2``."""
    return DTYPE_BYTES[dtype_name(dtype)]


def _count(name: str, value, *, allow_zero: bool = False) -> int:
    """``value`` as a positive int, or a ValueError naming the argument."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        if isinstance(value, float) and value.is_integer():
            v = int(value)
        else:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else 'positive'}, got {v}")
    return v


def _shape(shape) -> tuple[int, int]:
    """(rows, cols) of a shape given as numel or a tuple (the last entry is cols)."""
    if isinstance(shape, (tuple, list)):
        if not shape:
            raise ValueError("shape must not be empty")
        dims = [_count(f"shape[{i}]", d) for i, d in enumerate(shape)]
        return math.prod(dims[:-1]), dims[-1]
    return 1, _count("shape", shape)



__all__ = ["DTYPE_BYTES", "OPERAND_KINDS", "dtype_name", "dtype_bytes"]
