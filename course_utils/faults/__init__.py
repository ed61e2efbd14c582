"""Fault catalogues: a checker's float64 answers, right and with each usual mistake, so that a check can name
the mistake a student's output matches. Not checkers: nothing here takes a student's function; the checkers
that consult them (:mod:`course_utils.checkers.gemm`, :mod:`course_utils.checkers.hand_step`) refuse the
course's own answers first."""
