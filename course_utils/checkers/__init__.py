"""Chapter-specific exercise checkers, built from the toolkit in :mod:`course_utils.check`."""
