"""The profile store: schema and migrations, round trips, lookup by length, K_r, concurrency, locking, compare."""

from __future__ import annotations

import json
import multiprocessing
import random
import re
import sqlite3
import time
from pathlib import Path

import pytest
import torch
from sqlite_utils import Database

from smartgen.engine.planning import proactive_budget
from smartgen.store import (
    MIGRATIONS,
    NewerSchemaError,
    NoProfileError,
    Profile,
    ProfileNotFoundError,
    ProfileStore,
    StoreError,
    StoreLockedError,
    applied_migrations,
    compare,
    migrate,
    schema,
    top_blocks,
)

PROFILE_COLUMNS = [
    "id",
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
]
DOCS = Path(__file__).resolve().parent.parent / "docs" / "profiles.md"


def make_profile(
    lo: int = 1024,
    hi: int = 2048,
    *,
    fingerprint: str = "f" * 64,
    selector: str = "quest",
    layers: int = 4,
    blocks: int = 8,
    seed: int = 0,
    prefill: float = 1.0,
    transfer: float = 2.0,
    model: str = "tiny",
    **params,
) -> Profile:
    importance = torch.rand(layers, blocks, generator=torch.Generator().manual_seed(seed))
    importance[:2] = 0
    return Profile(
        model_fingerprint=fingerprint,
        model=model,
        selector=selector,
        selector_params=params or {"budget": 0.1},
        length_lo=lo,
        length_hi=hi,
        calibration="calibration.jsonl",
        calibration_hash="c" * 64,
        num_prompts=3,
        decode_tokens=16,
        mean_length=(lo + hi) / 2,
        prefill_seconds=prefill,
        transfer_seconds=transfer,
        kv_bytes_per_token=1024,
        link="rate:15gbps",
        importance=importance,
    )


@pytest.fixture
def store(tmp_path):
    with ProfileStore(tmp_path / "profiles.db", timeout=2) as s:
        yield s


# -- schema and migrations --------------------------------------------------------------
def test_schema_columns_after_migrations(tmp_path):
    ProfileStore(tmp_path / "p.db").close()
    db = Database(tmp_path / "p.db")
    assert [c.name for c in db.table("profiles").columns] == PROFILE_COLUMNS
    assert [c.name for c in db.table("_migrations").columns] == ["name", "applied_at"]
    assert (
        [r["name"] for r in db.table("_migrations").rows]
        == [fn.__name__ for fn in MIGRATIONS]
        == [
            "m001_initial",
            "m002_hash_weights",
        ]
    )
    assert db.journal_mode == "wal"
    assert {tuple(i.columns) for i in db.table("profiles").indexes} == {("model_fingerprint", "selector", "num_blocks")}
    assert [c.name for c in db.table("hash_weights").columns] == HASH_COLUMNS
    assert {tuple(i.columns) for i in db.table("hash_weights").indexes} == {("model_fingerprint", "rbit")}


HASH_COLUMNS = [
    "id",
    "created_at",
    "smartgen_version",
    "model_fingerprint",
    "model",
    "rbit",
    "num_layers",
    "calibration",
    "calibration_hash",
    "num_prompts",
    "steps",
    "weights",
]


def test_hash_weights_round_trip_and_the_newest_win(store):
    from smartgen.store import HashWeightsRecord

    def record(fingerprint, rbit, data):
        return HashWeightsRecord(fingerprint, "m", rbit, 4, "cal.jsonl", "0" * 64, 3, 10, data)

    assert store.hash_weights("a" * 64) is None
    first = store.add_hash_weights(record("a" * 64, 128, b"one"))
    second = store.add_hash_weights(record("a" * 64, 128, b"two"))
    other = store.add_hash_weights(record("a" * 64, 64, b"three"))
    store.add_hash_weights(record("b" * 64, 128, b"four"))
    assert first < second < other
    newest = store.hash_weights("a" * 64)
    assert newest is not None and newest.id == other and newest.weights == b"three"
    by_bits = store.hash_weights("a" * 64, rbit=128)
    assert by_bits is not None
    assert by_bits.id == second and by_bits.weights == b"two" and by_bits.calibration == "cal.jsonl"
    assert [r.id for r in store.list_hash_weights("a" * 64)] == [first, second, other]
    assert len(store.list_hash_weights()) == 4
    with pytest.raises(ValueError, match="rbit"):
        record("a" * 64, 12, b"x")


def test_migrations_run_once(tmp_path):
    ProfileStore(tmp_path / "p.db").close()
    db = Database(tmp_path / "p.db")
    assert migrate(db) == []
    assert db.table("_migrations").count == len(MIGRATIONS)


def test_database_from_a_newer_smartgen_is_refused(tmp_path):
    ProfileStore(tmp_path / "p.db").close()
    Database(tmp_path / "p.db").table("_migrations").insert({"name": "m999_from_the_future", "applied_at": "2030"})
    with pytest.raises(NewerSchemaError, match="newer SmartGen.*m999_from_the_future"):
        ProfileStore(tmp_path / "p.db")


def test_docs_quote_the_real_schema():
    text = DOCS.read_text()
    block = re.search(r"<!-- schema -->\n```sql\n(.*?)```\n<!-- /schema -->", text, re.S)
    assert block, "docs/profiles.md must quote the schema between <!-- schema --> markers"
    assert block.group(1).strip() == schema().strip(), "regenerate it: python -m smartgen.store"
    for column in PROFILE_COLUMNS + HASH_COLUMNS:
        assert f"`{column}`" in text, f"docs/profiles.md does not describe {column}"


# -- opening ------------------------------------------------------------------------------
def test_missing_database_and_directory(tmp_path):
    with pytest.raises(StoreError, match="no profile database"):
        ProfileStore(tmp_path / "absent.db", create=False)
    with pytest.raises(StoreError, match="does not exist"):
        ProfileStore(tmp_path / "no" / "such" / "dir.db")


def test_not_a_database(tmp_path):
    (tmp_path / "junk.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="not a SmartGen profile database"):
        ProfileStore(tmp_path / "junk.db")


# -- round trips --------------------------------------------------------------------------
def test_round_trip_is_bit_exact(store):
    profile = make_profile(seed=3, page_size=16)
    odd = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45, 3.4e38, -1.5, 0.1, 2.0 / 3.0])
    profile = Profile(
        **{
            **{f: getattr(profile, f) for f in profile.__slots__},
            "importance": torch.cat([profile.importance, odd[None]]),
        }
    )
    profile_id = store.add(profile)
    back = store.get(profile_id)
    assert back.id == profile_id
    assert back.importance.dtype == torch.float32
    assert back.importance.numpy().tobytes() == profile.importance.numpy().tobytes()
    for field in profile.__slots__:
        if field not in ("id", "importance"):
            assert getattr(back, field) == getattr(profile, field), field
    assert [p.id for p in store.list()] == [profile_id]


def test_export_import_is_bit_exact(store):
    profile_id = store.add(make_profile(seed=4))
    data = json.loads(json.dumps(store.export(profile_id)))  # through real JSON text
    new_id = store.import_(data)
    assert new_id != profile_id
    a, b = store.get(profile_id), store.get(new_id)
    assert a.importance.numpy().tobytes() == b.importance.numpy().tobytes()
    assert a.summary() | {"id": None} == b.summary() | {"id": None}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format="other"), "not a SmartGen profile export"),
        (lambda d: d.update(format_version=99), "version 99"),
        (lambda d: d.pop("selector"), "missing fields: selector"),
        (lambda d: d["importance"].update(shape=[3, 3]), "bytes"),
        (lambda d: d["importance"].update(base64="!!!"), "bad profile export"),
    ],
)
def test_import_rejects_bad_exports(store, mutate, message):
    data = store.export(store.add(make_profile()))
    mutate(data)
    with pytest.raises(StoreError, match=message):
        store.import_(data)


def test_remove_and_missing_ids(store):
    profile_id = store.add(make_profile())
    store.remove(profile_id)
    assert store.list() == []
    with pytest.raises(ProfileNotFoundError, match=f"no profile {profile_id}"):
        store.get(profile_id)
    with pytest.raises(ProfileNotFoundError):
        store.remove(profile_id)


# -- K_r and lookup -------------------------------------------------------------------------
def test_k_r_from_stored_timings(store):
    profile_id = store.add(make_profile(layers=6, blocks=1024, prefill=1.0, transfer=2.0))
    profile = store.get(profile_id)
    # K_r = clip(L·M · ((L-1)/L · T_p) / T_t, 2M, L·M) = 6144 · (5/6) / 2 = 2560
    assert profile.k_r() == proactive_budget(6, 1024, 1.0, 2.0) == 2560
    assert profile.prefill_seconds_per_token == pytest.approx(1.0 / 1536)
    assert profile.transfer_seconds_per_token == pytest.approx(2.0 / 1536)
    # at another link rate T_t comes from the stored KV bytes per token
    transfer_10 = 1024 * 1536 * 8 / 10e9
    assert profile.k_r(10.0) == proactive_budget(6, 1024, 1.0, transfer_10) == 6144  # fast link: everything
    assert make_profile(layers=6, blocks=1024, prefill=1.0, transfer=100.0).k_r() == 2048  # slow link: the floor


def test_best_by_length_and_nearest_fallback(store):
    short_id = store.add(make_profile(1024, 2048))
    long_id = store.add(make_profile(2048, 4096))
    wide_id = store.add(make_profile(1024, 8192))
    store.add(make_profile(1024, 2048, selector="topk"))
    store.add(make_profile(1024, 2048, fingerprint="e" * 64))
    assert store.best("f" * 64, "quest", 8, 1500) == (store.get(short_id), False)  # narrowest holding range
    assert store.best("f" * 64, "quest", 8, 2048).profile.id == long_id  # ranges are [lo, hi)
    assert store.best("f" * 64, "quest", 8, 5000).profile.id == wide_id
    match = store.best("f" * 64, "quest", 8, 100)  # below every range
    assert match.nearest and match.profile.length_lo == 1024 and match.profile.selector == "quest"
    store.remove(wide_id)
    profile, nearest = store.best("f" * 64, "quest", 8, 10_000)  # above every range: the nearest is 2048-4096
    assert (profile.id, nearest) == (long_id, True)


def test_best_prefers_newest_and_filters_params(store):
    old = store.add(make_profile(budget=0.1))
    new = store.add(make_profile(budget=0.1))
    other = store.add(make_profile(budget=0.2))
    assert store.best("f" * 64, "quest", 8, 1500).profile.id == other
    assert store.best("f" * 64, "quest", 8, 1500, {"budget": 0.1}).profile.id == new != old
    with pytest.raises(NoProfileError, match="no profile for model ffffffffffff with selector quest .* and M=16"):
        store.best("f" * 64, "quest", 16, 1500, {"budget": 0.1})
    with pytest.raises(NoProfileError, match="run `smartgen profile`"):
        store.best("0" * 64, "quest", 8, 1500)


# -- concurrency and locking ----------------------------------------------------------------
WORKERS, ROUNDS, PER_ROUND = 8, 20, 4


def _creator(folder: str, worker: int, barrier) -> None:
    """Each round, all workers open one NEW file at the same moment: create, WAL switch, migrate, write."""
    jitter = random.Random(worker)
    for r in range(ROUNDS):
        barrier.wait()
        time.sleep(jitter.uniform(0, 0.02))  # some open while others switch to WAL, migrate or write
        with ProfileStore(Path(folder) / f"round{r}.db", timeout=60) as store:
            for i in range(PER_ROUND):
                store.add(make_profile(model=f"w{worker}-{i}", seed=r * 1000 + worker * 10 + i))


def test_eight_processes_creating_one_new_database_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(WORKERS)
    workers = [ctx.Process(target=_creator, args=(str(tmp_path), w, barrier)) for w in range(WORKERS)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(timeout=600)
    assert [p.exitcode for p in workers] == [0] * WORKERS
    for r in range(ROUNDS):
        with ProfileStore(tmp_path / f"round{r}.db") as store:
            profiles = store.list()
            assert applied_migrations(store.db) == [fn.__name__ for fn in MIGRATIONS]  # each ran once
        expected = sorted(f"w{w}-{i}" for w in range(WORKERS) for i in range(PER_ROUND))
        assert sorted(p.model for p in profiles) == expected
        assert len({p.id for p in profiles}) == WORKERS * PER_ROUND
        for p in profiles:
            worker, i = (int(x) for x in p.model[1:].split("-"))
            assert torch.equal(p.importance, make_profile(seed=r * 1000 + worker * 10 + i).importance)


def test_locked_database_fails_clearly_after_the_timeout(tmp_path):
    path = tmp_path / "locked.db"
    ProfileStore(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process in the middle of a write
    try:
        with ProfileStore(path, timeout=0.3) as store:
            assert store.list() == []  # WAL: readers are not blocked
            start = time.monotonic()
            with pytest.raises(StoreLockedError, match=r"locked by another process; gave up after") as raised:
                store.add(make_profile())
            waited = time.monotonic() - start
            reported = float(re.search(r"gave up after (\d+\.\d+) s", str(raised.value)).group(1))
            assert waited >= 0.3 and reported >= 0.3  # locked is said only once the timeout really ran out
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_timeout_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SMARTGEN_DB_TIMEOUT", "1.5")
    with ProfileStore(tmp_path / "p.db") as store:
        assert store.timeout == 1.5
    monkeypatch.setenv("SMARTGEN_DB_TIMEOUT", "soon")
    with pytest.raises(StoreError, match="SMARTGEN_DB_TIMEOUT"):
        ProfileStore(tmp_path / "p.db")


# -- compare ----------------------------------------------------------------------------------
def test_compare_identical_and_disjoint():
    a = make_profile(layers=4, blocks=8, seed=1)
    same = compare(a, a, k_r=20)  # 16 always-sent blocks + the top 4 of layers 2-3
    assert (same.num_a, same.num_common, same.recall, same.jaccard) == (4, 4, 1.0, 1.0)
    low, high = torch.zeros(4, 8), torch.zeros(4, 8)
    low[2:, :4], high[2:, 4:] = 1.0, 1.0
    x = Profile(**{**{f: getattr(a, f) for f in a.__slots__}, "importance": low})
    y = Profile(**{**{f: getattr(a, f) for f in a.__slots__}, "importance": high})
    apart = compare(x, y, k_r=16 + 8)
    assert top_blocks(low, 24) == {16, 17, 18, 19, 24, 25, 26, 27}
    assert (apart.num_common, apart.recall, apart.jaccard) == (0, 0.0, 0.0)


def test_compare_uses_each_profiles_own_k_r():
    a = make_profile(layers=4, blocks=8, prefill=1.0, transfer=1.0)  # K_r = 32·(3/4) = 24 -> 8 beyond layers 0-1
    b = make_profile(layers=4, blocks=8, prefill=1.0, transfer=2.0, seed=5)  # K_r = 12 -> floor 16 -> nothing beyond
    overlap = compare(a, b)
    assert (overlap.k_r_a, overlap.k_r_b, overlap.num_a, overlap.num_b) == (24, 16, 8, 0)
    assert overlap.empty
    everything = compare(a, a, k_r=32)
    assert everything.covers_all and everything.recall == 1.0
    with pytest.raises(ValueError, match="different shapes"):
        compare(a, make_profile(layers=4, blocks=16))


def test_opening_retries_a_lock_sqlite_reports_at_once(tmp_path, monkeypatch):
    """SQLite answers some opening races with SQLITE_BUSY without waiting; the store retries until its timeout."""
    import smartgen.store.database as database

    calls = []

    def flaky_migrate(db):
        calls.append(time.monotonic())
        if len(calls) <= 3:
            raise sqlite3.OperationalError("database is locked")
        return migrate(db)

    monkeypatch.setattr(database, "migrate", flaky_migrate)
    with ProfileStore(tmp_path / "race.db", timeout=10) as store:
        assert store.list() == []
    assert len(calls) == 4

    calls.clear()
    monkeypatch.setattr(database, "migrate", lambda db: _always_locked(calls))
    start = time.monotonic()
    with pytest.raises(StoreLockedError, match=r"gave up after \d+\.\d s"):
        ProfileStore(tmp_path / "race2.db", timeout=0.3)
    assert time.monotonic() - start >= 0.3 and len(calls) > 1  # retried, and only gave up after the timeout


def _always_locked(calls: list) -> None:
    calls.append(time.monotonic())
    raise sqlite3.OperationalError("database is locked")
