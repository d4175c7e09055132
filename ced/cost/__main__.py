"""`python -m ced.cost`: the entry point of the cost report, whose application lives in
ced/cli/cost.py (the library in ced/cost/__init__.py never imports its command line)."""

from ced.cli.cost import main

main()
