"""The space file: what a user asks for (`SweepSpec`), checked, and expanded into adapters.

* `plora.spec.schema` -- the sections of a space file and their validation, `SweepSpec`.
* `plora.spec.overrides` -- ``key=value`` overrides given on the command line.

Importing this package imports none of its modules: each is imported by name.
"""
