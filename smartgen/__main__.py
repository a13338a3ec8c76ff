"""Runs the `smartgen` command line as `python -m smartgen`."""

from smartgen.cli.app import main

main()
