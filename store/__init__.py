"""The profile store: calibration profiles in one SQLite file, with migrations and errors a user can act on."""

from smartgen.store.compare import Overlap, compare, top_blocks
from smartgen.store.database import DEFAULT_TIMEOUT_S, Match, ProfileStore, default_timeout
from smartgen.store.errors import NewerSchemaError, NoProfileError, ProfileNotFoundError, StoreError, StoreLockedError
from smartgen.store.hash_weights import HashWeightsRecord
from smartgen.store.migrations import MIGRATIONS, applied_migrations, migrate, pending_migrations, schema
from smartgen.store.profile import Profile

__all__ = [
    "ProfileStore",
    "Match",
    "Profile",
    "HashWeightsRecord",
    "Overlap",
    "compare",
    "top_blocks",
    "MIGRATIONS",
    "migrate",
    "applied_migrations",
    "pending_migrations",
    "schema",
    "StoreError",
    "NewerSchemaError",
    "StoreLockedError",
    "ProfileNotFoundError",
    "NoProfileError",
    "DEFAULT_TIMEOUT_S",
    "default_timeout",
]
