"""The backend: what computes each op and the weights in the formats it reads; ops.py's
docstring says how."""

# Imports nothing: a model module imports linear.py without importing `Backend` (ops.py), which
# imports the models' building blocks (no import cycle).
