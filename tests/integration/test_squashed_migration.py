"""The initial migration makes the schema the fifteen migrations it replaces made.

One database is migrated with the old migrations (``tests/integration/replaced/migrations``),
another with the new ``0001_initial``, each by ``manage.py migrate`` in a process of its own; then
their schemas are read from the catalog and compared. On PostgreSQL: every relation (kind, partition
key, partition bound, parent), every column (type, NOT NULL, default, identity), every constraint
(kind and definition), every index (definition, unique, valid, and the partitioned index it is a
copy of), every trigger, every function (extensions' aside), every view, every sequence (type,
start, increment, owner) and the extensions. On SQLite: ``sqlite_master``.
"""

from __future__ import annotations

import os
import pprint
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.conf import settings

from tests.support import MANAGE

pytestmark = pytest.mark.django_db

# The one intended difference: the trigger function's comment named the migration that made it.
FUNCTION_COMMENT = "-- Kept by reliable_messaging (migration 0011): see DeadLetterGroup."
FUNCTION_COMMENT_NOW = "-- Kept by reliable_messaging: see DeadLetterGroup."
# The old migration 0010 made the outbox's indexes again from what pg_get_indexdef printed of
# them, which PostgreSQL parses into another, equivalent, expression of the IN list; the new one
# has the expression Django writes (and the old one had before 0010).
REPARSED_IN = (
    "ANY (ARRAY[('pending'::character varying)::text, ('failed'::character varying)::text])",
    "ANY ((ARRAY['pending'::character varying, 'failed'::character varying])::text[])",
)


def migrate(database_url: str, old: bool) -> None:
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "DJANGO_SETTINGS_MODULE": (
            "tests.integration.replaced.settings" if old else "tests.settings"
        ),
    }
    env.pop("RM_TEST_DB_NAME", None)
    done = subprocess.run(
        [sys.executable, str(MANAGE), "migrate", "--verbosity", "0"],
        env=env,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def server() -> str:
    db = settings.DATABASES["default"]
    return (
        f"postgresql://{db['USER'] or 'postgres'}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}"
    )


@pytest.fixture
def two_databases() -> Iterator[tuple[str, str]]:
    base = os.environ.get("RM_TEST_DB_NAME", "rm_test")
    names = (f"{base}_old", f"{base}_new")
    with psycopg.connect(f"{server()}/postgres", autocommit=True) as admin:
        for name in names:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
            admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield names
    finally:
        with psycopg.connect(f"{server()}/postgres", autocommit=True) as admin:
            for name in names:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


PUBLIC = "c.relnamespace = 'public'::regnamespace"


def pg_schema(url: str) -> dict[str, Any]:
    """What the catalog of the database ``url`` says of its public schema."""
    with psycopg.connect(url) as db:

        def rows(sql: str, params: tuple[str, ...] = ()) -> list[tuple[Any, ...]]:
            return sorted(db.execute(sql, params).fetchall(), key=repr)

        relations = rows(
            "SELECT c.relname, c.relkind, pg_get_partkeydef(c.oid), "
            "pg_get_expr(c.relpartbound, c.oid), "
            "(SELECT p.relname FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhparent "
            " WHERE i.inhrelid = c.oid) "
            f"FROM pg_class c WHERE {PUBLIC} AND c.relkind IN ('r', 'p', 'v', 'm', 'f')"
        )
        # Not their order: the dead letters' later fields were added at the end of the table.
        columns = rows(
            "SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull, "
            "pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attgenerated "
            "FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
            "LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
            f"WHERE {PUBLIC} AND c.relkind IN ('r', 'p', 'v') AND a.attnum > 0 "
            "AND NOT a.attisdropped"
        )
        constraints = rows(
            "SELECT c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid) "
            f"FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid WHERE {PUBLIC}"
        )
        # An index that is a partition's copy of a partitioned index is known by that index:
        # PostgreSQL names the copies it makes, and the old migrations named some themselves.
        indexes = rows(
            "SELECT t.relname, coalesce('copy of ' || p.relname, c.relname), "
            "replace(replace(pg_get_indexdef(c.oid), c.relname, '<name>'), %s, %s), "
            "x.indisunique, "
            "x.indisvalid "
            "FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid "
            "JOIN pg_class t ON t.oid = x.indrelid "
            "LEFT JOIN pg_inherits h ON h.inhrelid = c.oid "
            f"LEFT JOIN pg_class p ON p.oid = h.inhparent WHERE {PUBLIC}",
            REPARSED_IN,
        )
        triggers = rows(
            "SELECT c.relname, g.tgname, pg_get_triggerdef(g.oid), g.tgenabled "
            "FROM pg_trigger g JOIN pg_class c ON c.oid = g.tgrelid "
            f"WHERE {PUBLIC} AND NOT g.tgisinternal"
        )
        functions = [
            (name, definition.replace(FUNCTION_COMMENT, FUNCTION_COMMENT_NOW))
            for name, definition in rows(
                "SELECT p.proname, pg_get_functiondef(p.oid) FROM pg_proc p "
                "WHERE p.pronamespace = 'public'::regnamespace AND NOT EXISTS ("
                " SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_proc'::regclass "
                " AND d.objid = p.oid AND d.deptype = 'e')"
            )
        ]
        views = rows(
            f"SELECT c.relname, pg_get_viewdef(c.oid) FROM pg_class c WHERE {PUBLIC} "
            "AND c.relkind = 'v'"
        )
        sequences = rows(
            "SELECT s.sequencename, s.data_type::text, s.start_value, s.increment_by, "
            "(SELECT t.relname || '.' || a.attname FROM pg_depend d "
            " JOIN pg_class t ON t.oid = d.refobjid "
            " JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid "
            " WHERE d.classid = 'pg_class'::regclass AND d.objid = "
            " (quote_ident(s.schemaname) || '.' || quote_ident(s.sequencename))::regclass "
            " AND d.deptype IN ('a', 'i')) "
            "FROM pg_sequences s WHERE s.schemaname = 'public'"
        )
        extensions = rows("SELECT extname FROM pg_extension")
    return {
        "relations": relations,
        "columns": columns,
        "constraints": constraints,
        "indexes": indexes,
        "triggers": triggers,
        "functions": functions,
        "views": views,
        "sequences": sequences,
        "extensions": extensions,
    }


def differences(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    found = {}
    for part in old:
        only_old = [row for row in old[part] if row not in new[part]]
        only_new = [row for row in new[part] if row not in old[part]]
        if only_old or only_new:
            found[part] = {"old only": only_old, "new only": only_new}
    return found


def test_the_initial_migration_makes_the_old_schema_on_postgresql(
    two_databases: tuple[str, str],
) -> None:
    old_name, new_name = two_databases
    old_url, new_url = f"{server()}/{old_name}", f"{server()}/{new_name}"
    migrate(old_url.replace("postgresql://", "postgres://"), old=True)
    migrate(new_url.replace("postgresql://", "postgres://"), old=False)
    old, new = pg_schema(old_url), pg_schema(new_url)
    found = differences(old, new)
    assert not found, pprint.pformat(found, width=250)
    # And it is the layout described: partitioned tables with their days, triggers, a view.
    kinds = {name: kind for name, kind, *_ in new["relations"]}
    assert kinds["reliable_messaging_processedmessage"] == "p"
    assert kinds["reliable_messaging_outboxmessage"] == "p"
    assert kinds["reliable_messaging_outboxmessage_sent"] == "p"
    assert kinds["reliable_messaging_outboxmessage_unsent"] == "r"
    assert kinds["reliable_messaging_livedeadlettergroup"] == "v"
    days = [name for name in kinds if re.fullmatch(r"reliable_messaging_\w+_p\d{8}", name)]
    assert len(days) == 2 * 9, days
    assert len(new["triggers"]) == 3
    assert len(new["indexes"]) > 100


def sqlite_schema(database: Path) -> list[tuple[str, str, str, Any]]:
    """``sqlite_master``, each table's column and constraint definitions sorted (the dead
    letters' later fields were added at the end of the table)."""
    with sqlite3.connect(database) as db:
        rows = db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall()
    normalized = []
    for kind, name, table, sql in rows:
        if kind == "table" and sql:
            head, _, body = sql.partition("(")
            normalized.append((kind, name, table, (head, sorted(split_definitions(body[:-1])))))
        else:
            normalized.append((kind, name, table, sql))
    return sorted(normalized, key=repr)


def split_definitions(body: str) -> list[str]:
    """The comma-separated definitions of a CREATE TABLE, commas within parentheses aside."""
    parts, depth, current = [], 0, ""
    for char in body:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    parts.append(current.strip())
    return parts


def test_the_initial_migration_makes_the_old_schema_on_sqlite(tmp_path: Path) -> None:
    old, new = tmp_path / "old.sqlite3", tmp_path / "new.sqlite3"
    migrate(f"sqlite:///{old}", old=True)
    migrate(f"sqlite:///{new}", old=False)
    old_schema, new_schema = sqlite_schema(old), sqlite_schema(new)
    assert [row for row in old_schema if row not in new_schema] == []
    assert [row for row in new_schema if row not in old_schema] == []
    assert any(name == "reliable_messaging_outboxmessage" for _, name, _, _ in new_schema)
