"""`python -m tpattn.plan`: the cost model's command line, which lives in tpattn/model/cli.py
(`python -m tpattn.model` runs the same)."""

import sys

from .model.cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
