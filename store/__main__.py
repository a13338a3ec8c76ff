"""`python -m smartgen.store` prints the profile database schema (what docs/profiles.md quotes)."""

from smartgen.store.migrations import schema

print(schema())
