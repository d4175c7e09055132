"""`python -m ced.train`: the entry point of the training command, whose application lives in
ced/cli/train.py (the library in ced/train/__init__.py never imports its command line)."""

from ced.cli.train import main

main()
