"""Fault catalogues: what each usual mistake produces (a checker's float64 answers, right and wrong; what a
wrong timer did on a simulated GPU), so that a check can name the mistake a student's answer matches. Not
checkers: nothing here refuses an answer; the checkers that consult them (those of chapters 5, 6, 7, 8, 9, 12 and
13 in :mod:`course_utils.checkers`) refuse the course's own answers first."""
