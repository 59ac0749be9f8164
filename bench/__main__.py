"""Entry point: ``python -m bench --help``."""
from bench.cli import main

raise SystemExit(main())
