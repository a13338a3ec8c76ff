"""smartgen.tui package."""
