"""The texts that checkers print: what each named fault means, keyed by the fault's name. Data only; the checks
that name a fault and refuse the course's own kernels as answers live in :mod:`course_utils.checkers`."""
