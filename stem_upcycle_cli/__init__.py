"""The `stem-upcycle` command line (`commands.py`), handed on as `main`.

It lives beside the `stem_upcycle` package, not in it: importing that package imports transformers and registers
the STEM classes with its Auto classes (what `import stem_upcycle` promises its users), and a package's
`__init__` runs before any of its modules. Here, `--help` reads only Click and `options.py`.
"""

from .commands import main

__all__ = ["main"]
