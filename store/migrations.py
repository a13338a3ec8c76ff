"""The profile database schema as ordered migrations (m001_initial, ...), each recorded in `_migrations` once applied.

Add a change as a new function at the end of MIGRATIONS; never edit one that has shipped. A
database whose `_migrations` names one this SmartGen does not know was written by a newer
SmartGen and is refused (`NewerSchemaError`) rather than guessed at.

`python -m smartgen.store` prints the schema that docs/profiles.md quotes.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

from sqlite_utils import Database

from smartgen.store.errors import NewerSchemaError

__all__ = ["MIGRATIONS", "MIGRATIONS_TABLE", "applied_migrations", "migrate", "pending_migrations", "schema"]

MIGRATIONS_TABLE = "_migrations"
MIGRATIONS: list[Callable[[Database], None]] = []


def _migration(fn: Callable[[Database], None]) -> Callable[[Database], None]:
    MIGRATIONS.append(fn)
    return fn


@_migration
def m001_initial(db: Database) -> None:
    """One row per profile: what was profiled, how, and the importance matrix [L, M] as a float32 blob."""
    db.table("profiles").create(
        {
            "id": int,
            "created_at": str,  # ISO 8601, UTC
            "smartgen_version": str,
            "model_fingerprint": str,  # smartgen.runtime.fingerprint.model_fingerprint, hex SHA-256
            "model": str,  # name or path the model was loaded from
            "selector": str,
            "selector_params": str,  # JSON object
            "num_layers": int,  # L: importance rows
            "num_blocks": int,  # M: importance columns
            "length_lo": int,  # prompt lengths [lo, hi) this profile covers
            "length_hi": int,
            "calibration": str,  # calibration set name
            "calibration_hash": str,  # SHA-256 of the calibration set
            "num_prompts": int,
            "decode_tokens": int,  # decode steps per prompt (selector calls per layer)
            "mean_length": float,  # mean prompt length, tokens; T_p and T_t are for this length
            "prefill_seconds": float,  # T_p
            "transfer_seconds": float,  # T_t
            "kv_bytes_per_token": int,  # K and V of one token over all layers, in the profiled dtype
            "link": str,  # where T_t was measured: "rate:15gbps" (bytes / rate) or "inproc:15gbps" (paced lane)
            "importance": bytes,  # float32 little-endian, row-major [num_layers, num_blocks]
        },
        pk="id",
        not_null={
            "created_at",
            "smartgen_version",
            "model_fingerprint",
            "model",
            "selector",
            "selector_params",
            "num_layers",
            "num_blocks",
            "length_lo",
            "length_hi",
            "calibration",
            "calibration_hash",
            "num_prompts",
            "decode_tokens",
            "mean_length",
            "prefill_seconds",
            "transfer_seconds",
            "kv_bytes_per_token",
            "link",
            "importance",
        },
    )
    db.table("profiles").create_index(["model_fingerprint", "selector", "num_blocks"], index_name="profiles_lookup")


@_migration
def m002_hash_weights(db: Database) -> None:
    """HATA's hash weights per model, trained on a calibration set: safetensors bytes ("layer.<l>": [H, d, rbit])."""
    columns = {
        "id": int,
        "created_at": str,  # ISO 8601, UTC
        "smartgen_version": str,
        "model_fingerprint": str,
        "model": str,
        "rbit": int,  # bits per code
        "num_layers": int,  # layers with weights (every layer >= 2)
        "calibration": str,
        "calibration_hash": str,
        "num_prompts": int,
        "steps": int,  # optimiser steps per layer
        "weights": bytes,
    }
    db.table("hash_weights").create(columns, pk="id", not_null=set(columns) - {"id"})
    db.table("hash_weights").create_index(["model_fingerprint", "rbit"], index_name="hash_weights_lookup")


def applied_migrations(db: Database) -> list[str]:
    """Names recorded in `_migrations`, in the order they were applied ([] for a new database)."""
    if not db.table(MIGRATIONS_TABLE).exists():
        return []
    return [row[0] for row in db.execute(f"SELECT name FROM {MIGRATIONS_TABLE} ORDER BY rowid").fetchall()]


def _check_not_newer(db: Database, done: list[str]) -> None:
    known = {fn.__name__ for fn in MIGRATIONS}
    unknown = [name for name in done if name not in known]
    if unknown:
        raise NewerSchemaError(
            f"the profile database was written by a newer SmartGen (unknown migrations: {', '.join(unknown)}); "
            "upgrade SmartGen, or point --db / $SMARTGEN_DB at another file"
        )


def pending_migrations(db: Database) -> list[str]:
    """Migrations this SmartGen would still apply; a NewerSchemaError for a database from a newer SmartGen."""
    done = applied_migrations(db)
    _check_not_newer(db, done)
    return [fn.__name__ for fn in MIGRATIONS if fn.__name__ not in done]


def migrate(db: Database) -> list[str]:
    """Applies the pending migrations in one write transaction; returns their names.

    Safe against another process migrating the same file at the same time: the pending list
    is re-read under the write lock (BEGIN IMMEDIATE), so each migration runs once.
    """
    if not pending_migrations(db):
        return []
    conn = db.conn
    conn.execute("BEGIN IMMEDIATE")
    try:
        done = applied_migrations(db)
        _check_not_newer(db, done)
        db.table(MIGRATIONS_TABLE).create({"name": str, "applied_at": str}, pk="name", if_not_exists=True)
        ran = []
        for fn in MIGRATIONS:
            if fn.__name__ in done:
                continue
            fn(db)
            now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            db.table(MIGRATIONS_TABLE).insert({"name": fn.__name__, "applied_at": now})
            ran.append(fn.__name__)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return ran


def schema() -> str:
    """The SQL schema of a freshly migrated database (what docs/profiles.md quotes)."""
    db = Database(memory=True, execute_plugins=False)
    migrate(db)
    return db.schema
