import course_utils  # noqa: F401  (chooses the mode, and sets TRITON_INTERPRET before any kernel exists)
