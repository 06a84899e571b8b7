"""`python -m benchmarks NAME [flags]`: what `ferry bench NAME [flags]` runs (benchmarks/cli.py)."""
import sys

from benchmarks.cli import main

sys.exit(main())
