"""The profile store: one SQLite file (WAL), migrated on open, holding `Profile`s keyed by model, selector, M and length range.

    store = ProfileStore()                      # $SMARTGEN_DB, else the XDG data dir
    profile_id = store.add(profile)
    match = store.best(fingerprint, "quest", 1024, length=3000)
    match.profile, match.nearest                # nearest: the length was outside every range

Writers take the write lock with BEGIN IMMEDIATE and wait for it up to the busy timeout
(`timeout`, else $SMARTGEN_DB_TIMEOUT, else 5 s), so concurrent writers queue instead of
failing; past the timeout a `StoreLockedError` says so. Every sqlite error leaves as a
`StoreError` with a message a user can act on.
"""

from __future__ import annotations

import builtins
import json
import os
import random
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from sqlite_utils import Database

from smartgen.store.errors import NewerSchemaError, NoProfileError, ProfileNotFoundError, StoreError, StoreLockedError
from smartgen.store.hash_weights import HashWeightsRecord
from smartgen.store.migrations import migrate, pending_migrations
from smartgen.store.profile import Profile, short
from smartgen.sysinfo import default_db_path

__all__ = ["ProfileStore", "Match", "DEFAULT_TIMEOUT_S", "default_timeout"]

DEFAULT_TIMEOUT_S = 5.0
TABLE = "profiles"
HASH_TABLE = "hash_weights"


def default_timeout() -> float:
    """Seconds to wait for a locked database: $SMARTGEN_DB_TIMEOUT, else 5."""
    value = os.environ.get("SMARTGEN_DB_TIMEOUT")
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise StoreError(f"$SMARTGEN_DB_TIMEOUT must be a number of seconds, got {value!r}") from None
    if seconds < 0:
        raise StoreError(f"$SMARTGEN_DB_TIMEOUT must be >= 0, got {value!r}")
    return seconds


def _cannot_write(exc: StoreError) -> bool:
    text = str(exc)
    return "read-only" in text or "cannot open" in text


class Match(NamedTuple):
    """The profile `best` chose; `nearest` is True when the length fell outside every stored range."""

    profile: Profile
    nearest: bool


class ProfileStore:
    """Profiles in one SQLite file; `create=False` refuses to make a new file (read-only commands).

    The default location's folder is made on first use (private to the user); a folder the user
    named (`path` or $SMARTGEN_DB) must exist. With `create=False` a database that cannot be
    written (read-only folder or file) is opened read-only, so listing and exporting still work.
    """

    def __init__(self, path: str | Path | None = None, *, timeout: float | None = None, create: bool = True) -> None:
        self.memory = str(path) == ":memory:"
        explicit = path is not None or bool(os.environ.get("SMARTGEN_DB"))
        self.path = Path(path).expanduser() if path is not None else default_db_path()
        self.timeout = default_timeout() if timeout is None else timeout
        self.read_only = False
        if not self.memory:
            self._check_path(create=create, explicit=explicit)
        try:
            self.db = self._open(create=create)
        except NewerSchemaError as exc:
            raise NewerSchemaError(f"{self.path}: {exc}") from None

    def _check_path(self, *, create: bool, explicit: bool) -> None:
        if self.path.is_dir():
            raise StoreError(f"the profile database path {self.path} is a directory")
        if self.path.exists():
            return
        if not create:
            raise StoreError(f"no profile database at {self.path} (`smartgen profile` creates it)")
        folder = self.path.parent
        if folder.is_dir():
            return
        if explicit:
            raise StoreError(f"cannot create the profile database {self.path}: folder {folder} does not exist")
        try:  # the XDG default: ours to make, parents included, readable by this user only
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise StoreError(f"cannot create the profile folder {folder}: {exc.strerror or exc}") from None

    def _open(self, *, create: bool) -> Database:
        """Connects, switches to WAL and migrates, retrying while another process holds a lock.

        Several processes opening one new file at once race for the WAL switch and the first
        migration; SQLite answers some of those races with SQLITE_BUSY at once, without waiting
        on the busy handler, so the whole opening is retried until `timeout` has really passed.
        """
        started = time.monotonic()
        while True:
            conn: sqlite3.Connection | None = None
            try:
                with self._guard(started):
                    conn = sqlite3.connect(":memory:" if self.memory else str(self.path), timeout=self.timeout)
                    db = Database(conn, execute_plugins=False)
                    if not self.memory:
                        db.enable_wal()
                    migrate(db)
                    return db
            except StoreLockedError:
                if conn is not None:
                    conn.close()
                if time.monotonic() - started >= self.timeout:
                    raise
                time.sleep(random.uniform(0.005, 0.05))
            except StoreError as exc:
                if conn is not None:
                    conn.close()
                if self.memory or not _cannot_write(exc):
                    raise
                if create:
                    raise StoreError(
                        f"the profile database {self.path} is read-only (its folder or the file cannot be written)"
                    ) from None
                return self._open_read_only()
            except BaseException:
                if conn is not None:
                    conn.close()
                raise

    def _open_read_only(self) -> Database:
        """The file as it is, for reading: no WAL switch, no migration (one that is due is an error)."""
        self.read_only = True
        with self._guard(time.monotonic()):
            conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro&immutable=1", uri=True)
            db = Database(conn, execute_plugins=False)
            try:
                pending = pending_migrations(db)
            except BaseException:
                conn.close()
                raise
        if pending:
            conn.close()
            raise StoreError(
                f"the profile database {self.path} is read-only and needs upgrading (migrations {', '.join(pending)}): "
                "open it once where it can be written"
            )
        return db

    # -- plumbing -----------------------------------------------------------------------
    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> ProfileStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _guard(self, started: float | None = None) -> Iterator[None]:
        """Turns sqlite errors into StoreErrors that name the file and what to do."""
        started = time.monotonic() if started is None else started
        try:
            yield
        except sqlite3.OperationalError as exc:
            message = str(exc)
            if "locked" in message or "busy" in message:
                raise StoreLockedError(
                    f"the profile database {self.path} is locked by another process; gave up after "
                    f"{time.monotonic() - started:.1f} s (set $SMARTGEN_DB_TIMEOUT to wait longer)"
                ) from None
            if "readonly" in message:
                raise StoreError(f"the profile database {self.path} is read-only") from None
            if "unable to open" in message:
                raise StoreError(f"cannot open the profile database {self.path}: {message}") from None
            raise StoreError(f"cannot use the profile database {self.path}: {message}") from None
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path} is not a SmartGen profile database ({exc})") from None

    @contextmanager
    def _write(self) -> Iterator[Database]:
        """One write transaction holding the write lock from its start (no deferred-lock upgrade failures)."""
        with self._guard():
            self.db.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
                self.db.conn.execute("COMMIT")
            except BaseException:
                if self.db.conn.in_transaction:
                    self.db.conn.execute("ROLLBACK")
                raise

    def _rows(self, where: str | None = None, args: list[Any] | None = None) -> list[Profile]:
        with self._guard():
            rows = list(self.db.table(TABLE).rows_where(where, args or [], order_by="id"))
        return [Profile.from_row(row) for row in rows]

    # -- the API --------------------------------------------------------------------------
    def add(self, profile: Profile) -> int:
        """Stores a profile; returns its new id."""
        with self._write() as db:
            table = db.table(TABLE)
            table.insert(profile.to_row())
            assert table.last_pk is not None  # sqlite-utils sets it on every insert
            return int(table.last_pk)

    def get(self, profile_id: int) -> Profile:
        rows = self._rows("id = ?", [profile_id])
        if not rows:
            raise ProfileNotFoundError(
                f"no profile {profile_id} in {self.path} (`smartgen profiles list` shows the ids)"
            )
        return rows[0]

    def list(self, *, fingerprint: str | None = None, selector: str | None = None) -> list[Profile]:
        """Every profile, oldest first, optionally only one model's and/or one selector's."""
        clauses, args = [], []
        if fingerprint is not None:
            clauses.append("model_fingerprint = ?")
            args.append(fingerprint)
        if selector is not None:
            clauses.append("selector = ?")
            args.append(selector)
        return self._rows(" AND ".join(clauses) or None, args)

    def remove(self, profile_id: int) -> None:
        with self._write() as db:
            cursor = db.conn.execute(f"DELETE FROM {TABLE} WHERE id = ?", [profile_id])
            if cursor.rowcount == 0:
                raise ProfileNotFoundError(
                    f"no profile {profile_id} in {self.path} (`smartgen profiles list` shows the ids)"
                )

    def best(
        self,
        fingerprint: str,
        selector: str,
        num_blocks: int,
        length: int,
        selector_params: dict[str, Any] | None = None,
    ) -> Match:
        """The profile to plan a request of `length` tokens with.

        Among this model's profiles for `selector` and M = `num_blocks` (and, if given, exactly these
        selector parameters): the narrowest range holding `length`, newest first; when no range holds
        it, the nearest range (newest on ties), flagged `nearest=True`.
        """
        candidates = self._rows(
            "model_fingerprint = ? AND selector = ? AND num_blocks = ?", [fingerprint, selector, num_blocks]
        )
        if selector_params is not None:
            wanted = json.dumps(selector_params, sort_keys=True)
            candidates = [p for p in candidates if json.dumps(p.selector_params, sort_keys=True) == wanted]
        if not candidates:
            params = "" if selector_params is None else f" {json.dumps(selector_params, sort_keys=True)}"
            raise NoProfileError(
                f"no profile for model {short(fingerprint)} with selector {selector}{params} and M={num_blocks} in "
                f"{self.path}: run `smartgen profile` for this model first"
            )
        holding = [p for p in candidates if p.contains(length)]
        if holding:
            return Match(min(holding, key=lambda p: (p.length_hi - p.length_lo, -(p.id or 0))), False)
        return Match(min(candidates, key=lambda p: (p.distance(length), -(p.id or 0))), True)

    def add_hash_weights(self, record: HashWeightsRecord) -> int:
        """Stores a model's HATA hash weights; returns their new id (the newest are the ones used)."""
        with self._write() as db:
            table = db.table(HASH_TABLE)
            table.insert(record.to_row())
            assert table.last_pk is not None
            return int(table.last_pk)

    def hash_weights(self, fingerprint: str, rbit: int | None = None) -> HashWeightsRecord | None:
        """The newest HATA hash weights stored for this model (of `rbit` bits, if given), or None."""
        where = "model_fingerprint = ?"
        args: list[Any] = [fingerprint]
        if rbit is not None:
            where += " AND rbit = ?"
            args.append(rbit)
        with self._guard():
            rows = list(self.db.table(HASH_TABLE).rows_where(where, args, order_by="id desc", limit=1))
        return HashWeightsRecord.from_row(rows[0]) if rows else None

    def list_hash_weights(self, fingerprint: str | None = None) -> builtins.list[HashWeightsRecord]:
        """Every stored set of hash weights, oldest first (optionally one model's)."""
        where, args = ("model_fingerprint = ?", [fingerprint]) if fingerprint is not None else (None, [])
        with self._guard():
            rows = list(self.db.table(HASH_TABLE).rows_where(where, args, order_by="id"))
        return [HashWeightsRecord.from_row(row) for row in rows]

    def export(self, profile_id: int) -> dict[str, Any]:
        """A profile as JSON-ready data (the importance bit-exact, base64)."""
        return self.get(profile_id).to_dict()

    def import_(self, data: dict[str, Any]) -> int:
        """Stores an exported profile under a new id; a StoreError says what is wrong with `data`."""
        try:
            profile = Profile.from_dict(data)
        except ValueError as exc:
            raise StoreError(str(exc)) from None
        return self.add(profile)
