"""smartgen.cli package."""
