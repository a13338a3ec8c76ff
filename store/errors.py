"""What can go wrong with the profile database, as exceptions whose message a user can act on."""

from __future__ import annotations

__all__ = ["StoreError", "NewerSchemaError", "StoreLockedError", "ProfileNotFoundError", "NoProfileError"]


class StoreError(Exception):
    """A profile database problem: missing, unreadable, not a database, read-only, ..."""


class NewerSchemaError(StoreError):
    """The database was migrated by a newer SmartGen: its recorded migrations include names this one does not know."""


class StoreLockedError(StoreError):
    """Another process held the database's write lock for longer than the busy timeout."""


class ProfileNotFoundError(StoreError):
    """No profile has this id."""


class NoProfileError(StoreError):
    """No profile matches a model fingerprint, selector and block count."""
