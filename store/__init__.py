"""smartgen.store package."""
