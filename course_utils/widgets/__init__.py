"""What-if widgets of the course: one module per chapter topic (``fusion``, ...), each a thin view
over tested functions, working on ipywidgets 7.7 and 8.x."""
