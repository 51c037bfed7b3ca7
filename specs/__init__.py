"""Executable specifications: the spec catalogue and torch-free reference models.

Nothing in this package imports torch. The reference models work on numpy arrays and plain
tuples so that they can be checked against torch (in ``tests/``) without sharing its code.
"""
