import course_utils  # noqa: F401, I001  (chooses the mode, and sets TRITON_INTERPRET before any kernel exists)

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def nan_empty(monkeypatch):
    """Every floating torch.empty / empty_like / new_empty starts as NaN: an element no kernel wrote
    shows (shared by the tests of the course's ops)."""
    def poison(fn):
        def wrapped(*args, **kwargs):
            t = fn(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return wrapped
    monkeypatch.setattr(torch, "empty", poison(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poison(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", poison(torch.Tensor.new_empty))
