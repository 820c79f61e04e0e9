"""A module that only an import of a path some message names would load: the task tests check
that the worker never imports one (its code would run in the worker)."""

charge = None
