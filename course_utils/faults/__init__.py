"""Fault catalogues: what each usual mistake produces (a checker's float64 answers, right and wrong; what a
wrong timer did on a simulated GPU), so that a check can name the mistake a student's answer matches. Not
checkers: nothing here refuses an answer; the checkers that consult them (:mod:`course_utils.checkers.gemm`,
:mod:`course_utils.checkers.hand_step`, :mod:`course_utils.checkers.bench`) refuse the course's own answers
first."""
