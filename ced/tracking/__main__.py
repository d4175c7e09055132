"""`python -m ced.tracking`: the entry point of the offline-run reader, whose application
lives in ced/cli/tracking.py (the library in ced/tracking/__init__.py never imports it)."""

from ced.cli.tracking import main

raise SystemExit(main())
