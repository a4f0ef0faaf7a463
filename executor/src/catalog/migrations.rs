//! The catalog's schema: its versioned migrations, one text per version
//! (`PRAGMA user_version` on SQLite; `postgres.rs` applies its own texts
//! and these shared ones), never edited once shipped.

use super::DbError;

/// Migration 15, one text for both engines (SQLite takes `BIGINT` as
/// INTEGER): hosts sharing the catalog (one row per daemon, `hosts.rs`). A
/// sandbox, an in-flight idempotent request and a snapshot's capture
/// belong to the host that made them (NULL: made before hosts were
/// recorded, claimed by the first daemon that registers: a catalog that
/// old was one host's). `drain` says why new work is refused there,
/// `down` why the host is down; times are Unix milliseconds.
pub(super) const MIGRATION_15: &str = r#"
    CREATE TABLE hosts (
        id           TEXT PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 64),
        machine      TEXT NOT NULL,
        root         TEXT NOT NULL,
        version      TEXT NOT NULL,
        drain        TEXT,
        down         TEXT,
        info         TEXT NOT NULL,
        started_at   BIGINT NOT NULL,
        heartbeat_at BIGINT NOT NULL,
        deadline_at  BIGINT NOT NULL
    );
    ALTER TABLE sandboxes ADD COLUMN host TEXT REFERENCES hosts(id);
    ALTER TABLE snapshots ADD COLUMN host TEXT REFERENCES hosts(id);
    ALTER TABLE idempotency ADD COLUMN host TEXT REFERENCES hosts(id);
    CREATE INDEX sandboxes_host ON sandboxes(host);
    "#;
/// Migration 16, one text for both engines: where a distributed snapshot
/// is published (its reference in the fleet registry; NULL: local).
pub(super) const MIGRATION_16: &str = "ALTER TABLE snapshots ADD COLUMN published TEXT;";

/// Migration 17, one text for both engines: a pulled layer waiting to be
/// unpacked waits on one host (its blob is in that host's store): the
/// table is keyed by host too ('' for rows older than hosts, claimed by
/// the first daemon that registers).
pub(super) const MIGRATION_17: &str = r#"
    CREATE TABLE layer_hydration_new (
        host        TEXT NOT NULL DEFAULT '',
        layer_id    TEXT NOT NULL REFERENCES layers(id) ON DELETE CASCADE,
        blob_digest TEXT NOT NULL,
        compression TEXT NOT NULL CHECK (compression IN ('gzip', 'zstd')),
        error       TEXT,
        PRIMARY KEY (host, layer_id)
    );
    INSERT INTO layer_hydration_new (layer_id, blob_digest, compression, error)
        SELECT layer_id, blob_digest, compression, error FROM layer_hydration;
    DROP TABLE layer_hydration;
    ALTER TABLE layer_hydration_new RENAME TO layer_hydration;
"#;

/// Each entry upgrades the schema by one version; never edit a shipped one.
pub(super) const MIGRATIONS: &[&str] = &[
    // 1: images, layers, sandboxes.
    r#"
    CREATE TABLE layers (
        diff_id     TEXT PRIMARY KEY CHECK (length(diff_id) = 64),
        size        INTEGER NOT NULL,
        entries     INTEGER NOT NULL,
        created_at  INTEGER NOT NULL
    );
    CREATE TABLE images (
        id              INTEGER PRIMARY KEY,
        name            TEXT NOT NULL UNIQUE,
        manifest_digest TEXT NOT NULL,
        config_digest   TEXT NOT NULL,
        config          TEXT NOT NULL,
        created_at      INTEGER NOT NULL
    );
    CREATE TABLE image_layers (
        image_id    INTEGER NOT NULL REFERENCES images(id) ON DELETE CASCADE,
        position    INTEGER NOT NULL,
        diff_id     TEXT NOT NULL REFERENCES layers(diff_id) ON DELETE RESTRICT,
        blob_digest TEXT NOT NULL,
        PRIMARY KEY (image_id, position)
    );
    CREATE INDEX image_layers_diff_id ON image_layers(diff_id);
    CREATE TABLE sandboxes (
        id          TEXT PRIMARY KEY CHECK (length(id) = 16),
        image_id    INTEGER NOT NULL REFERENCES images(id) ON DELETE RESTRICT,
        state       TEXT NOT NULL CHECK (state IN ('creating', 'running', 'stopped')),
        spec        TEXT NOT NULL,
        shim_pid    INTEGER,
        shim_start  INTEGER,
        created_at  INTEGER NOT NULL
    );
    "#,
    // 2: sandboxes may be paused. SQLite cannot alter a CHECK: rebuild.
    r#"
    CREATE TABLE sandboxes_v2 (
        id          TEXT PRIMARY KEY CHECK (length(id) = 16),
        image_id    INTEGER NOT NULL REFERENCES images(id) ON DELETE RESTRICT,
        state       TEXT NOT NULL CHECK (state IN ('creating', 'running', 'paused', 'stopped')),
        spec        TEXT NOT NULL,
        shim_pid    INTEGER,
        shim_start  INTEGER,
        created_at  INTEGER NOT NULL
    );
    INSERT INTO sandboxes_v2 SELECT id, image_id, state, spec, shim_pid, shim_start, created_at FROM sandboxes;
    DROP TABLE sandboxes;
    ALTER TABLE sandboxes_v2 RENAME TO sandboxes;
    "#,
    // 3: snapshots (sealed deltas on top of an image and a parent chain).
    r#"
    CREATE TABLE snapshots (
        id             TEXT PRIMARY KEY CHECK (length(id) = 16),
        image_id       INTEGER NOT NULL REFERENCES images(id) ON DELETE RESTRICT,
        parent_id      TEXT REFERENCES snapshots(id) ON DELETE RESTRICT,
        diff_id        TEXT NOT NULL REFERENCES layers(diff_id) ON DELETE RESTRICT,
        blob_digest    TEXT NOT NULL,
        blob_size      INTEGER NOT NULL,
        compression    TEXT NOT NULL CHECK (compression IN ('zstd', 'gzip')),
        state          TEXT NOT NULL CHECK (state IN ('ready')),
        source_sandbox TEXT NOT NULL,
        info           TEXT NOT NULL,
        created_at     INTEGER NOT NULL
    );
    CREATE INDEX snapshots_parent ON snapshots(parent_id);
    CREATE INDEX snapshots_diff_id ON snapshots(diff_id);
    "#,
    // 4: a suspended sandbox's snapshot is usable (its layer is in place)
    // before its blob is written; this row marks the blob as pending.
    r#"
    CREATE TABLE snapshot_blob_pending (
        snapshot_id TEXT PRIMARY KEY REFERENCES snapshots(id) ON DELETE CASCADE
    );
    "#,
    // 5: the exec log. Records outlive their sandbox (snapshots seal them).
    r#"
    CREATE TABLE exec_records (
        id           INTEGER PRIMARY KEY,
        sandbox_id   TEXT NOT NULL,
        argv         TEXT NOT NULL,
        cwd          TEXT NOT NULL,
        started_at   REAL NOT NULL,
        duration_ms  REAL NOT NULL,
        exit_code    INTEGER NOT NULL,
        output_bytes INTEGER NOT NULL
    );
    CREATE INDEX exec_records_sandbox ON exec_records(sandbox_id, id);
    "#,
    // 6: a layer has an id: its directory under layers/. Content-addressed
    // layers (image layers, checkpoints) are named by their diff_id; a
    // suspended sandbox's upper is moved in as it is under 's<snapshot id>'
    // and its diff_id is filled in when its blob is sealed, so suspending
    // never reads file data. SQLite cannot change a key: rebuild the three
    // tables (foreign keys are off while migrations run, checked after).
    r#"
    CREATE TABLE layers_new (
        id          TEXT PRIMARY KEY
                    CHECK (length(id) = 64 OR (length(id) = 17 AND substr(id, 1, 1) = 's')),
        diff_id     TEXT CHECK (diff_id IS NULL OR length(diff_id) = 64),
        size        INTEGER NOT NULL,
        entries     INTEGER NOT NULL,
        created_at  INTEGER NOT NULL,
        CHECK (length(id) = 17 OR diff_id IS id)
    );
    INSERT INTO layers_new SELECT diff_id, diff_id, size, entries, created_at FROM layers;
    CREATE TABLE image_layers_new (
        image_id    INTEGER NOT NULL REFERENCES images(id) ON DELETE CASCADE,
        position    INTEGER NOT NULL,
        layer_id    TEXT NOT NULL REFERENCES layers(id) ON DELETE RESTRICT,
        blob_digest TEXT NOT NULL,
        PRIMARY KEY (image_id, position)
    );
    INSERT INTO image_layers_new SELECT image_id, position, diff_id, blob_digest FROM image_layers;
    CREATE TABLE snapshots_new (
        id             TEXT PRIMARY KEY CHECK (length(id) = 16),
        image_id       INTEGER NOT NULL REFERENCES images(id) ON DELETE RESTRICT,
        parent_id      TEXT REFERENCES snapshots(id) ON DELETE RESTRICT,
        layer_id       TEXT NOT NULL REFERENCES layers(id) ON DELETE RESTRICT,
        blob_digest    TEXT NOT NULL,
        blob_size      INTEGER NOT NULL,
        compression    TEXT NOT NULL CHECK (compression IN ('zstd', 'gzip')),
        state          TEXT NOT NULL CHECK (state IN ('ready')),
        source_sandbox TEXT NOT NULL,
        info           TEXT NOT NULL,
        created_at     INTEGER NOT NULL
    );
    INSERT INTO snapshots_new SELECT id, image_id, parent_id, diff_id, blob_digest, blob_size, compression, state,
        source_sandbox, info, created_at FROM snapshots;
    DROP TABLE image_layers;
    DROP TABLE snapshots;
    DROP TABLE layers;
    ALTER TABLE layers_new RENAME TO layers;
    ALTER TABLE image_layers_new RENAME TO image_layers;
    ALTER TABLE snapshots_new RENAME TO snapshots;
    CREATE INDEX image_layers_layer ON image_layers(layer_id);
    CREATE INDEX snapshots_parent ON snapshots(parent_id);
    CREATE INDEX snapshots_layer ON snapshots(layer_id);
    "#,
    // 7: lineage (docs/design.md "Lineage invariants"). A work context is one
    // lineage: every sandbox works for one, its checkpoints append to it
    // fenced on the head the sandbox observed, and restores follow its
    // ladder (head, then the snapshot it began from, then the image). A
    // snapshot is a checkpoint (of a work context) or a baseline (of a key):
    // CHECKs keep the two shapes apart; partial unique indexes allow one
    // ready head per lineage and one ready baseline per key. Existing
    // snapshots become checkpoints of one work context per source sandbox.
    r#"
    CREATE TABLE work_contexts (
        id          TEXT PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 64),
        image_id    INTEGER NOT NULL REFERENCES images(id) ON DELETE RESTRICT,
        start_kind  TEXT NOT NULL CHECK (start_kind IN ('image', 'baseline', 'fork')),
        start_id    TEXT,
        head_id     TEXT REFERENCES snapshots(id) ON DELETE RESTRICT,
        head_seq    INTEGER NOT NULL DEFAULT 0,
        state       TEXT NOT NULL CHECK (state IN ('active', 'retired')),
        created_at  INTEGER NOT NULL,
        used_at     INTEGER NOT NULL,
        retired_at  INTEGER,
        CHECK ((start_kind = 'image') = (start_id IS NULL)),
        CHECK ((state = 'retired') = (retired_at IS NOT NULL))
    );
    INSERT INTO work_contexts (id, image_id, start_kind, state, created_at, used_at)
        SELECT source_sandbox, MIN(image_id), 'image', 'active', MIN(created_at), MAX(created_at)
        FROM snapshots GROUP BY source_sandbox;
    CREATE TABLE snapshots_new (
        id             TEXT PRIMARY KEY CHECK (length(id) = 16),
        image_id       INTEGER NOT NULL REFERENCES images(id) ON DELETE RESTRICT,
        parent_id      TEXT REFERENCES snapshots(id) ON DELETE RESTRICT,
        layer_id       TEXT NOT NULL REFERENCES layers(id) ON DELETE RESTRICT,
        blob_digest    TEXT NOT NULL,
        blob_size      INTEGER NOT NULL,
        compression    TEXT NOT NULL CHECK (compression IN ('zstd', 'gzip')),
        class          TEXT NOT NULL CHECK (class IN ('baseline', 'checkpoint')),
        state          TEXT NOT NULL
                       CHECK (state IN ('capturing', 'ready', 'superseded', 'retired', 'failed', 'deleting')),
        work_context   TEXT REFERENCES work_contexts(id) ON DELETE RESTRICT,
        sequence       INTEGER,
        predecessor_id TEXT,
        owner          TEXT,
        repo           TEXT,
        ref            TEXT,
        commit_id      TEXT,
        evidence       TEXT,
        source_sandbox TEXT NOT NULL,
        info           TEXT NOT NULL,
        created_at     INTEGER NOT NULL,
        retired_at     INTEGER,
        deleted_at     INTEGER,
        CHECK (class != 'checkpoint' OR (work_context IS NOT NULL AND sequence IS NOT NULL
            AND owner IS NULL AND repo IS NULL AND ref IS NULL AND commit_id IS NULL AND evidence IS NULL)),
        CHECK (class != 'baseline' OR (work_context IS NULL AND sequence IS NULL AND predecessor_id IS NULL
            AND owner IS NOT NULL AND repo IS NOT NULL AND ref IS NOT NULL AND commit_id IS NOT NULL
            AND evidence IS NOT NULL))
    );
    INSERT INTO snapshots_new (id, image_id, parent_id, layer_id, blob_digest, blob_size, compression, class, state,
            work_context, sequence, predecessor_id, source_sandbox, info, created_at)
        SELECT id, image_id, parent_id, layer_id, blob_digest, blob_size, compression, 'checkpoint',
            CASE WHEN ROW_NUMBER() OVER (PARTITION BY source_sandbox ORDER BY created_at DESC, id DESC) = 1
                THEN 'ready' ELSE 'superseded' END,
            source_sandbox, ROW_NUMBER() OVER (PARTITION BY source_sandbox ORDER BY created_at, id),
            NULL, source_sandbox, info, created_at
        FROM snapshots;
    UPDATE snapshots_new SET predecessor_id = (SELECT p.id FROM snapshots_new p
        WHERE p.work_context = snapshots_new.work_context AND p.sequence = snapshots_new.sequence - 1);
    DROP TABLE snapshots;
    ALTER TABLE snapshots_new RENAME TO snapshots;
    CREATE INDEX snapshots_parent ON snapshots(parent_id);
    CREATE INDEX snapshots_layer ON snapshots(layer_id);
    CREATE UNIQUE INDEX snapshots_sequence ON snapshots(work_context, sequence);
    CREATE UNIQUE INDEX snapshots_one_head ON snapshots(work_context)
        WHERE class = 'checkpoint' AND state = 'ready';
    CREATE UNIQUE INDEX snapshots_one_baseline ON snapshots(owner, repo, image_id, ref)
        WHERE class = 'baseline' AND state = 'ready';
    UPDATE work_contexts SET
        head_id = (SELECT s.id FROM snapshots s WHERE s.work_context = work_contexts.id AND s.state = 'ready'),
        head_seq = (SELECT MAX(s.sequence) FROM snapshots s WHERE s.work_context = work_contexts.id);
    CREATE TABLE restores (
        id            INTEGER PRIMARY KEY,
        work_context  TEXT NOT NULL REFERENCES work_contexts(id) ON DELETE CASCADE,
        sandbox_id    TEXT NOT NULL,
        rung          TEXT NOT NULL CHECK (rung IN ('head', 'baseline', 'fork', 'image', 'snapshot', 'rollback')),
        snapshot_id   TEXT,
        observed_head TEXT,
        created_at    INTEGER NOT NULL,
        CHECK ((rung = 'image') = (snapshot_id IS NULL))
    );
    CREATE INDEX restores_work_context ON restores(work_context, id);
    "#,
    // 8: layers a pull recorded before hydrating them (their blob is in
    // blobs/, verified against digest and diff_id; the tree is unpacked in
    // the background or by the first launch that needs it). `error` holds
    // why an unpack failed.
    r#"
    CREATE TABLE layer_hydration (
        layer_id    TEXT PRIMARY KEY REFERENCES layers(id) ON DELETE CASCADE,
        blob_digest TEXT NOT NULL,
        compression TEXT NOT NULL CHECK (compression IN ('gzip', 'zstd')),
        error       TEXT
    );
    "#,
    // 9: why a restore fell past the rungs above the one it took (a JSON
    // array of reasons; NULL when it took the first one that exists).
    r#"
    ALTER TABLE restores ADD COLUMN fell TEXT;
    "#,
    // 10: idempotent requests: the first response to a key, replayed for
    // 24 h to the same request; `status` is NULL while it is in flight.
    r#"
    CREATE TABLE idempotency (
        key          TEXT PRIMARY KEY CHECK (length(key) BETWEEN 1 AND 255),
        fingerprint  TEXT NOT NULL,
        status       INTEGER,
        body         BLOB,
        created_at   INTEGER NOT NULL
    );
    "#,
    // 11: sealed results. An exec record keeps its output (bounded; `cut`
    // counts the bytes past the limit). A snapshot may be retained (gc
    // keeps it whatever its age) and labelled; evaluations record a
    // command run against it. Both go with their snapshot. Snapshot states
    // tell the truth: a checkpoint is a row from the start of its capture
    // (`capturing`, no place in its lineage yet: its sequence is given when
    // it is appended; a capture that fails is `failed` and never gets one),
    // and a removal is `deleting` until its files are gone. SQLite cannot
    // alter a CHECK: rebuild (as migration 7 did).
    r#"
    ALTER TABLE exec_records ADD COLUMN stdout BLOB;
    ALTER TABLE exec_records ADD COLUMN stderr BLOB;
    ALTER TABLE exec_records ADD COLUMN output_cut INTEGER NOT NULL DEFAULT 0;
    CREATE TABLE snapshots_new (
        id             TEXT PRIMARY KEY CHECK (length(id) = 16),
        image_id       INTEGER NOT NULL REFERENCES images(id) ON DELETE RESTRICT,
        parent_id      TEXT REFERENCES snapshots(id) ON DELETE RESTRICT,
        layer_id       TEXT NOT NULL REFERENCES layers(id) ON DELETE RESTRICT,
        blob_digest    TEXT NOT NULL,
        blob_size      INTEGER NOT NULL,
        compression    TEXT NOT NULL CHECK (compression IN ('zstd', 'gzip')),
        class          TEXT NOT NULL CHECK (class IN ('baseline', 'checkpoint')),
        state          TEXT NOT NULL
                       CHECK (state IN ('capturing', 'ready', 'superseded', 'retired', 'failed', 'deleting')),
        work_context   TEXT REFERENCES work_contexts(id) ON DELETE RESTRICT,
        sequence       INTEGER,
        predecessor_id TEXT,
        owner          TEXT,
        repo           TEXT,
        ref            TEXT,
        commit_id      TEXT,
        evidence       TEXT,
        source_sandbox TEXT NOT NULL,
        info           TEXT NOT NULL,
        created_at     INTEGER NOT NULL,
        retired_at     INTEGER,
        deleted_at     INTEGER,
        retained       INTEGER NOT NULL DEFAULT 0 CHECK (retained IN (0, 1)),
        CHECK (class != 'checkpoint' OR (work_context IS NOT NULL
            AND (sequence IS NOT NULL OR state IN ('capturing', 'failed', 'deleting'))
            AND owner IS NULL AND repo IS NULL AND ref IS NULL AND commit_id IS NULL AND evidence IS NULL)),
        CHECK (class != 'baseline' OR (work_context IS NULL AND sequence IS NULL AND predecessor_id IS NULL
            AND owner IS NOT NULL AND repo IS NOT NULL AND ref IS NOT NULL AND commit_id IS NOT NULL
            AND evidence IS NOT NULL)),
        CHECK ((state = 'capturing') <= (sequence IS NULL AND retired_at IS NULL))
    );
    INSERT INTO snapshots_new (id, image_id, parent_id, layer_id, blob_digest, blob_size, compression, class, state,
            work_context, sequence, predecessor_id, owner, repo, ref, commit_id, evidence, source_sandbox, info,
            created_at, retired_at, deleted_at)
        SELECT id, image_id, parent_id, layer_id, blob_digest, blob_size, compression, class, state,
            work_context, sequence, predecessor_id, owner, repo, ref, commit_id, evidence, source_sandbox, info,
            created_at, retired_at, deleted_at
        FROM snapshots;
    DROP TABLE snapshots;
    ALTER TABLE snapshots_new RENAME TO snapshots;
    CREATE INDEX snapshots_parent ON snapshots(parent_id);
    CREATE INDEX snapshots_layer ON snapshots(layer_id);
    CREATE UNIQUE INDEX snapshots_sequence ON snapshots(work_context, sequence);
    CREATE UNIQUE INDEX snapshots_one_head ON snapshots(work_context)
        WHERE class = 'checkpoint' AND state = 'ready';
    CREATE UNIQUE INDEX snapshots_one_baseline ON snapshots(owner, repo, image_id, ref)
        WHERE class = 'baseline' AND state = 'ready';
    CREATE TABLE snapshot_labels (
        snapshot_id TEXT NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
        key         TEXT NOT NULL CHECK (length(key) BETWEEN 1 AND 128),
        value       TEXT NOT NULL CHECK (length(value) <= 1024),
        PRIMARY KEY (snapshot_id, key)
    );
    CREATE TABLE evaluations (
        id          INTEGER PRIMARY KEY,
        snapshot_id TEXT NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
        name        TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 128),
        version     TEXT NOT NULL CHECK (length(version) BETWEEN 1 AND 128),
        argv        TEXT NOT NULL,
        exit_code   INTEGER NOT NULL,
        timed_out   INTEGER NOT NULL CHECK (timed_out IN (0, 1)),
        duration_ms REAL NOT NULL,
        stdout      BLOB NOT NULL,
        stderr      BLOB NOT NULL,
        output_cut  INTEGER NOT NULL,
        result      TEXT,
        result_error TEXT,
        created_at  INTEGER NOT NULL
    );
    CREATE INDEX evaluations_snapshot ON evaluations(snapshot_id, name, version, id);
    "#,
    // 12: exec records a pull brought (a pulled snapshot's log) are marked:
    // they name the sandbox that ran them on another host, or on this one
    // when a host pulls back what it pushed, and are never that live
    // sandbox's own log.
    r#"
    ALTER TABLE exec_records ADD COLUMN pulled INTEGER NOT NULL DEFAULT 0 CHECK (pulled IN (0, 1));
    "#,
    // 13: sandboxes made through the E2B-compatible API (e2b/): who made
    // each (a hash of its API key), its envd token, its options, and the
    // Strata sandbox running it (NULL while paused: its files are the head
    // of its work context). E2B snapshots are checkpoints with an owner.
    r#"
    CREATE TABLE e2b_sandboxes (
        id           TEXT PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 64),
        owner        TEXT NOT NULL CHECK (length(owner) = 64),
        token        TEXT NOT NULL,
        template     TEXT NOT NULL,
        work_context TEXT NOT NULL UNIQUE,
        spec         TEXT NOT NULL,
        sandbox      TEXT UNIQUE,
        started_at   INTEGER NOT NULL
    );
    CREATE TABLE e2b_snapshots (
        id         TEXT PRIMARY KEY REFERENCES snapshots(id) ON DELETE CASCADE,
        owner      TEXT NOT NULL CHECK (length(owner) = 64),
        sandbox    TEXT NOT NULL,
        name       TEXT,
        created_at INTEGER NOT NULL
    );
    CREATE INDEX e2b_snapshots_owner ON e2b_snapshots(owner, created_at);
    "#,
    // 14: a suspend's layer, once sealed, is looked up by its content (a
    // layer already holding the same tar takes its place: stored once).
    r#"
    CREATE INDEX layers_diff_id ON layers(diff_id);
    "#,
    // 15: hosts (above).
    MIGRATION_15,
    // 16: published snapshots (above).
    MIGRATION_16,
    // 17: layers waiting to be unpacked, per host (above).
    MIGRATION_17,
    // 18: manifests to delete from the fleet registry (`catalog/manifests.rs`).
    super::manifests::MIGRATION_18,
    // 19: envd's process table (`db/e2b.rs`).
    super::e2b::MIGRATION_19,
    // 20: a lineage ends retired, or closed as completed, cancelled or
    // failed (`retired_at`: when it ended). SQLite cannot alter a CHECK:
    // rebuild (foreign keys are off while migrating; the references to
    // `work_contexts` resolve to the new table once it takes the name).
    r#"
    CREATE TABLE work_contexts_new (
        id          TEXT PRIMARY KEY CHECK (length(id) BETWEEN 1 AND 64),
        image_id    INTEGER NOT NULL REFERENCES images(id) ON DELETE RESTRICT,
        start_kind  TEXT NOT NULL CHECK (start_kind IN ('image', 'baseline', 'fork')),
        start_id    TEXT,
        head_id     TEXT REFERENCES snapshots(id) ON DELETE RESTRICT,
        head_seq    INTEGER NOT NULL DEFAULT 0,
        state       TEXT NOT NULL CHECK (state IN ('active', 'retired', 'completed', 'cancelled', 'failed')),
        created_at  INTEGER NOT NULL,
        used_at     INTEGER NOT NULL,
        retired_at  INTEGER,
        CHECK ((start_kind = 'image') = (start_id IS NULL)),
        CHECK ((state = 'active') = (retired_at IS NULL))
    );
    INSERT INTO work_contexts_new (id, image_id, start_kind, start_id, head_id, head_seq, state, created_at,
            used_at, retired_at)
        SELECT id, image_id, start_kind, start_id, head_id, head_seq, state, created_at, used_at, retired_at
        FROM work_contexts;
    DROP TABLE work_contexts;
    ALTER TABLE work_contexts_new RENAME TO work_contexts;
    "#,
];

/// Bring a SQLite catalog to the newest schema.
pub(super) fn migrate_sqlite(conn: &mut rusqlite::Connection) -> Result<(), DbError> {
    let current: usize = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(|e| DbError::Migrate { version: 0, source: e.into() })?;
    if current > MIGRATIONS.len() {
        return Err(DbError::TooNew { found: current, known: MIGRATIONS.len() });
    }
    // Table rebuilds drop tables others refer to: foreign keys are off
    // while migrating (the pragma is a no-op inside a transaction) and
    // checked before each commit.
    let fk = |conn: &rusqlite::Connection, on: bool, version| {
        conn.pragma_update(None, "foreign_keys", if on { "ON" } else { "OFF" })
            .map_err(|e| DbError::Migrate { version, source: e.into() })
    };
    fk(conn, false, current)?;
    let result = (|| {
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(current) {
            let version = i + 1;
            let err = |e: rusqlite::Error| DbError::Migrate { version, source: e.into() };
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Exclusive).map_err(err)?;
            tx.execute_batch(sql).map_err(err)?;
            let broken = {
                use rusqlite::OptionalExtension;
                tx.query_row("PRAGMA foreign_key_check", [], |_| Ok(())).optional().map_err(err)?
            };
            if broken.is_some() {
                return Err(err(rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CONSTRAINT_FOREIGNKEY),
                    Some("a foreign key is broken after the migration".into()),
                )));
            }
            tx.pragma_update(None, "user_version", version).map_err(err)?;
            tx.commit().map_err(err)?;
        }
        Ok(())
    })();
    fk(conn, true, MIGRATIONS.len())?;
    result
}
