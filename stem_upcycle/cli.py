"""`python -m stem_upcycle.cli` (as `accelerate launch -m stem_upcycle.cli train ...` runs it): the command line,
which lives in `stem_upcycle_cli` so that `stem-upcycle --help` does not import this package."""

from stem_upcycle_cli import main

if __name__ == "__main__":
    main()
