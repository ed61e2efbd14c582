"""The tuned shelf: the production path of each op that ``make bench`` times.

``course_utils/tuned/<op>.py`` holds what the teaching kernels in ``course_utils/kernels/<op>.py``
leave out: tiles chosen per GPU, extra kernels, plans, Hopper variants. A tuned module imports its
teaching module, never the reverse; the teaching module forwards the production names (``gelu``,
``softmax``...) here lazily. Import a module explicitly: importing this package compiles nothing.
"""
