//! The metadata database (the catalog): SQLite (WAL) at `ROOT/strata.db`,
//! or PostgreSQL with `--database` (`db/postgres.rs`, through `db/sql.rs`).
//!
//! Owns the schema, its versioned migrations (`PRAGMA user_version`) and every
//! query. Holds no file-system state: callers write metadata first and touch
//! directories after (a start-up sweep removes directories the database does
//! not know, containerd's order).

use std::path::Path;

use rusqlite::params;
use serde::{Deserialize, Serialize};

use crate::ids::{ImageName, LayerId, SandboxId, SnapshotId};
pub use crate::model::{BlobCompression, LineageState, Rung, SandboxState, SnapshotClass, SnapshotState, StartKind};
use crate::oci::{Digest, ImageConfig};
use crate::spec::SandboxSpec;

mod e2b;
mod hosts;
mod lineages;
mod manifests;
mod postgres;
mod results;
pub mod sql;
pub use e2b::{E2bProcess, E2bSandbox, E2bSnapshot, E2bSpec};
pub use hosts::{now_ms, Beat, DownHost, HostClaim, HostRow, Place};
pub use lineages::Holder;
pub use manifests::ManifestDelete;
pub use results::{Evaluation, StoreUsage, MAX_LABEL_KEY, MAX_LABEL_VALUE};
use sql::{Conn, Optional, Row, SqlError};

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("open database {path}")]
    Open {
        path: String,
        #[source]
        source: SqlError,
    },
    #[error("migrate database to version {version}")]
    Migrate {
        version: usize,
        #[source]
        source: SqlError,
    },
    #[error("database is at schema version {found}, newer than this strata ({known}); upgrade strata")]
    TooNew { found: usize, known: usize },
    #[error("query {what}{}", removed_meanwhile(.source))]
    Query {
        what: &'static str,
        #[source]
        source: SqlError,
    },
    #[error("refused to record {0}")]
    Invalid(String),
    #[error("work context {0} was retired while a sandbox was being started in it")]
    RetiredMeanwhile(String),
    #[error(
        "lineage {work_context} is held by live {holder}: one sandbox works in a lineage at a time; \
         suspend or remove that one first, or fork its checkpoint into a new lineage"
    )]
    LineageHeld { work_context: String, holder: Holder },
    #[error(
        "host id {id:?} is held by a live daemon (root {root} on machine {machine}, last heartbeat {ago_ms} ms ago): \
         give this daemon another --host-id, or stop that one"
    )]
    HostTaken { id: String, machine: String, root: String, ago_ms: i64 },
    #[error("decode stored {what}")]
    Decode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

/// What a query that found no row says: the row it looked for was deleted
/// by another request meanwhile (a checkpoint or suspend racing `rm`).
fn removed_meanwhile(e: &SqlError) -> &'static str {
    match e {
        SqlError::NoRows => ": not found (removed while this request ran)",
        _ => "",
    }
}

impl crate::error::Classify for DbError {
    fn kind(&self) -> crate::error::ErrorKind {
        match self {
            // The row a request was working on was deleted by another
            // request meanwhile (a checkpoint or suspend racing `rm`): that
            // object is gone, not the daemon broken.
            DbError::Query { source: SqlError::NoRows, .. } => crate::error::ErrorKind::NotFound,
            DbError::RetiredMeanwhile(_) | DbError::LineageHeld { .. } => crate::error::ErrorKind::Conflict,
            _ => crate::error::ErrorKind::of_host_failure(self),
        }
    }
}

fn q(what: &'static str) -> impl FnOnce(SqlError) -> DbError {
    move |source| DbError::Query { what, source }
}

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
const MIGRATIONS: &[&str] = &[
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
    // 7: lineage (DESIGN.md "Lineage invariants"). A work context is one
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
    // 18: manifests to delete from the fleet registry (`db/manifests.rs`).
    manifests::MIGRATION_18,
    // 19: envd's process table (`db/e2b.rs`).
    e2b::MIGRATION_19,
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

pub struct Db {
    conn: Conn,
    /// The host this connection acts for (`hosts.rs`).
    host: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LayerRow {
    /// Its directory under `layers/`: the diff_id hex for a content-addressed
    /// layer, `s<snapshot id>` for a suspended sandbox's upper.
    pub id: LayerId,
    /// sha256 hex of its tar; `None` until a suspended layer is sealed.
    pub diff_id: Option<Digest>,
    pub size: u64,
    pub entries: u64,
}

impl LayerRow {
    /// A layer named by its content (`id`: its diff_id).
    pub fn content(id: LayerId, size: u64, entries: u64) -> LayerRow {
        LayerRow { diff_id: id.digest(), id, size, entries }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ImageRow {
    pub id: i64,
    pub name: String,
    pub manifest_digest: Digest,
    pub config_digest: Digest,
    pub config: ImageConfig,
    /// Layer diff_ids (also their layer ids), bottom first (OCI order).
    pub layers: Vec<LayerId>,
    /// The digest of each layer's compressed blob, as imported or pulled
    /// (kept in `blobs/` since imports keep them).
    pub blobs: Vec<Digest>,
    pub created_at: i64,
}

/// One command run in a sandbox, as the exec log keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecRecord {
    pub id: i64,
    pub sandbox_id: String,
    pub argv: Vec<String>,
    pub cwd: String,
    /// Unix time, seconds.
    pub started_at: f64,
    pub duration_ms: f64,
    /// Shell convention (128 + signal).
    pub exit_code: i32,
    pub output_bytes: u64,
    /// Its output as kept (absent unless asked for, or from before
    /// outputs were kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<crate::model::KeptOutput>,
}

/// A sealed snapshot: one delta layer on top of its parent (or its image).
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotRow {
    pub id: SnapshotId,
    pub image_id: i64,
    /// The snapshot below it in its layer chain (the base it ran on).
    pub parent_id: Option<SnapshotId>,
    /// A checkpoint (of a work context) or a baseline (of a key).
    pub class: SnapshotClass,
    /// Set by the database's lineage rules.
    pub state: SnapshotState,
    /// A checkpoint's lineage, its place in it and the head it replaced.
    pub work_context: Option<String>,
    pub sequence: Option<i64>,
    pub predecessor_id: Option<SnapshotId>,
    /// A baseline's key, commit and validation evidence.
    pub baseline: Option<Baseline>,
    /// The id of its own delta layer (its directory under `layers/`).
    pub layer: LayerId,
    /// That layer's diff_id; `None` while a suspend's layer is sealing.
    pub diff_id: Option<Digest>,
    /// The compressed blob's digest (its file in `blobs/sha256/`); `None`
    /// while a suspend's blob is being sealed (stored as an empty text).
    pub blob_digest: Option<Digest>,
    pub blob_size: u64,
    pub compression: BlobCompression,
    pub source_sandbox: String,
    /// Capture statistics and timings (JSON).
    pub info: serde_json::Value,
    pub created_at: i64,
}

impl SnapshotRow {
    /// A new snapshot of `layer`, taken from sandbox `source` (which ran on
    /// `parent`). Its class, state and lineage or baseline fields are set
    /// when it is recorded (`append_checkpoint`, `publish_baseline`); its
    /// blob fields once the blob is written.
    pub fn new(
        image_id: i64,
        parent_id: Option<SnapshotId>,
        layer: &LayerRow,
        source: &SandboxId,
        info: serde_json::Value,
    ) -> SnapshotRow {
        SnapshotRow {
            id: SnapshotId::random(),
            image_id,
            parent_id,
            class: SnapshotClass::Checkpoint,
            state: SnapshotState::Ready,
            work_context: None,
            sequence: None,
            predecessor_id: None,
            baseline: None,
            layer: layer.id.clone(),
            diff_id: layer.diff_id.clone(),
            blob_digest: None,
            blob_size: 0,
            compression: BlobCompression::Zstd,
            source_sandbox: source.to_string(),
            info,
            created_at: now(),
        }
    }
}

/// What makes a snapshot a baseline: its key (owner, repo, the snapshot's
/// image, canonical ref), the commit it was validated at, and the evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    pub owner: String,
    pub repo: String,
    #[serde(rename = "ref")]
    pub git_ref: String,
    pub commit: String,
    pub evidence: serde_json::Value,
}

/// One lineage (a work context).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkContextRow {
    pub id: String,
    pub image_id: i64,
    /// What the lineage began from.
    pub start_kind: StartKind,
    /// The baseline or fork origin it began from (none for `image`).
    pub start_id: Option<SnapshotId>,
    /// Its ready head (the last checkpoint appended).
    pub head_id: Option<SnapshotId>,
    pub head_seq: i64,
    pub state: LineageState,
    pub created_at: i64,
    pub used_at: i64,
    pub retired_at: Option<i64>,
}

/// The columns [`work_context_row`] reads, in its order.
pub(crate) const WORK_CONTEXT_COLUMNS: &str =
    "id, image_id, start_kind, start_id, head_id, head_seq, state, created_at, used_at, retired_at";

pub(crate) fn work_context_row(r: &Row<'_>) -> Result<WorkContextRow, SqlError> {
    Ok(WorkContextRow {
        id: r.get(0)?,
        image_id: r.get(1)?,
        start_kind: r.get(2)?,
        start_id: r.get(3)?,
        head_id: r.get(4)?,
        head_seq: r.get(5)?,
        state: r.get(6)?,
        created_at: r.get(7)?,
        used_at: r.get(8)?,
        retired_at: r.get(9)?,
    })
}

impl WorkContextRow {
    /// A new, active lineage with no head yet.
    pub fn new(id: &str, image_id: i64, start_kind: StartKind, start_id: Option<&SnapshotId>) -> WorkContextRow {
        WorkContextRow {
            id: id.into(),
            image_id,
            start_kind,
            start_id: start_id.cloned(),
            head_id: None,
            head_seq: 0,
            state: LineageState::Active,
            created_at: 0,
            used_at: 0,
            retired_at: None,
        }
    }
}

/// One activation of a lineage: which snapshot (or the image) seeded which
/// sandbox, by which rung of the ladder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestoreRow {
    pub id: i64,
    pub work_context: String,
    pub sandbox_id: String,
    pub rung: Rung,
    pub snapshot_id: Option<SnapshotId>,
    /// The head the sandbox observed: its next append is fenced on it.
    pub observed_head: Option<SnapshotId>,
    pub created_at: i64,
    /// The rungs above this one that could not be restored, and why
    /// (`head 0123456789abcdef: layer ... is missing from the store`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fell: Vec<String>,
}

/// Why an append to a lineage was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fence {
    /// Another activation advanced the head since this sandbox observed it.
    Moved { work_context: String, observed: Option<SnapshotId>, head: Option<SnapshotId> },
    /// The lineage has ended (retired, or closed as `state`).
    Ended { work_context: String, state: LineageState },
}

impl std::fmt::Display for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |h: &Option<SnapshotId>| h.as_ref().map_or_else(|| "none".to_string(), |h| h.to_string());
        match self {
            Fence::Moved { work_context, observed, head } => write!(
                f,
                "work context {work_context} moved on: this sandbox observed head {} but the head is now {} \
                 (another sandbox of the lineage appended first)",
                show(observed),
                show(head)
            ),
            Fence::Ended { work_context, state } => write!(f, "work context {work_context} is {state}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRow {
    pub id: SandboxId,
    pub image_id: i64,
    pub state: SandboxState,
    pub spec: SandboxSpec,
    pub shim_pid: Option<i32>,
    pub shim_start: Option<u64>,
    pub created_at: i64,
}

fn insert_layer(tx: &Conn, layer: &LayerRow) -> Result<(), DbError> {
    tx.execute(
        "INSERT INTO layers (id, diff_id, size, entries, created_at) VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT DO NOTHING",
        params![layer.id, layer.diff_id.as_ref().map(Digest::hex), layer.size as i64, layer.entries as i64, now()],
    )
    .map_err(q("insert layer"))?;
    Ok(())
}

/// A live sandbox's lineage and the head it observed, as its row says.
fn sandbox_lineage_in(conn: &Conn, id: &SandboxId) -> Result<(Option<String>, Option<SnapshotId>), DbError> {
    conn.query_row(
        "SELECT json_extract(spec, '$.work_context'), json_extract(spec, '$.observed_head') FROM sandboxes WHERE id = ?1",
        params![id.as_str()],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
    .map_err(q("sandbox lineage"))
}

/// A lineage's head, its sequence number and its state.
/// A digest column: `sha256:<hex>` text, or (`hex_only`) its 64 hex
/// characters (a layer's diff_id). NULL or empty while there is none yet;
/// anything else malformed is an error.
pub(crate) fn digest_column(r: &Row<'_>, col: usize, hex_only: bool) -> Result<Option<Digest>, SqlError> {
    match r.get::<_, Option<String>>(col)? {
        None => Ok(None),
        Some(s) if s.is_empty() => Ok(None),
        Some(s) => {
            let text = if hex_only { format!("sha256:{s}") } else { s };
            text.parse()
                .map(Some)
                .map_err(|e| SqlError::Decode { col, source: rusqlite::types::FromSqlError::Other(Box::new(e)) })
        }
    }
}

fn lineage_head_in(conn: &Conn, wc: &str) -> Result<(Option<SnapshotId>, i64, LineageState), DbError> {
    conn.query_row("SELECT head_id, head_seq, state FROM work_contexts WHERE id = ?1", params![wc], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?))
    })
    .map_err(q("work context head"))
}

/// The fence an append to lineage `wc` by a sandbox that observed
/// `observed` meets, given the lineage's `head` and `state`.
fn fence(wc: &str, observed: &Option<SnapshotId>, head: &Option<SnapshotId>, state: LineageState) -> Option<Fence> {
    if state != LineageState::Active {
        Some(Fence::Ended { work_context: wc.into(), state })
    } else if head != observed {
        Some(Fence::Moved { work_context: wc.into(), observed: observed.clone(), head: head.clone() })
    } else {
        None
    }
}

fn ready_baseline_in(
    conn: &Conn,
    owner: &str,
    repo: &str,
    image_id: i64,
    git_ref: &str,
) -> Result<Option<String>, DbError> {
    conn.query_row(
        "SELECT id FROM snapshots WHERE class = 'baseline' AND state = 'ready' \
         AND owner = ?1 AND repo = ?2 AND image_id = ?3 AND ref = ?4",
        params![owner, repo, image_id, git_ref],
        |r| r.get(0),
    )
    .optional()
    .map_err(q("ready baseline"))
}

/// Insert a snapshot row as it is (its class, state, lineage and baseline
/// fields set by the caller; the schema's CHECKs keep them consistent).
fn insert_snapshot_row(tx: &Conn, snap: &SnapshotRow, info: &str, host: Option<&str>) -> Result<(), DbError> {
    let b = snap.baseline.as_ref();
    let evidence = b
        .map(|b| serde_json::to_string(&b.evidence))
        .transpose()
        .map_err(|source| DbError::Decode { what: "baseline evidence", source })?;
    tx.execute(
        "INSERT INTO snapshots (id, image_id, parent_id, layer_id, blob_digest, blob_size, compression, class, state, \
         work_context, sequence, predecessor_id, owner, repo, ref, commit_id, evidence, source_sandbox, info, \
         created_at, host) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, \
         ?20, ?21)",
        params![
            snap.id,
            snap.image_id,
            snap.parent_id,
            snap.layer,
            snap.blob_digest.as_ref().map_or("", Digest::as_str),
            snap.blob_size as i64,
            snap.compression,
            snap.class,
            snap.state,
            snap.work_context,
            snap.sequence,
            snap.predecessor_id,
            b.map(|b| &b.owner),
            b.map(|b| &b.repo),
            b.map(|b| &b.git_ref),
            b.map(|b| &b.commit),
            evidence,
            snap.source_sandbox,
            info,
            snap.created_at,
            host
        ],
    )
    .map_err(q("insert snapshot"))?;
    Ok(())
}

fn insert_image_in(
    tx: &Conn,
    name: &ImageName,
    manifest_digest: &Digest,
    config_digest: &Digest,
    config: &str,
    layers: &[(LayerRow, Digest)],
) -> Result<i64, DbError> {
    let image_id: i64 = tx
        .query_row(
            "INSERT INTO images (name, manifest_digest, config_digest, config, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5) RETURNING id",
            params![name.as_str(), manifest_digest, config_digest, config, now()],
            |r| r.get(0),
        )
        .map_err(q("insert image"))?;
    for (pos, (layer, blob)) in layers.iter().enumerate() {
        insert_layer(tx, layer)?;
        tx.execute(
            "INSERT INTO image_layers (image_id, position, layer_id, blob_digest) VALUES (?1, ?2, ?3, ?4)",
            params![image_id, pos as i64, layer.id, blob],
        )
        .map_err(q("insert image layer"))?;
    }
    Ok(image_id)
}

/// The image a pull recreates: found by manifest digest and layers, or
/// inserted under `name` (or `name`'s repository with the manifest digest's
/// first 12 hex digits as tag, if `name` is taken by another image).
pub struct PulledImage {
    pub name: ImageName,
    pub manifest_digest: Digest,
    pub config_digest: Digest,
    pub config: ImageConfig,
    pub layers: Vec<(LayerRow, Digest)>,
}

/// A snapshot a pull recreates, with its layer and its lineage's start.
pub struct PulledSnapshot {
    pub row: SnapshotRow,
    pub layer: LayerRow,
    pub start_kind: StartKind,
    pub start_id: Option<SnapshotId>,
    /// Its exec log as pushed: the first `inherited` records are its
    /// ancestors' (below the pushed chain), the rest its own.
    pub log: Vec<ExecRecord>,
    pub inherited: usize,
    pub evaluations: Vec<Evaluation>,
}

/// A pulled layer whose tree is not unpacked yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unhydrated {
    pub layer_id: LayerId,
    pub blob_digest: Digest,
    pub compression: BlobCompression,
    pub error: Option<String>,
}

/// Why a pull cannot be recorded on this host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PullConflict {
    #[error("snapshot {id} exists on this host with other content (layer {here}, pulled {pulled})")]
    Differs { id: SnapshotId, here: String, pulled: String },
    #[error("lineage {work_context} has another checkpoint ({here}) at sequence {sequence} on this host: the lineages diverged")]
    Diverged { work_context: String, sequence: i64, here: String },
    #[error("image names {0:?} are taken by other images")]
    ImageName(Vec<String>),
    #[error("snapshot {0} is being removed on this host; pull again once it is gone")]
    BeingRemoved(SnapshotId),
}

fn insert_pulled_row(tx: &Conn, snap: &SnapshotRow, host: Option<&str>) -> Result<(), DbError> {
    let info = serde_json::to_string(&snap.info).map_err(|source| DbError::Decode { what: "snapshot info", source })?;
    insert_snapshot_row(tx, snap, &info, host)
}

/// How long an idempotency key's response is kept (24 h).
pub const IDEMPOTENCY_SECS: i64 = 24 * 3600;

/// What claiming an idempotency key found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// New: the caller runs the request and settles the key.
    Claimed,
    /// The same request is being run now.
    InFlight,
    /// The same request ran: its response.
    Done { status: u16, body: Vec<u8> },
    /// The key was used with another request.
    Mismatch,
}

/// Why a pulled baseline is not ready yet.
pub const PULLED_UNCHECKED: &str = "pulled: not yet checked on this host";

/// Delete a layer's row if no image or snapshot lists it; true if deleted.
/// The lineage a sandbox appends to; a sandbox from before lineages gets
/// its own, from now.
fn adopt_lineage_in(tx: &Conn, sandbox: &SandboxId, wc: Option<String>, image_id: i64) -> Result<String, DbError> {
    if let Some(wc) = wc {
        return Ok(wc);
    }
    tx.execute(
        "INSERT INTO work_contexts (id, image_id, start_kind, state, created_at, used_at) \
         VALUES (?1, ?2, 'image', 'active', ?3, ?3) ON CONFLICT DO NOTHING",
        params![sandbox.as_str(), image_id, now()],
    )
    .map_err(q("adopt work context"))?;
    Ok(sandbox.to_string())
}

/// Insert an exec record (its id is the database's; `pulled`: a pulled
/// snapshot's); returns the id.
fn insert_exec_record_in(conn: &Conn, r: &ExecRecord, pulled: bool) -> Result<i64, DbError> {
    let argv = serde_json::to_string(&r.argv).map_err(|source| DbError::Decode { what: "argv", source })?;
    let out = r.output.as_ref();
    conn.query_row(
        "INSERT INTO exec_records (sandbox_id, argv, cwd, started_at, duration_ms, exit_code, output_bytes, \
         stdout, stderr, output_cut, pulled) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11) RETURNING id",
        params![
            r.sandbox_id,
            argv,
            r.cwd,
            r.started_at,
            r.duration_ms,
            r.exit_code,
            r.output_bytes as i64,
            out.map(|o| &o.stdout),
            out.map(|o| &o.stderr),
            out.map_or(0, |o| o.cut as i64),
            pulled,
        ],
        |r| r.get(0),
    )
    .map_err(q("insert exec record"))
}

fn delete_layer_if_unused(tx: &Conn, id: &str) -> Result<bool, DbError> {
    let used = tx
        .query_row(
            "SELECT 1 FROM image_layers WHERE layer_id = ?1 UNION ALL SELECT 1 FROM snapshots WHERE layer_id = ?1 LIMIT 1",
            params![id],
            |_| Ok(()),
        )
        .optional()
        .map_err(q("layer users"))?
        .is_some();
    if !used {
        tx.execute("DELETE FROM layers WHERE id = ?1", params![id]).map_err(q("delete layer"))?;
    }
    Ok(!used)
}

/// Bring a SQLite catalog to the newest schema.
fn migrate_sqlite(conn: &mut rusqlite::Connection) -> Result<(), DbError> {
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

/// A connection string without its password (for messages).
pub fn redact(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://") {
        if let Some((userinfo, host)) = rest.rsplit_once('@') {
            let user = userinfo.split(':').next().unwrap_or("");
            return format!("{scheme}://{user}@{host}");
        }
        return url.to_string();
    }
    url.split_whitespace()
        .map(|kv| if kv.starts_with("password=") { "password=..." } else { kv })
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

impl Db {
    pub fn open(path: &Path) -> Result<Db, DbError> {
        let open_err = |e: rusqlite::Error| DbError::Open { path: path.display().to_string(), source: e.into() };
        let mut conn = rusqlite::Connection::open(path).map_err(open_err)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(open_err)?;
        conn.pragma_update(None, "foreign_keys", "ON").map_err(open_err)?;
        conn.pragma_update(None, "synchronous", "NORMAL").map_err(open_err)?;
        conn.busy_timeout(std::time::Duration::from_secs(5)).map_err(open_err)?;
        migrate_sqlite(&mut conn)?;
        Ok(Db { conn: Conn::sqlite(conn), host: None })
    }

    pub fn open_in_memory() -> Result<Db, DbError> {
        let open_err = |e: rusqlite::Error| DbError::Open { path: ":memory:".into(), source: e.into() };
        let mut conn = rusqlite::Connection::open_in_memory().map_err(open_err)?;
        conn.pragma_update(None, "foreign_keys", "ON").map_err(open_err)?;
        migrate_sqlite(&mut conn)?;
        Ok(Db { conn: Conn::sqlite(conn), host: None })
    }

    /// Open (and migrate) a catalog in PostgreSQL: `url` is a
    /// `postgres://` URL or a `key=value` connection string.
    pub fn open_postgres(url: &str) -> Result<Db, DbError> {
        let conn = Conn::postgres(url).map_err(|source| DbError::Open { path: redact(url), source })?;
        postgres::migrate(&conn)?;
        Ok(Db { conn, host: None })
    }

    /// See [`Conn::end_idle_transactions_after`].
    pub fn end_idle_transactions_after(&self, limit: std::time::Duration) -> Result<(), DbError> {
        self.conn.end_idle_transactions_after(limit).map_err(q("limit idle transactions"))
    }

    /// Which engine holds this catalog.
    pub fn engine(&self) -> sql::Engine {
        self.conn.engine()
    }

    /// Every table's columns and every index (`table.column`, `index
    /// NAME`), sorted: what both engines' schemas must agree on.
    pub fn schema_outline(&self) -> Result<Vec<String>, DbError> {
        let sql = match self.engine() {
            sql::Engine::Sqlite => {
                "SELECT m.name || '.' || p.name FROM sqlite_master m JOIN pragma_table_info(m.name) p \
                 WHERE m.type = 'table' AND m.name NOT LIKE 'sqlite_%' \
                 UNION ALL SELECT 'index ' || name FROM sqlite_master \
                 WHERE type = 'index' AND name NOT LIKE 'sqlite_autoindex_%'"
            }
            sql::Engine::Postgres => {
                "SELECT table_name || '.' || column_name FROM information_schema.columns \
                 WHERE table_schema = current_schema() AND table_name != 'strata_schema' \
                 UNION ALL SELECT 'index ' || indexname FROM pg_indexes \
                 WHERE schemaname = current_schema() AND indexname NOT LIKE '%_pkey' AND indexname NOT LIKE '%_key'"
            }
        };
        let mut v: Vec<String> = self.conn.query(sql, &[], |r| r.get(0)).map_err(q("schema outline"))?;
        v.sort();
        Ok(v)
    }

    pub fn schema_version(&self) -> Result<usize, DbError> {
        match self.conn.as_sqlite() {
            Some(c) => {
                c.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(|e| q("schema version")(e.into()))
            }
            None => postgres::version(&self.conn),
        }
    }

    // ---- layers and images ----

    pub fn layer_exists(&self, id: &str) -> Result<bool, DbError> {
        self.conn
            .query_row("SELECT 1 FROM layers WHERE id = ?1", params![id], |_| Ok(()))
            .optional()
            .map(|o| o.is_some())
            .map_err(q("layer exists"))
    }

    /// Whether an image layer or a snapshot lists blob `digest`.
    pub fn blob_listed(&self, digest: &str) -> Result<bool, DbError> {
        self.conn
            .query_row(
                "SELECT EXISTS (SELECT 1 FROM snapshots WHERE blob_digest = ?1) \
                 OR EXISTS (SELECT 1 FROM image_layers WHERE blob_digest = ?1)",
                params![digest],
                |r| r.get(0),
            )
            .map_err(q("blob listed"))
    }

    /// Every blob digest (`sha256:<hex>`) a snapshot or an image layer
    /// refers to.
    pub fn all_blobs(&self) -> Result<std::collections::HashSet<String>, DbError> {
        self.conn
            .query("SELECT blob_digest FROM snapshots UNION SELECT blob_digest FROM image_layers", &[], |r| r.get(0))
            .map_err(q("list blobs"))
    }

    pub fn all_layers(&self) -> Result<Vec<String>, DbError> {
        self.conn.query("SELECT id FROM layers", &[], |r| r.get(0)).map_err(q("list layers"))
    }

    /// Insert an image and any of its layers not yet known, in one transaction.
    /// Fails with a constraint error if the name is taken.
    pub fn insert_image(
        &mut self,
        name: &ImageName,
        manifest_digest: &Digest,
        config_digest: &Digest,
        config: &ImageConfig,
        layers: &[(LayerRow, Digest /* the layer's blob */)],
    ) -> Result<i64, DbError> {
        let config =
            serde_json::to_string(config).map_err(|source| DbError::Decode { what: "image config", source })?;
        let tx = self.conn.transaction(false).map_err(q("begin insert image"))?;
        let image_id = insert_image_in(&tx, name, manifest_digest, config_digest, &config, layers)?;
        tx.commit().map_err(q("commit insert image"))?;
        Ok(image_id)
    }

    fn image_from_row(&self, r: (i64, String, Digest, Digest, String, i64)) -> Result<ImageRow, DbError> {
        let (id, name, manifest_digest, config_digest, config, created_at) = r;
        let config =
            serde_json::from_str(&config).map_err(|source| DbError::Decode { what: "image config", source })?;
        let pairs: Vec<(LayerId, Digest)> = self
            .conn
            .query(
                "SELECT layer_id, blob_digest FROM image_layers WHERE image_id = ?1 ORDER BY position",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(q("image layers"))?;
        let (layers, blobs) = pairs.into_iter().unzip();
        Ok(ImageRow { id, name, manifest_digest, config_digest, config, layers, blobs, created_at })
    }

    const IMAGE_COLS: &'static str = "id, name, manifest_digest, config_digest, config, created_at";

    pub fn image_by_name(&self, name: &ImageName) -> Result<Option<ImageRow>, DbError> {
        self.image_where("name = ?1", name.as_str())
    }

    pub fn image_by_id(&self, id: i64) -> Result<Option<ImageRow>, DbError> {
        self.image_where("id = ?1", id)
    }

    fn image_where(&self, cond: &str, arg: impl rusqlite::ToSql) -> Result<Option<ImageRow>, DbError> {
        let sql = format!("SELECT {} FROM images WHERE {cond}", Self::IMAGE_COLS);
        let row = self
            .conn
            .query_row(&sql, params![arg], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)))
            .optional()
            .map_err(q("get image"))?;
        row.map(|r| self.image_from_row(r)).transpose()
    }

    pub fn list_images(&self) -> Result<Vec<ImageRow>, DbError> {
        let sql = format!("SELECT {} FROM images ORDER BY name", Self::IMAGE_COLS);
        let rows: Vec<_> = self
            .conn
            .query(&sql, &[], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?)))
            .map_err(q("list images"))?;
        rows.into_iter().map(|r| self.image_from_row(r)).collect()
    }

    /// Delete an image and return the ids of layers nothing uses any
    /// more (their rows are deleted too; the caller removes the directories).
    /// Refuses (returns `Ok(Err(users))`) while sandboxes use the image.
    pub fn delete_image(&mut self, image_id: i64) -> Result<Result<Vec<String>, Vec<String>>, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin delete image"))?;
        // Captures that failed hold nothing: they go with the image (kept
        // if anything else refuses it: the transaction is not committed).
        let failed: Vec<String> = {
            tx.query(
                "SELECT id FROM snapshots WHERE image_id = ?1 AND state = 'failed' \
                     AND json_extract(info, '$.capture_error') IS NOT NULL",
                params![image_id],
                |r| r.get(0),
            )
            .map_err(q("failed captures"))?
        };
        for id in &failed {
            let layer: String = tx
                .query_row("SELECT layer_id FROM snapshots WHERE id = ?1", params![id], |r| r.get(0))
                .map_err(q("failed capture"))?;
            tx.execute("DELETE FROM snapshots WHERE id = ?1", params![id]).map_err(q("delete failed capture"))?;
            delete_layer_if_unused(&tx, &layer)?;
        }
        let users: Vec<String> = {
            tx.query("SELECT id FROM sandboxes WHERE image_id = ?1 UNION ALL SELECT 'snapshot ' || id FROM snapshots WHERE image_id = ?1", params![image_id], |r| r.get(0)).map_err(q("image users"))?
        };
        if !users.is_empty() {
            return Ok(Err(users));
        }
        let layers: Vec<String> = {
            tx.query("SELECT DISTINCT layer_id FROM image_layers WHERE image_id = ?1", params![image_id], |r| r.get(0))
                .map_err(q("image layers"))?
        };
        // Lineages of the image that hold no snapshot go with it (with
        // their restore records); one that holds any was refused above.
        tx.execute(
            "DELETE FROM work_contexts WHERE image_id = ?1 \
             AND NOT EXISTS (SELECT 1 FROM snapshots s WHERE s.work_context = work_contexts.id)",
            params![image_id],
        )
        .map_err(q("delete image lineages"))?;
        tx.execute("DELETE FROM images WHERE id = ?1", params![image_id]).map_err(q("delete image"))?;
        let mut orphans = Vec::new();
        for l in layers {
            if delete_layer_if_unused(&tx, &l)? {
                orphans.push(l);
            }
        }
        tx.commit().map_err(q("commit delete image"))?;
        Ok(Ok(orphans))
    }

    // ---- snapshots ----

    /// Append a checkpoint of sandbox `sandbox` to its lineage, fenced: in
    /// one transaction, check that the lineage's head is still the one the
    /// sandbox observed, record the layer (if new) and the snapshot as the
    /// new ready head (the old head is superseded), and move the sandbox's
    /// observed head to it (or, with `release`, delete the sandbox's row: a
    /// suspend). With `blob_pending`, the blob is still to be written.
    /// `snap`'s lineage fields are filled in here.
    pub fn append_checkpoint(
        &mut self,
        sandbox: &SandboxId,
        snap: &mut SnapshotRow,
        layer: &LayerRow,
        blob_pending: bool,
        release: bool,
    ) -> Result<Result<(), Fence>, DbError> {
        let info =
            serde_json::to_string(&snap.info).map_err(|source| DbError::Decode { what: "snapshot info", source })?;
        let tx = self.conn.transaction(true).map_err(q("begin append"))?;
        let (wc, observed) = sandbox_lineage_in(&tx, sandbox)?;
        let wc = adopt_lineage_in(&tx, sandbox, wc, snap.image_id)?;
        let (head, seq, state) = lineage_head_in(&tx, &wc)?;
        if let Some(fence) = fence(&wc, &observed, &head, state) {
            return Ok(Err(fence));
        }
        insert_layer(&tx, layer)?;
        if let Some(h) = &head {
            tx.execute("UPDATE snapshots SET state = 'superseded', retired_at = ?2 WHERE id = ?1", params![h, now()])
                .map_err(q("supersede head"))?;
        }
        snap.class = SnapshotClass::Checkpoint;
        snap.state = SnapshotState::Ready;
        snap.work_context = Some(wc.clone());
        snap.sequence = Some(seq + 1);
        snap.predecessor_id = head;
        // A capture's row exists since it began (`begin_capture`): it gets
        // its layer, blob, info and place in the lineage now, and its
        // placeholder layer row goes.
        let capturing: Option<String> = tx
            .query_row("SELECT layer_id FROM snapshots WHERE id = ?1 AND state = 'capturing'", params![&snap.id], |r| {
                r.get(0)
            })
            .optional()
            .map_err(q("capturing row"))?;
        match capturing {
            Some(placeholder) => {
                tx.execute(
                    "UPDATE snapshots SET layer_id = ?2, blob_digest = ?3, blob_size = ?4, compression = ?5, \
                     state = 'ready', sequence = ?6, predecessor_id = ?7, info = ?8 WHERE id = ?1",
                    params![
                        snap.id,
                        snap.layer,
                        snap.blob_digest.as_ref().map_or("", Digest::as_str),
                        snap.blob_size as i64,
                        snap.compression,
                        snap.sequence,
                        snap.predecessor_id,
                        info
                    ],
                )
                .map_err(q("complete capture"))?;
                delete_layer_if_unused(&tx, &placeholder)?;
            }
            None => insert_snapshot_row(&tx, snap, &info, self.host.as_deref())?,
        }
        tx.execute(
            "UPDATE work_contexts SET head_id = ?2, head_seq = ?3, used_at = ?4 WHERE id = ?1",
            params![wc, snap.id, seq + 1, now()],
        )
        .map_err(q("advance head"))?;
        if blob_pending {
            tx.execute("INSERT INTO snapshot_blob_pending (snapshot_id) VALUES (?1)", params![&snap.id])
                .map_err(q("mark blob pending"))?;
        }
        if release {
            tx.execute("DELETE FROM e2b_processes WHERE sandbox = ?1", params![sandbox.as_str()])
                .map_err(q("delete its e2b processes"))?;
            tx.execute("DELETE FROM sandboxes WHERE id = ?1", params![sandbox.as_str()])
                .map_err(q("delete sandbox"))?;
        } else {
            tx.execute(
                "UPDATE sandboxes SET spec = json_set(spec, '$.work_context', ?2, '$.observed_head', ?3) WHERE id = ?1",
                params![sandbox.as_str(), wc, snap.id],
            )
            .map_err(q("move observed head"))?;
        }
        tx.commit().map_err(q("commit append"))?;
        Ok(Ok(()))
    }

    /// Begin a checkpoint's capture, fenced as its append will be: `snap`
    /// is recorded `capturing` in the sandbox's lineage (visible, never
    /// restorable, no sequence yet) with a placeholder layer row named by
    /// its id (`s<id>`, no directory); `append_checkpoint` completes it,
    /// `capture_failed` ends it.
    pub fn begin_capture(
        &mut self,
        sandbox: &SandboxId,
        image_id: i64,
        parent: Option<SnapshotId>,
    ) -> Result<Result<SnapshotId, Fence>, DbError> {
        let id = SnapshotId::random();
        let placeholder = LayerRow { id: LayerId::suspended(&id), diff_id: None, size: 0, entries: 0 };
        let mut snap = SnapshotRow::new(image_id, parent, &placeholder, sandbox, serde_json::json!({}));
        snap.id = id;
        let info = "{}";
        let tx = self.conn.transaction(true).map_err(q("begin capture"))?;
        let (wc, observed) = sandbox_lineage_in(&tx, sandbox)?;
        let wc = adopt_lineage_in(&tx, sandbox, wc, snap.image_id)?;
        let (head, _, state) = lineage_head_in(&tx, &wc)?;
        if let Some(fence) = fence(&wc, &observed, &head, state) {
            return Ok(Err(fence));
        }
        insert_layer(&tx, &placeholder)?;
        snap.state = SnapshotState::Capturing;
        snap.work_context = Some(wc);
        insert_snapshot_row(&tx, &snap, info, self.host.as_deref())?;
        tx.commit().map_err(q("commit begin capture"))?;
        Ok(Ok(snap.id))
    }

    /// A capture that will not complete: `failed`, with why in its info
    /// (`capture_error`). It never had a place in its lineage and holds
    /// nothing: it keeps no parent (so it never keeps its parent from
    /// being removed) and goes with its image; gc takes it after
    /// retention. No-op unless it is still capturing.
    pub fn capture_failed(&self, id: &str, why: &str) -> Result<(), DbError> {
        self.conn
            .execute(
                "UPDATE snapshots SET state = 'failed', retired_at = ?3, parent_id = NULL, \
                 info = json_set(info, '$.capture_error', ?2) WHERE id = ?1 AND state = 'capturing'",
                params![id, why, now()],
            )
            .map_err(q("capture failed"))?;
        Ok(())
    }

    /// At start-up: captures a stopped daemon left half-way are failed.
    pub fn fail_interrupted_captures(&self) -> Result<usize, DbError> {
        self.conn
            .execute(
                "UPDATE snapshots SET state = 'failed', retired_at = ?1, parent_id = NULL, \
                 info = json_set(info, '$.capture_error', 'the daemon stopped during the capture') \
                 WHERE state = 'capturing' AND (CAST(?2 AS TEXT) IS NULL OR host = ?2)",
                params![now(), self.host],
            )
            .map_err(q("fail interrupted captures"))
    }

    /// Record a pulled chain in one transaction: its image (found or
    /// inserted), layers, lineages and snapshots (root first, same ids).
    /// Snapshots the host has are checked, not rewritten. A pulled
    /// checkpoint's lineage metadata is a claim: it becomes its lineage's
    /// head only through the fence a local append meets (the head here is
    /// the predecessor it names, and it is further along), or as the first
    /// row of a lineage the pull brought; otherwise it lands outside the
    /// lineage (`info.outside_lineage` says why). A baseline is ready unless
    /// its key already has a ready one. The first snapshot's parent is kept only if the host
    /// has it (a compacted layer needs nothing below it).
    pub fn record_pull(
        &mut self,
        image: &PulledImage,
        snaps: &mut [PulledSnapshot],
        unhydrated: &[Unhydrated],
    ) -> Result<Result<i64, PullConflict>, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin pull"))?;
        let want: Vec<&str> = image.layers.iter().map(|(l, _)| l.id.as_str()).collect();
        let candidates: Vec<i64> = {
            tx.query("SELECT id FROM images WHERE manifest_digest = ?1", params![&image.manifest_digest], |r| r.get(0))
                .map_err(q("find image"))?
        };
        let mut image_id = None;
        for id in candidates {
            let layers: Vec<String> = tx
                .query("SELECT layer_id FROM image_layers WHERE image_id = ?1 ORDER BY position", params![id], |r| {
                    r.get(0)
                })
                .map_err(q("image layers"))?;
            if layers == want {
                image_id = Some(id);
                break;
            }
        }
        let image_id = match image_id {
            Some(id) => id,
            None => {
                let hex12: String = image.manifest_digest.hex().chars().take(12).collect();
                let base = image.name.as_str().rsplit_once(':').map_or(image.name.as_str(), |(n, _)| n);
                let names: Vec<String> = vec![image.name.to_string(), format!("{base}:{hex12}")];
                let free = names.iter().find(|n| {
                    tx.query_row("SELECT 1 FROM images WHERE name = ?1", params![n], |_| Ok(())).optional().ok()
                        == Some(None)
                });
                let Some(free) = free else {
                    return Ok(Err(PullConflict::ImageName(names)));
                };
                let name: ImageName = free.parse().map_err(|_| DbError::Invalid(format!("image name {free:?}")))?;
                let config = serde_json::to_string(&image.config)
                    .map_err(|source| DbError::Decode { what: "image config", source })?;
                insert_image_in(&tx, &name, &image.manifest_digest, &image.config_digest, &config, &image.layers)?
            }
        };
        let mut inserted = Vec::new();
        // Lineages this pull made on this host.
        let mut fresh: Vec<String> = Vec::new();
        for p in snaps.iter_mut() {
            let pulled = p.layer.id.to_string();
            let here: Option<(Option<String>, SnapshotState)> = tx
                .query_row(
                    "SELECT l.diff_id, s.state FROM snapshots s JOIN layers l ON l.id = s.layer_id WHERE s.id = ?1",
                    params![&p.row.id],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )
                .optional()
                .map_err(q("pulled snapshot"))?;
            if let Some((_, SnapshotState::Deleting)) = here {
                return Ok(Err(PullConflict::BeingRemoved(p.row.id.clone())));
            }
            if let Some((here, _)) = here {
                if here.as_deref() != Some(pulled.as_str()) {
                    let here = here.unwrap_or_else(|| "sealing".into());
                    return Ok(Err(PullConflict::Differs { id: p.row.id.clone(), here, pulled }));
                }
                continue;
            }
            if let Some(parent) = p.row.parent_id.clone() {
                let known: Option<SnapshotState> = tx
                    .query_row("SELECT state FROM snapshots WHERE id = ?1", params![&parent], |r| r.get(0))
                    .optional()
                    .map_err(q("pulled parent"))?;
                match known {
                    None => p.row.parent_id = None,
                    Some(SnapshotState::Deleting) => return Ok(Err(PullConflict::BeingRemoved(parent))),
                    Some(_) => {}
                }
            }
            insert_layer(&tx, &p.layer)?;
            inserted.push(p.row.id.clone());
            // Its log: its own records, and its ancestors' too when this
            // host lacks them (its parent was not kept). Inserted in one
            // transaction, their ids are one range: its segment.
            let keep = if p.row.parent_id.is_none() { 0 } else { p.inherited.min(p.log.len()) };
            let mut range = (0, 0);
            for (i, r) in p.log[keep..].iter().enumerate() {
                let id = insert_exec_record_in(&tx, r, true)?;
                range = (if i == 0 { id - 1 } else { range.0 }, id);
            }
            if let Some(o) = p.row.info.as_object_mut() {
                o.insert("log_from".into(), range.0.into());
                o.insert("log_upto".into(), range.1.into());
                o.insert("log_pulled".into(), true.into());
            }
            p.row.image_id = image_id;
            p.row.layer = p.layer.id.clone();
            p.row.diff_id = p.layer.diff_id.clone();
            match (&p.row.work_context, p.row.sequence, &p.row.baseline) {
                (Some(wc), Some(seq), _) => {
                    let made = tx
                        .execute(
                            "INSERT INTO work_contexts (id, image_id, start_kind, start_id, state, created_at, \
                             used_at) VALUES (?1, ?2, ?3, ?4, 'active', ?5, ?5) ON CONFLICT DO NOTHING",
                            params![wc, image_id, p.start_kind, p.start_id, now()],
                        )
                        .map_err(q("pulled lineage"))?;
                    if made > 0 {
                        fresh.push(wc.clone());
                    }
                    let other: Option<String> = tx
                        .query_row(
                            "SELECT id FROM snapshots WHERE work_context = ?1 AND sequence = ?2",
                            params![wc, seq],
                            |r| r.get(0),
                        )
                        .optional()
                        .map_err(q("pulled sequence"))?;
                    if let Some(here) = other {
                        return Ok(Err(PullConflict::Diverged { work_context: wc.clone(), sequence: seq, here }));
                    }
                    let (head, head_seq, state) = lineage_head_in(&tx, wc)?;
                    // What its metadata says its lineage's head was when it
                    // was appended there: a claim, checked against this
                    // host's head.
                    let claimed = p.row.predecessor_id.clone();
                    // The fenced append a local checkpoint takes: the head
                    // here must be its predecessor. A lineage this pull
                    // brought to the host has nothing here to protect: its
                    // first row becomes its head whatever it claims.
                    let outside = if seq <= head_seq {
                        Some(format!("its sequence {seq} is not past the head's here ({head_seq})"))
                    } else if head.is_none() && fresh.contains(wc) {
                        None
                    } else {
                        let show = |h: &Option<SnapshotId>| h.as_ref().map_or("none".to_string(), |h| h.to_string());
                        fence(wc, &claimed, &head, state).map(|f| match f {
                            Fence::Ended { state, .. } => format!("work context {wc} is {state} here"),
                            Fence::Moved { .. } => format!(
                                "it follows {} in work context {wc}, but the head here is {}",
                                show(&claimed),
                                show(&head)
                            ),
                        })
                    };
                    if let Some(why) = outside {
                        if let Some(o) = p.row.info.as_object_mut() {
                            o.insert("outside_lineage".into(), why.into());
                        }
                        p.row.state = SnapshotState::Superseded;
                        insert_pulled_row(&tx, &p.row, self.host.as_deref())?;
                    } else {
                        if let Some(h) = &head {
                            tx.execute(
                                "UPDATE snapshots SET state = 'superseded', retired_at = ?2 WHERE id = ?1",
                                params![h, now()],
                            )
                            .map_err(q("supersede head"))?;
                        }
                        p.row.state = SnapshotState::Ready;
                        insert_pulled_row(&tx, &p.row, self.host.as_deref())?;
                        tx.execute(
                            "UPDATE work_contexts SET head_id = ?2, head_seq = ?3, used_at = ?4 WHERE id = ?1",
                            params![wc, p.row.id, seq, now()],
                        )
                        .map_err(q("advance head"))?;
                    }
                }
                (_, _, Some(_)) => {
                    // Not eligible for new work until this host checked it
                    // (`Daemon::admit_pulled_baseline`).
                    p.row.state = SnapshotState::Superseded;
                    p.row.info["ineligible"] = serde_json::json!(PULLED_UNCHECKED);
                    insert_pulled_row(&tx, &p.row, self.host.as_deref())?;
                }
                _ => return Err(DbError::Invalid(format!("pulled snapshot {} has neither lineage nor key", p.row.id))),
            }
        }
        for p in snaps.iter() {
            // Only with the snapshot rows this pull inserted.
            if inserted.contains(&p.row.id) {
                for e in &p.evaluations {
                    results::insert_evaluation_in(&tx, &Evaluation { snapshot: p.row.id.to_string(), ..e.clone() })?;
                }
            }
        }
        for u in unhydrated {
            let used = tx
                .query_row("SELECT 1 FROM layers WHERE id = ?1", params![&u.layer_id], |_| Ok(()))
                .optional()
                .map_err(q("unhydrated layer"))?;
            if used.is_some() {
                tx.execute(
                    "INSERT INTO layer_hydration (host, layer_id, blob_digest, compression) VALUES (?4, ?1, ?2, ?3) \
                     ON CONFLICT DO NOTHING",
                    params![u.layer_id, u.blob_digest, u.compression, self.host.as_deref().unwrap_or("")],
                )
                .map_err(q("mark layer unhydrated"))?;
            }
        }
        tx.commit().map_err(q("commit pull"))?;
        Ok(Ok(image_id))
    }

    /// A layer still to be hydrated: its blob digest, compression and the
    /// last unpack error.
    pub fn unhydrated(&self, layer_id: &str) -> Result<Option<Unhydrated>, DbError> {
        self.conn
            .query_row(
                "SELECT layer_id, blob_digest, compression, error FROM layer_hydration WHERE layer_id = ?1 AND host = ?2",
                params![layer_id, self.hydration_host()],
                |r| {
                    Ok(Unhydrated {
                        layer_id: r.get(0)?,
                        blob_digest: r.get(1)?,
                        compression: r.get(2)?,
                        error: r.get(3)?,
                    })
                },
            )
            .optional()
            .map_err(q("unhydrated layer"))
    }

    /// Every layer still to be hydrated (with `errors`, also those whose
    /// unpack failed).
    pub fn unhydrated_layers_with(&self, errors: bool) -> Result<Vec<LayerId>, DbError> {
        let sql = if errors {
            "SELECT layer_id FROM layer_hydration WHERE host = ?1"
        } else {
            "SELECT layer_id FROM layer_hydration WHERE host = ?1 AND error IS NULL"
        };
        self.conn.query(sql, params![self.hydration_host()], |r| r.get(0)).map_err(q("unhydrated layers"))
    }

    /// A layer's tree is in place: record its size and entries. False if
    /// the layer is gone (its snapshot was removed meanwhile).
    pub fn hydrated(&mut self, layer_id: &str, size: u64, entries: u64) -> Result<bool, DbError> {
        let host = self.hydration_host().to_string();
        let tx = self.conn.transaction(false).map_err(q("begin hydrated"))?;
        let n = tx
            .execute(
                "UPDATE layers SET size = ?2, entries = ?3 WHERE id = ?1",
                params![layer_id, size as i64, entries as i64],
            )
            .map_err(q("hydrated layer"))?;
        tx.execute("DELETE FROM layer_hydration WHERE layer_id = ?1 AND host = ?2", params![layer_id, host])
            .map_err(q("hydrated layer"))?;
        tx.commit().map_err(q("commit hydrated"))?;
        Ok(n == 1)
    }

    pub fn hydration_failed(&self, layer_id: &str, error: &str) -> Result<(), DbError> {
        self.conn
            .execute(
                "UPDATE layer_hydration SET error = ?2 WHERE layer_id = ?1 AND host = ?3",
                params![layer_id, error, self.hydration_host()],
            )
            .map_err(q("hydration failed"))?;
        Ok(())
    }

    const SNAP_SELECT: &'static str = "SELECT s.id, s.image_id, s.parent_id, s.layer_id, l.diff_id, s.blob_digest, \
         s.blob_size, s.compression, s.source_sandbox, s.info, s.created_at, s.class, s.state, s.work_context, \
         s.sequence, s.predecessor_id, s.owner, s.repo, s.ref, s.commit_id, s.evidence \
         FROM snapshots s JOIN layers l ON l.id = s.layer_id";

    fn snapshot_from(r: &Row<'_>) -> Result<(SnapshotRow, String), SqlError> {
        Ok((
            SnapshotRow {
                id: r.get(0)?,
                image_id: r.get(1)?,
                parent_id: r.get(2)?,
                layer: r.get(3)?,
                diff_id: digest_column(r, 4, true)?,
                blob_digest: digest_column(r, 5, false)?,
                blob_size: r.get::<_, i64>(6)? as u64,
                compression: r.get(7)?,
                source_sandbox: r.get(8)?,
                info: serde_json::Value::Null,
                created_at: r.get(10)?,
                class: r.get(11)?,
                state: r.get(12)?,
                work_context: r.get(13)?,
                sequence: r.get(14)?,
                predecessor_id: r.get(15)?,
                baseline: match (r.get::<_, Option<String>>(16)?, r.get::<_, Option<String>>(20)?) {
                    (Some(owner), Some(evidence)) => Some(Baseline {
                        owner,
                        repo: r.get(17)?,
                        git_ref: r.get(18)?,
                        commit: r.get(19)?,
                        evidence: serde_json::from_str(&evidence).unwrap_or(serde_json::Value::Null),
                    }),
                    _ => None,
                },
            },
            r.get(9)?,
        ))
    }

    fn decode_snapshot((mut row, info): (SnapshotRow, String)) -> Result<SnapshotRow, DbError> {
        row.info = serde_json::from_str(&info).map_err(|source| DbError::Decode { what: "snapshot info", source })?;
        Ok(row)
    }

    pub fn snapshot(&self, id: &str) -> Result<Option<SnapshotRow>, DbError> {
        let sql = format!("{} WHERE s.id = ?1", Self::SNAP_SELECT);
        let row = self.conn.query_row(&sql, params![id], Self::snapshot_from).optional().map_err(q("get snapshot"))?;
        row.map(Self::decode_snapshot).transpose()
    }

    pub fn list_snapshots(&self) -> Result<Vec<SnapshotRow>, DbError> {
        let sql = format!("{} ORDER BY s.created_at, s.id", Self::SNAP_SELECT);
        let rows: Vec<_> = self.conn.query(&sql, &[], Self::snapshot_from).map_err(q("list snapshots"))?;
        rows.into_iter().map(Self::decode_snapshot).collect()
    }

    /// The blob of a sealing snapshot is written and its layer known: record
    /// both (the layer's diff_id, size and entries; the snapshot's digest,
    /// size and info).
    pub fn set_snapshot_blob(
        &mut self,
        id: &str,
        digest: &str,
        size: u64,
        layer: &LayerRow,
        info: &serde_json::Value,
    ) -> Result<(), DbError> {
        let info = serde_json::to_string(info).map_err(|source| DbError::Decode { what: "snapshot info", source })?;
        let tx = self.conn.transaction(false).map_err(q("begin set blob"))?;
        tx.execute(
            "UPDATE layers SET diff_id = ?2, size = ?3, entries = ?4 WHERE id = ?1",
            params![layer.id, layer.diff_id.as_ref().map(Digest::hex), layer.size as i64, layer.entries as i64],
        )
        .map_err(q("set layer diff_id"))?;
        tx.execute(
            "UPDATE snapshots SET blob_digest = ?2, blob_size = ?3, info = ?4 WHERE id = ?1",
            params![id, digest, size as i64, info],
        )
        .map_err(q("set snapshot blob"))?;
        tx.execute("DELETE FROM snapshot_blob_pending WHERE snapshot_id = ?1", params![id])
            .map_err(q("clear pending"))?;
        tx.commit().map_err(q("commit set blob"))
    }

    /// Sealed suspends whose layer (`s<id>`) another layer holds already
    /// (the same diff_id, fully hydrated): what [`Db::share_layer`] folds.
    pub fn duplicate_suspended_layers(&self) -> Result<Vec<String>, DbError> {
        self.conn
            .query(
                "SELECT s.id FROM snapshots s JOIN layers l ON l.id = s.layer_id \
                 WHERE substr(l.id, 1, 1) = 's' AND l.diff_id IS NOT NULL AND EXISTS ( \
                   SELECT 1 FROM layers o WHERE o.diff_id = l.diff_id AND o.id != l.id \
                   AND o.id NOT IN (SELECT layer_id FROM layer_hydration WHERE host = ?1)) \
                 AND (CAST(?2 AS TEXT) IS NULL OR s.host = ?2) \
                 ORDER BY s.created_at, s.id",
                params![self.hydration_host(), self.host],
                |r| r.get(0),
            )
            .map_err(q("duplicate layers"))
    }

    /// If snapshot `id`'s layer is a sealed suspend's (`s<id>`) and another
    /// layer has the same content (diff_id; one named by it preferred, and
    /// hydrated), the snapshot lists that one instead and the suspend's
    /// row goes. Returns the layer no longer listed (its directory is the
    /// collector's). The caller makes sure nothing mounts or reads it;
    /// `present` says whether a layer's directory is there (a removal
    /// deletes it before its row).
    pub fn share_layer(&mut self, id: &str, present: impl Fn(&str) -> bool) -> Result<Option<String>, DbError> {
        let host = self.hydration_host().to_string();
        let tx = self.conn.transaction(true).map_err(q("begin share"))?;
        let own: Option<(String, String)> = tx
            .query_row(
                "SELECT l.id, l.diff_id FROM snapshots s JOIN layers l ON l.id = s.layer_id \
                 WHERE s.id = ?1 AND substr(l.id, 1, 1) = 's' AND l.diff_id IS NOT NULL",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(q("snapshot layer"))?;
        let Some((own, diff_id)) = own else { return Ok(None) };
        let candidates: Vec<String> = {
            tx.query(
                "SELECT id FROM layers WHERE diff_id = ?1 AND id != ?2 \
                     AND id NOT IN (SELECT layer_id FROM layer_hydration WHERE host = ?3) \
                     ORDER BY id = diff_id DESC, created_at, id",
                params![&diff_id, &own, &host],
                |r| r.get(0),
            )
            .map_err(q("layers by content"))?
        };
        let other = candidates.into_iter().find(|c| present(c));
        let Some(other) = other else { return Ok(None) };
        tx.execute("UPDATE snapshots SET layer_id = ?2 WHERE layer_id = ?1", params![&own, &other])
            .map_err(q("share layer"))?;
        let gone = delete_layer_if_unused(&tx, &own)?;
        tx.commit().map_err(q("commit share"))?;
        Ok(gone.then_some(own))
    }

    /// A suspended snapshot whose layer cannot be serialised (what the
    /// sandbox left there, e.g. a tree too deep): its blob will never come.
    /// Records why in `info` and takes it off the pending list, so a push
    /// fails at once with the reason instead of waiting.
    /// A snapshot whose blob can never be written (its tree cannot be
    /// sealed: too deep, a device node, a reserved name): `failed`, with
    /// the reason in its info. If it is its lineage's head, the head goes
    /// back to the snapshot it replaced (ready again) or to none (the
    /// lineage's start): a resume of the work context never lands on it,
    /// and a sandbox that observed it is fenced out of the lineage. It can
    /// still be resumed or forked by id.
    pub fn set_seal_failed(&mut self, id: &str, info: &serde_json::Value) -> Result<(), DbError> {
        let info = serde_json::to_string(info).map_err(|source| DbError::Decode { what: "snapshot info", source })?;
        let tx = self.conn.transaction(true).map_err(q("begin seal failed"))?;
        let (wc, predecessor): (Option<String>, Option<String>) = tx
            .query_row("SELECT work_context, predecessor_id FROM snapshots WHERE id = ?1", params![id], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .map_err(q("snapshot of a failed seal"))?;
        tx.execute(
            "UPDATE snapshots SET info = ?2, state = 'failed', retired_at = ?3 WHERE id = ?1",
            params![id, info, now()],
        )
        .map_err(q("set seal error"))?;
        tx.execute("DELETE FROM snapshot_blob_pending WHERE snapshot_id = ?1", params![id])
            .map_err(q("clear pending"))?;
        if let Some(wc) = wc {
            let head: Option<String> = tx
                .query_row("SELECT head_id FROM work_contexts WHERE id = ?1", params![&wc], |r| r.get(0))
                .optional()
                .map_err(q("lineage head"))?
                .flatten();
            if head.as_deref() == Some(id) {
                let back = match &predecessor {
                    Some(p) => {
                        let n = tx
                            .execute(
                                "UPDATE snapshots SET state = 'ready', retired_at = NULL \
                                 WHERE id = ?1 AND state = 'superseded'",
                                params![p],
                            )
                            .map_err(q("restore the previous head"))?;
                        (n == 1).then(|| p.clone())
                    }
                    None => None,
                };
                tx.execute("UPDATE work_contexts SET head_id = ?2 WHERE id = ?1", params![wc, back])
                    .map_err(q("move the head back"))?;
            }
        }
        tx.commit().map_err(q("commit seal failed"))
    }

    /// Snapshots whose blob is not written yet.
    pub fn pending_blobs(&self) -> Result<Vec<String>, DbError> {
        self.conn.query("SELECT snapshot_id FROM snapshot_blob_pending", &[], |r| r.get(0)).map_err(q("pending blobs"))
    }

    pub fn blob_pending(&self, id: &str) -> Result<bool, DbError> {
        self.conn
            .query_row("SELECT 1 FROM snapshot_blob_pending WHERE snapshot_id = ?1", params![id], |_| Ok(()))
            .optional()
            .map(|o| o.is_some())
            .map_err(q("blob pending"))
    }

    /// The layers a resume of `id` mounts above the image, root first: its
    /// chain up to (and including) the nearest compacted snapshot, whose one
    /// layer already holds everything below it.
    pub fn snapshot_layer_chain(&self, id: &str) -> Result<Vec<SnapshotRow>, DbError> {
        let mut chain = Vec::new();
        let mut cur = Some(id.to_string());
        while let Some(c) = cur {
            let Some(row) = self.snapshot(&c)? else { break };
            let compacted = row.info["compacted"].as_bool().unwrap_or(false);
            cur = if compacted { None } else { row.parent_id.as_deref().map(str::to_string) };
            chain.push(row);
        }
        chain.reverse();
        Ok(chain)
    }

    /// The snapshot's chain, root first.
    pub fn snapshot_chain(&self, id: &str) -> Result<Vec<SnapshotRow>, DbError> {
        let mut chain = Vec::new();
        let mut cur = Some(id.to_string());
        while let Some(c) = cur {
            let Some(row) = self.snapshot(&c)? else { break };
            cur = row.parent_id.as_deref().map(str::to_string);
            chain.push(row);
        }
        chain.reverse();
        Ok(chain)
    }

    /// Begin removing a snapshot: refused (`Ok(Err(users))`, naming its
    /// child snapshots or the active lineage it heads) while anything
    /// uses it; else it is `deleting` (never restorable again) until
    /// [`Db::finish_delete_snapshot`] removes its row. Sandboxes are
    /// checked by the caller, which knows the live ones.
    pub fn begin_delete_snapshot(&mut self, id: &str) -> Result<Result<(), Vec<String>>, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin delete snapshot"))?;
        let children: Vec<String> = {
            tx.query("SELECT id FROM snapshots WHERE parent_id = ?1", params![id], |r| r.get(0))
                .map_err(q("snapshot children"))?
        };
        if !children.is_empty() {
            return Ok(Err(children));
        }
        let heads: Vec<String> = {
            let rows: Vec<(String, String)> = tx
                .query("SELECT id, state FROM work_contexts WHERE head_id = ?1", params![id], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })
                .map_err(q("snapshot lineage"))?;
            rows.into_iter()
                .filter(|(_, st)| st == "active")
                .map(|(wc, _)| format!("head of work context {wc}"))
                .collect()
        };
        if !heads.is_empty() {
            return Ok(Err(heads));
        }
        // Sandboxes started from it, on any host sharing the catalog (this
        // host's own are refused before, from its live list).
        let rows: Vec<(String, Option<String>)> = tx
            .query(
                "SELECT id, host FROM sandboxes WHERE json_extract(spec, '$.snapshot') = ?1 ORDER BY id",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(q("snapshot users"))?;
        let users: Vec<String> = rows
            .into_iter()
            .map(|(sb, host): (String, Option<String>)| match host {
                Some(h) => format!("sandbox {sb} on host {h}"),
                None => format!("sandbox {sb}"),
            })
            .collect();
        if !users.is_empty() {
            return Ok(Err(users));
        }
        // A retired lineage's head may go; the lineage keeps no pointer to it.
        tx.execute("UPDATE work_contexts SET head_id = NULL WHERE head_id = ?1", params![id])
            .map_err(q("clear head"))?;
        tx.execute("UPDATE snapshots SET state = 'deleting', deleted_at = ?2 WHERE id = ?1", params![id, now()])
            .map_err(q("mark deleting"))?;
        tx.commit().map_err(q("commit begin delete"))?;
        Ok(Ok(()))
    }

    /// What only this snapshot holds: its layer (if no image and no other
    /// snapshot lists it) and its blob (likewise).
    pub fn held_only_by(&self, id: &str) -> Result<(Option<String>, Option<String>), DbError> {
        self.conn
            .query_row(
                "SELECT CASE WHEN EXISTS (SELECT 1 FROM image_layers WHERE layer_id = s.layer_id) \
                   OR EXISTS (SELECT 1 FROM snapshots o WHERE o.layer_id = s.layer_id AND o.id != s.id) \
                   THEN NULL ELSE s.layer_id END, \
                 CASE WHEN s.blob_digest = '' \
                   OR EXISTS (SELECT 1 FROM image_layers WHERE blob_digest = s.blob_digest) \
                   OR EXISTS (SELECT 1 FROM snapshots o WHERE o.blob_digest = s.blob_digest AND o.id != s.id) \
                   THEN NULL ELSE s.blob_digest END \
                 FROM snapshots s WHERE s.id = ?1",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(q("snapshot's own files"))
    }

    /// Remove a `deleting` snapshot's row, and its layer's row if nothing
    /// else lists it (returned first: its directory is the caller's to
    /// remove). A published snapshot's manifest is queued for deletion
    /// from the fleet registry in the same transaction (its reference
    /// returned second: `db/manifests.rs`).
    pub fn finish_delete_snapshot(&mut self, id: &str) -> Result<(Option<String>, Option<String>), DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin finish delete"))?;
        let row: Option<(String, Option<String>)> = tx
            .query_row(
                "SELECT layer_id, published FROM snapshots WHERE id = ?1 AND state = 'deleting'",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(q("get snapshot"))?;
        let Some((layer, published)) = row else { return Ok((None, None)) };
        tx.execute("DELETE FROM snapshots WHERE id = ?1", params![id]).map_err(q("delete snapshot"))?;
        let orphan = delete_layer_if_unused(&tx, &layer)?.then_some(layer);
        if let Some(reference) = &published {
            manifests::queue(&tx, reference, id)?;
        }
        tx.commit().map_err(q("commit delete snapshot"))?;
        Ok((orphan, published))
    }

    /// Snapshots whose removal was interrupted (still `deleting`).
    pub fn deleting_snapshots(&self) -> Result<Vec<String>, DbError> {
        self.conn
            .query("SELECT id FROM snapshots WHERE state = 'deleting'", &[], |r| r.get(0))
            .map_err(q("deleting snapshots"))
    }

    /// Images still referenced by snapshots (image rm is refused for them).
    pub fn snapshots_of_image(&self, image_id: i64) -> Result<Vec<String>, DbError> {
        self.conn
            .query("SELECT id FROM snapshots WHERE image_id = ?1", params![image_id], |r| r.get(0))
            .map_err(q("image snapshots"))
    }

    // ---- lineages ----

    /// Make a work context; false if one with that id exists.
    pub fn insert_work_context(&mut self, wc: &WorkContextRow) -> Result<bool, DbError> {
        let n = self
            .conn
            .execute(
                "INSERT INTO work_contexts (id, image_id, start_kind, start_id, state, created_at, used_at) \
                 VALUES (?1, ?2, ?3, ?4, 'active', ?5, ?5) ON CONFLICT DO NOTHING",
                params![wc.id, wc.image_id, wc.start_kind, wc.start_id, now()],
            )
            .map_err(q("insert work context"))?;
        Ok(n == 1)
    }

    /// Remove a work context nothing was recorded in (a create that failed).
    pub fn delete_unused_work_context(&mut self, id: &str) -> Result<(), DbError> {
        self.conn
            .execute(
                "DELETE FROM work_contexts WHERE id = ?1 AND head_id IS NULL \
                 AND NOT EXISTS (SELECT 1 FROM snapshots WHERE work_context = ?1) \
                 AND NOT EXISTS (SELECT 1 FROM restores WHERE work_context = ?1)",
                params![id],
            )
            .map_err(q("delete work context"))?;
        Ok(())
    }

    pub fn work_context(&self, id: &str) -> Result<Option<WorkContextRow>, DbError> {
        self.conn
            .query_row(
                &format!("SELECT {WORK_CONTEXT_COLUMNS} FROM work_contexts WHERE id = ?1"),
                params![id],
                work_context_row,
            )
            .optional()
            .map_err(q("get work context"))
    }

    /// Record a started sandbox and its activation of a lineage in one
    /// transaction (one commit on the create path, not three). Refused
    /// (`LineageHeld`) while another live sandbox holds the lineage
    /// (`db/lineages.rs`).
    #[allow(clippy::too_many_arguments)]
    pub fn activate_sandbox(
        &self,
        id: &SandboxId,
        image_id: i64,
        spec: &SandboxSpec,
        shim_pid: i32,
        shim_start: u64,
        rung: Rung,
        snapshot: Option<&str>,
        fell: &[String],
    ) -> Result<(), DbError> {
        let wc = spec.work_context.as_deref().unwrap_or(id.as_str());
        let tx = self.conn.transaction(true).map_err(q("begin activate sandbox"))?;
        self.take_lineage(wc, id.as_str())?;
        self.insert_running_sandbox(id, image_id, spec, shim_pid, shim_start)?;
        self.record_restore(wc, id, (rung, snapshot, fell), spec.observed_head.as_deref())?;
        tx.commit().map_err(q("commit activate sandbox"))
    }

    fn record_restore(
        &self,
        work_context: &str,
        sandbox: &SandboxId,
        (rung, snapshot, fell): (Rung, Option<&str>, &[String]),
        observed_head: Option<&str>,
    ) -> Result<(), DbError> {
        let fell = if fell.is_empty() {
            None
        } else {
            Some(serde_json::to_string(fell).map_err(|source| DbError::Decode { what: "restore falls", source })?)
        };
        self.conn
            .execute(
                "INSERT INTO restores (work_context, sandbox_id, rung, snapshot_id, observed_head, created_at, fell) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                params![work_context, sandbox.as_str(), rung, snapshot, observed_head, now(), fell],
            )
            .map_err(q("record restore"))?;
        // A launch checked the lineage when it began; gc may have retired
        // it since (a sandbox with no row yet does not keep it).
        let n = self
            .conn
            .execute(
                "UPDATE work_contexts SET used_at = ?2 WHERE id = ?1 AND state = 'active'",
                params![work_context, now()],
            )
            .map_err(q("touch work context"))?;
        if n == 0 {
            return Err(DbError::RetiredMeanwhile(work_context.into()));
        }
        Ok(())
    }

    pub fn restores(&self, work_context: &str) -> Result<Vec<RestoreRow>, DbError> {
        self.conn
            .query(
                "SELECT id, work_context, sandbox_id, rung, snapshot_id, observed_head, created_at, fell \
                 FROM restores WHERE work_context = ?1 ORDER BY id",
                params![work_context],
                |r| {
                    Ok(RestoreRow {
                        id: r.get(0)?,
                        work_context: r.get(1)?,
                        sandbox_id: r.get(2)?,
                        rung: r.get(3)?,
                        snapshot_id: r.get(4)?,
                        observed_head: r.get(5)?,
                        created_at: r.get(6)?,
                        fell: match r.get::<_, Option<String>>(7)? {
                            None => Vec::new(),
                            Some(j) => serde_json::from_str(&j).map_err(|e| {
                                rusqlite::Error::FromSqlConversionFailure(7, rusqlite::types::Type::Text, Box::new(e))
                            })?,
                        },
                    })
                },
            )
            .map_err(q("restores"))
    }

    /// A lineage's checkpoints, in append order.
    pub fn lineage_snapshots(&self, work_context: &str) -> Result<Vec<SnapshotRow>, DbError> {
        // Captures (in progress or failed: no sequence) after the sequence.
        let sql = format!(
            "{} WHERE s.work_context = ?1 ORDER BY s.sequence IS NULL, s.sequence, s.created_at",
            Self::SNAP_SELECT
        );
        let rows: Vec<_> =
            self.conn.query(&sql, params![work_context], Self::snapshot_from).map_err(q("lineage snapshots"))?;
        rows.into_iter().map(Self::decode_snapshot).collect()
    }

    /// Retire a lineage: it and its checkpoints leave restore eligibility.
    /// False if it was retired already.
    pub fn retire_work_context(&mut self, id: &str) -> Result<bool, DbError> {
        self.retire(id, None)
    }

    /// gc's retirement of a stale lineage: only if it is still unused since
    /// `cutoff`, no sandbox row of the catalog (on any host, one marked down
    /// included) works in it and no E2B sandbox is paused in it, all checked
    /// by the retiring write itself, so a resume or checkpoint recorded
    /// since the lineage was listed keeps it (and a launch still under way
    /// fails its activation: `RetiredMeanwhile`).
    pub fn retire_stale_work_context(&mut self, id: &str, cutoff: i64) -> Result<bool, DbError> {
        self.retire(id, Some(cutoff))
    }

    fn retire(&mut self, id: &str, stale_before: Option<i64>) -> Result<bool, DbError> {
        self.end(id, LineageState::Retired, stale_before)
    }

    /// Close an active lineage as `outcome` (completed, cancelled,
    /// failed): its checkpoints leave restore position as a retirement's
    /// do, and retention counts from now. `Err(state)`: it had ended
    /// already, as `state`.
    pub fn close_work_context(&mut self, id: &str, outcome: LineageState) -> Result<Result<(), LineageState>, DbError> {
        if self.end(id, outcome, None)? {
            return Ok(Ok(()));
        }
        let (_, _, state) = lineage_head_in(&self.conn, id)?;
        Ok(Err(state))
    }

    /// End an active lineage as `state` (its checkpoints retired with
    /// it); with `stale_before`, only as gc retires a stale one.
    fn end(&mut self, id: &str, state: LineageState, stale_before: Option<i64>) -> Result<bool, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin retire"))?;
        let n = tx
            .execute(
                "UPDATE work_contexts SET state = ?4, retired_at = ?2 WHERE id = ?1 AND state = 'active' \
                 AND (CAST(?3 AS BIGINT) IS NULL OR (used_at <= ?3 \
                      AND NOT EXISTS (SELECT 1 FROM sandboxes WHERE json_extract(spec, '$.work_context') = ?1) \
                      AND id NOT IN (SELECT work_context FROM e2b_sandboxes)))",
                params![id, now(), stale_before, state],
            )
            .map_err(q("retire work context"))?;
        if n == 1 {
            tx.execute(
                "UPDATE snapshots SET state = 'retired', retired_at = ?2 \
                 WHERE work_context = ?1 AND state IN ('ready', 'superseded')",
                params![id, now()],
            )
            .map_err(q("retire checkpoints"))?;
        }
        tx.commit().map_err(q("commit retire"))?;
        Ok(n == 1)
    }

    /// The lineage and observed head a live sandbox's row holds now.
    pub fn sandbox_lineage(&self, id: &SandboxId) -> Result<(Option<String>, Option<SnapshotId>), DbError> {
        sandbox_lineage_in(&self.conn, id)
    }

    /// Why an append by `sandbox` would be refused now, if it would (the
    /// append checks again in its transaction).
    pub fn append_fence(&self, sandbox: &SandboxId) -> Result<Option<Fence>, DbError> {
        let (Some(wc), observed) = sandbox_lineage_in(&self.conn, sandbox)? else { return Ok(None) };
        let (head, _, state) = lineage_head_in(&self.conn, &wc)?;
        Ok(fence(&wc, &observed, &head, state))
    }

    /// The ready baseline for a key, if any.
    pub fn ready_baseline(
        &self,
        owner: &str,
        repo: &str,
        image_id: i64,
        git_ref: &str,
    ) -> Result<Option<String>, DbError> {
        ready_baseline_in(&self.conn, owner, repo, image_id, git_ref)
    }

    /// Publish a baseline as the ready one for its key: a compare-and-swap
    /// on the ready baseline the publisher observed when it began. If
    /// another publisher replaced it meanwhile, `Ok(Err(current))` and
    /// nothing is written; else the old one is superseded and `snap` (with
    /// its layer) recorded, in one transaction.
    pub fn publish_baseline(
        &mut self,
        snap: &mut SnapshotRow,
        layer: &LayerRow,
        observed: Option<&str>,
    ) -> Result<Result<(), Option<String>>, DbError> {
        let b = snap.baseline.clone().expect("publish_baseline needs a baseline row");
        let info =
            serde_json::to_string(&snap.info).map_err(|source| DbError::Decode { what: "snapshot info", source })?;
        let tx = self.conn.transaction(true).map_err(q("begin publish"))?;
        let current = ready_baseline_in(&tx, &b.owner, &b.repo, snap.image_id, &b.git_ref)?;
        if current.as_deref() != observed {
            return Ok(Err(current));
        }
        insert_layer(&tx, layer)?;
        if let Some(c) = &current {
            tx.execute("UPDATE snapshots SET state = 'superseded', retired_at = ?2 WHERE id = ?1", params![c, now()])
                .map_err(q("supersede baseline"))?;
        }
        snap.class = SnapshotClass::Baseline;
        snap.state = SnapshotState::Ready;
        insert_snapshot_row(&tx, snap, &info, self.host.as_deref())?;
        tx.commit().map_err(q("commit publish"))?;
        Ok(Ok(()))
    }

    /// Make a pulled baseline (checked by the caller) the ready one of its
    /// key, by a compare-and-swap on the ready baseline the caller observed
    /// (as [`Db::publish_baseline`]); its info loses the `ineligible` mark.
    pub fn admit_baseline(&mut self, id: &str, observed: Option<&str>) -> Result<Result<(), Option<String>>, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin admit"))?;
        let (owner, repo, image_id, git_ref): (String, String, i64, String) = tx
            .query_row(
                "SELECT owner, repo, image_id, ref FROM snapshots WHERE id = ?1 AND class = 'baseline'",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .map_err(q("baseline to admit"))?;
        let current = ready_baseline_in(&tx, &owner, &repo, image_id, &git_ref)?;
        if current.as_deref() != observed {
            return Ok(Err(current));
        }
        if let Some(c) = &current {
            tx.execute("UPDATE snapshots SET state = 'superseded', retired_at = ?2 WHERE id = ?1", params![c, now()])
                .map_err(q("supersede baseline"))?;
        }
        tx.execute(
            "UPDATE snapshots SET state = 'ready', retired_at = NULL, info = json_remove(info, '$.ineligible') \
             WHERE id = ?1",
            params![id],
        )
        .map_err(q("admit baseline"))?;
        tx.commit().map_err(q("commit admit"))?;
        Ok(Ok(()))
    }

    /// Say why a snapshot is not eligible for new work (its info's
    /// `ineligible`).
    pub fn mark_ineligible(&mut self, id: &str, why: &str) -> Result<(), DbError> {
        self.conn
            .execute("UPDATE snapshots SET info = json_set(info, '$.ineligible', ?2) WHERE id = ?1", params![id, why])
            .map_err(q("mark ineligible"))?;
        Ok(())
    }

    /// Snapshots out of restore position (superseded, retired, failed) since
    /// before `cutoff` (unix seconds), newest first (children before
    /// parents).
    pub fn gc_candidates(&self, cutoff: i64) -> Result<Vec<String>, DbError> {
        self.conn
            .query(
                "SELECT id FROM snapshots WHERE state IN ('superseded', 'retired', 'failed') \
                 AND COALESCE(retired_at, created_at) <= ?1 AND retained = 0 \
                 AND id NOT IN (SELECT start_id FROM work_contexts WHERE state = 'active' AND start_id IS NOT NULL) \
                 ORDER BY created_at DESC, id",
                params![cutoff],
                |r| r.get(0),
            )
            .map_err(q("gc candidates"))
    }

    /// Active lineages neither captured nor restored since `cutoff`. An
    /// E2B sandbox's work context is never stale: it holds the sandbox's
    /// files while it is paused, and is retired when it is killed.
    pub fn stale_lineages(&self, cutoff: i64) -> Result<Vec<String>, DbError> {
        self.conn
            .query(
                "SELECT id FROM work_contexts WHERE state = 'active' AND used_at <= ?1 \
                 AND id NOT IN (SELECT work_context FROM e2b_sandboxes) ORDER BY id",
                params![cutoff],
                |r| r.get(0),
            )
            .map_err(q("stale lineages"))
    }

    // ---- exec log ----

    pub fn insert_exec_record(&self, r: &ExecRecord) -> Result<(), DbError> {
        insert_exec_record_in(&self.conn, r, false).map(|_| ())
    }

    /// Insert exec records in order: one transaction for them all, or, if
    /// that fails, each on its own, so one that cannot be written does not
    /// take the others with it. The error is the last record's that failed.
    pub fn insert_exec_records(&self, records: &[ExecRecord]) -> Result<(), DbError> {
        if let [one] = records {
            return self.insert_exec_record(one);
        }
        let batch = (|| {
            let tx = self.conn.transaction(true).map_err(q("begin exec records"))?;
            for r in records {
                insert_exec_record_in(&tx, r, false)?;
            }
            tx.commit().map_err(q("commit exec records"))
        })();
        if batch.is_ok() {
            return batch;
        }
        records.iter().map(|r| self.insert_exec_record(r)).filter(Result::is_err).last().unwrap_or(Ok(()))
    }

    /// Exec records with `from < id <= upto` (`upto` `None`: all after
    /// `from`) of one sandbox (or, `None`, of any: a pulled snapshot's),
    /// oldest first; with their output if `output`.
    pub fn exec_records(
        &self,
        sandbox_id: Option<&str>,
        from: i64,
        upto: Option<i64>,
        output: bool,
    ) -> Result<Vec<ExecRecord>, DbError> {
        const COLUMNS: &str = "SELECT id, sandbox_id, argv, cwd, started_at, duration_ms, exit_code, output_bytes, \
                 CASE WHEN ?4 THEN stdout END, CASE WHEN ?4 THEN stderr END, output_cut FROM exec_records";
        let sql = match sandbox_id {
            Some(_) => format!("{COLUMNS} WHERE sandbox_id = ?1 AND pulled = 0 AND id > ?2 AND id <= ?3 ORDER BY id"),
            None => format!("{COLUMNS} WHERE CAST(?1 AS TEXT) IS NULL AND id > ?2 AND id <= ?3 ORDER BY id"),
        };
        let rows: Vec<(ExecRecord, String)> = self
            .conn
            .query(&sql, params![sandbox_id, from, upto.unwrap_or(i64::MAX), output], |r| {
                let stdout: Option<Vec<u8>> = r.get(8)?;
                let stderr: Option<Vec<u8>> = r.get(9)?;
                let rec = ExecRecord {
                    id: r.get(0)?,
                    sandbox_id: r.get(1)?,
                    argv: Vec::new(),
                    cwd: r.get(3)?,
                    started_at: r.get(4)?,
                    duration_ms: r.get(5)?,
                    exit_code: r.get(6)?,
                    output_bytes: r.get::<_, i64>(7)? as u64,
                    output: match (stdout, stderr) {
                        (Some(stdout), Some(stderr)) => {
                            Some(crate::model::KeptOutput { stdout, stderr, cut: r.get::<_, i64>(10)? as u64 })
                        }
                        _ => None,
                    },
                };
                Ok((rec, r.get(2)?))
            })
            .map_err(q("exec records"))?;
        rows.into_iter()
            .map(|(mut rec, argv)| {
                rec.argv = serde_json::from_str(&argv).map_err(|source| DbError::Decode { what: "argv", source })?;
                Ok(rec)
            })
            .collect()
    }

    /// The newest exec record id of a sandbox (0 if none).
    pub fn last_exec_record(&self, sandbox_id: &str) -> Result<i64, DbError> {
        self.conn
            .query_row(
                "SELECT COALESCE(MAX(id), 0) FROM exec_records WHERE sandbox_id = ?1",
                params![sandbox_id],
                |r| r.get(0),
            )
            .map_err(q("last exec record"))
    }

    // ---- sandboxes ----

    /// Record a sandbox that is up (one write on the create path).
    pub fn insert_running_sandbox(
        &self,
        id: &SandboxId,
        image_id: i64,
        spec: &SandboxSpec,
        shim_pid: i32,
        shim_start: u64,
    ) -> Result<(), DbError> {
        let spec = serde_json::to_string(spec).map_err(|source| DbError::Decode { what: "sandbox spec", source })?;
        self.conn
            .execute(
                "INSERT INTO sandboxes (id, image_id, state, spec, shim_pid, shim_start, created_at, host) \
                 VALUES (?1, ?2, 'running', ?3, ?4, ?5, ?6, ?7)",
                params![id.as_str(), image_id, spec, shim_pid, shim_start as i64, now(), self.host],
            )
            .map_err(q("insert sandbox"))?;
        Ok(())
    }

    /// Set a sandbox's state; a row marked stopped stays so (its removal
    /// is under way here, or was asked by another host while this one was
    /// down: see [`Db::stop_lost_sandbox`]).
    pub fn set_sandbox_state(&self, id: &SandboxId, state: SandboxState) -> Result<(), DbError> {
        self.change_sandbox_state(id, state, "<>")
    }

    /// Undo the mark a removal of this host set ([`Db::set_sandbox_state`]
    /// to stopped) when the removal failed and the sandbox stays.
    pub fn unstop_sandbox(&self, id: &SandboxId, state: SandboxState) -> Result<(), DbError> {
        self.change_sandbox_state(id, state, "=")
    }

    /// Set the state of a row whose state is (`=`) or is not (`<>`) stopped.
    fn change_sandbox_state(&self, id: &SandboxId, state: SandboxState, stopped: &str) -> Result<(), DbError> {
        self.conn
            .execute(
                &format!("UPDATE sandboxes SET state = ?2 WHERE id = ?1 AND state {stopped} ?3"),
                params![id.as_str(), state, SandboxState::Stopped],
            )
            .map_err(q("set sandbox state"))?;
        Ok(())
    }

    /// Where sandbox `id` runs and its state, as the catalog says (`None`:
    /// no row; the host `None` for a daemon outside a fleet).
    pub fn sandbox_place(&self, id: &str) -> Result<Option<(Option<String>, SandboxState)>, DbError> {
        self.conn
            .query_row("SELECT host, state FROM sandboxes WHERE id = ?1", params![id], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()
            .map_err(q("sandbox place"))
    }

    /// Ask host `host`, down and not because it stopped (its sandboxes
    /// lost to the fleet), to remove sandbox `id` once it is back: the row
    /// is marked stopped, which that host's next start (or, had it not
    /// stopped, its next heartbeat: [`Db::stopped_sandboxes`]) carries
    /// out. False, and nothing changed, unless the row is on `host` and
    /// that host is down so, both read in the one statement.
    pub fn stop_lost_sandbox(&self, id: &str, host: &str) -> Result<bool, DbError> {
        let n = self
            .conn
            .execute(
                "UPDATE sandboxes SET state = ?3 WHERE id = ?1 AND host = ?2 AND EXISTS \
                 (SELECT 1 FROM hosts WHERE id = ?2 AND down IS NOT NULL AND down <> 'stopped')",
                params![id, host, SandboxState::Stopped],
            )
            .map_err(q("stop a lost sandbox"))?;
        Ok(n > 0)
    }

    /// This host's sandboxes whose rows are marked stopped: removals under
    /// way here, and those another host asked for while this one was down.
    pub fn stopped_sandboxes(&self) -> Result<Vec<SandboxId>, DbError> {
        let ids: Vec<String> = self
            .conn
            .query(
                "SELECT id FROM sandboxes WHERE state = ?2 AND (CAST(?1 AS TEXT) IS NULL OR host = ?1) ORDER BY id",
                params![self.host, SandboxState::Stopped],
                |r| r.get(0),
            )
            .map_err(q("stopped sandboxes"))?;
        Ok(ids.into_iter().filter_map(|id| id.parse().ok()).collect())
    }

    /// Claim `key` for a request whose fingerprint is `fp` (keys older
    /// than `IDEMPOTENCY_SECS` are forgotten first).
    pub fn claim_idempotency_key(&mut self, key: &str, fp: &str) -> Result<Claim, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin claim"))?;
        tx.execute("DELETE FROM idempotency WHERE created_at < ?1", params![now() - IDEMPOTENCY_SECS])
            .map_err(q("forget old keys"))?;
        let row: Option<(String, Option<u16>, Option<Vec<u8>>)> = tx
            .query_row("SELECT fingerprint, status, body FROM idempotency WHERE key = ?1", params![key], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            })
            .optional()
            .map_err(q("idempotency key"))?;
        let claim = match row {
            None => {
                tx.execute(
                    "INSERT INTO idempotency (key, fingerprint, created_at, host) VALUES (?1, ?2, ?3, ?4)",
                    params![key, fp, now(), self.host],
                )
                .map_err(q("claim idempotency key"))?;
                Claim::Claimed
            }
            Some((f, _, _)) if f != fp => Claim::Mismatch,
            Some((_, None, _)) => Claim::InFlight,
            Some((_, Some(status), body)) => Claim::Done { status, body: body.unwrap_or_default() },
        };
        tx.commit().map_err(q("commit claim"))?;
        Ok(claim)
    }

    /// Keep the response to a claimed key (`None`: forget the key, so a
    /// retry runs again).
    pub fn settle_idempotency_key(&self, key: &str, response: Option<(u16, &[u8])>) -> Result<(), DbError> {
        match response {
            Some((status, body)) => self
                .conn
                .execute("UPDATE idempotency SET status = ?2, body = ?3 WHERE key = ?1", params![key, status, body])
                .map_err(q("keep response")),
            None => self.conn.execute("DELETE FROM idempotency WHERE key = ?1", params![key]).map_err(q("forget key")),
        }
        .map(drop)
    }

    /// Forget keys whose request was in flight when a daemon stopped.
    pub fn forget_unsettled_keys(&self) -> Result<usize, DbError> {
        self.conn
            .execute(
                "DELETE FROM idempotency WHERE status IS NULL AND (CAST(?1 AS TEXT) IS NULL OR host = ?1)",
                params![self.host],
            )
            .map_err(q("forget unsettled keys"))
    }

    /// Whether a sandbox id was ever used here: a row, a snapshot taken
    /// from it, an exec record. A chosen id must be new (its files, cgroup
    /// and logs would mix with the old one's).
    pub fn sandbox_id_seen(&self, id: &str) -> Result<bool, DbError> {
        self.conn
            .query_row(
                "SELECT EXISTS (SELECT 1 FROM sandboxes WHERE id = ?1) \
                 OR EXISTS (SELECT 1 FROM snapshots WHERE source_sandbox = ?1) \
                 OR EXISTS (SELECT 1 FROM exec_records WHERE sandbox_id = ?1)",
                params![id],
                |r| r.get(0),
            )
            .map_err(q("sandbox id seen"))
    }

    /// A renewed lifetime: the sandbox's spec with only its `lifetime`
    /// replaced (the rest, such as the lineage head a checkpoint moved, is
    /// the catalog's). `false` if there is no such sandbox.
    pub fn set_sandbox_lifetime(&self, id: &SandboxId, lifetime: &crate::spec::Lifetime) -> Result<bool, DbError> {
        let value = serde_json::to_value(lifetime).map_err(|source| DbError::Decode { what: "lifetime", source })?;
        self.set_sandbox_spec_field(id, "lifetime", value)
    }

    /// A live network policy change: the spec's `network` replaced, as
    /// [`Db::set_sandbox_lifetime`] replaces its lifetime.
    pub fn set_sandbox_network(&self, id: &SandboxId, network: &crate::net::NetworkSpec) -> Result<bool, DbError> {
        let value = serde_json::to_value(network).map_err(|source| DbError::Decode { what: "network", source })?;
        self.set_sandbox_spec_field(id, "network", value)
    }

    fn set_sandbox_spec_field(&self, id: &SandboxId, field: &str, value: serde_json::Value) -> Result<bool, DbError> {
        let tx = self.conn.transaction(true).map_err(q("begin sandbox spec change"))?;
        let Some(spec) = tx
            .query_row("SELECT spec FROM sandboxes WHERE id = ?1", params![id.as_str()], |r| r.get::<_, String>(0))
            .optional()
            .map_err(q("sandbox spec"))?
        else {
            return Ok(false);
        };
        // Untyped: fields a newer build of the fleet added stay.
        let decode = |source| DbError::Decode { what: "sandbox spec", source };
        let mut spec: serde_json::Value = serde_json::from_str(&spec).map_err(decode)?;
        let Some(fields) = spec.as_object_mut() else {
            return Err(DbError::Invalid(format!("sandbox {id}: its spec is not an object")));
        };
        fields.insert(field.into(), value);
        let spec = serde_json::to_string(&spec).map_err(decode)?;
        tx.execute("UPDATE sandboxes SET spec = ?2 WHERE id = ?1", params![id.as_str(), spec])
            .map_err(q("set sandbox spec"))?;
        tx.commit().map_err(q("commit sandbox spec change"))?;
        Ok(true)
    }

    /// Rewrite a sandbox's whole spec. The daemon changes parts of it in
    /// place (a checkpoint's lineage head, a renewal's lifetime); the
    /// catalog tests set a row's observed head with this.
    pub fn set_sandbox_spec(&self, id: &SandboxId, spec: &SandboxSpec) -> Result<(), DbError> {
        let spec = serde_json::to_string(spec).map_err(|source| DbError::Decode { what: "sandbox spec", source })?;
        self.conn
            .execute("UPDATE sandboxes SET spec = ?2 WHERE id = ?1", params![id.as_str(), spec])
            .map_err(q("set sandbox spec"))?;
        Ok(())
    }

    pub fn delete_sandbox(&self, id: &SandboxId) -> Result<(), DbError> {
        let tx = self.conn.transaction(false).map_err(q("begin delete sandbox"))?;
        tx.execute("DELETE FROM e2b_processes WHERE sandbox = ?1", params![id.as_str()])
            .map_err(q("delete its e2b processes"))?;
        tx.execute("DELETE FROM sandboxes WHERE id = ?1", params![id.as_str()]).map_err(q("delete sandbox"))?;
        tx.commit().map_err(q("commit delete sandbox"))?;
        Ok(())
    }

    pub fn list_sandboxes(&self) -> Result<Vec<SandboxRow>, DbError> {
        type Raw = (String, i64, SandboxState, String, Option<i32>, Option<i64>, i64);
        let rows: Vec<Raw> = self
            .conn
            .query(
                "SELECT id, image_id, state, spec, shim_pid, shim_start, created_at FROM sandboxes \
                 WHERE CAST(?1 AS TEXT) IS NULL OR host = ?1 ORDER BY created_at, id",
                params![self.host],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?)),
            )
            .map_err(q("list sandboxes"))?;
        rows.into_iter()
            .filter_map(|(id, image_id, state, spec, shim_pid, shim_start, created_at)| {
                // The CHECK constraint guarantees 16 hex chars; skip anything else.
                let id = id.parse().ok()?;
                Some((id, image_id, state, spec, shim_pid, shim_start, created_at))
            })
            .map(|(id, image_id, state, spec, shim_pid, shim_start, created_at)| {
                let spec =
                    serde_json::from_str(&spec).map_err(|source| DbError::Decode { what: "sandbox spec", source })?;
                Ok(SandboxRow {
                    id,
                    image_id,
                    state,
                    spec,
                    shim_pid,
                    shim_start: shim_start.map(|s| s as u64),
                    created_at,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(c: char) -> Digest {
        format!("sha256:{}", c.to_string().repeat(64)).parse().unwrap()
    }

    fn layer(d: char) -> (LayerRow, Digest) {
        (
            LayerRow::content(LayerId::content(&d.to_string().repeat(64)).unwrap(), 1, 1),
            format!("sha256:{}", "f".repeat(64)).parse().unwrap(),
        )
    }

    #[test]
    fn migrations_are_idempotent_and_versioned() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("strata.db");
        let db = Db::open(&p).unwrap();
        assert_eq!(db.schema_version().unwrap(), MIGRATIONS.len());
        drop(db);
        let db = Db::open(&p).unwrap();
        assert_eq!(db.schema_version().unwrap(), MIGRATIONS.len());
    }

    #[test]
    fn migration_20_keeps_lineages_and_their_restores_and_admits_the_closed_states() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("strata.db");
        {
            let conn = rusqlite::Connection::open(&p).unwrap();
            // As `migrate_sqlite` runs them: foreign keys off.
            conn.pragma_update(None, "foreign_keys", "OFF").unwrap();
            for sql in &MIGRATIONS[..19] {
                conn.execute_batch(sql).unwrap();
            }
            conn.pragma_update(None, "user_version", 19).unwrap();
            let [m, c] = ["e", "c"].map(|h| format!("sha256:{}", h.repeat(64)));
            conn.execute_batch(&format!(
                "INSERT INTO images VALUES (1, 'img', '{m}', '{c}', '{{}}', 0);
                 INSERT INTO work_contexts (id, image_id, start_kind, state, created_at, used_at, retired_at)
                     VALUES ('w-active', 1, 'image', 'active', 1, 2, NULL), ('w-old', 1, 'image', 'retired', 1, 2, 3);
                 INSERT INTO restores (work_context, sandbox_id, rung, created_at) VALUES ('w-active', 's', 'image', 5);"
            ))
            .unwrap();
            // Version 19 knows no closed states.
            assert!(conn
                .execute("UPDATE work_contexts SET state = 'completed', retired_at = 4 WHERE id = 'w-active'", [])
                .is_err());
        }
        let mut db = Db::open(&p).unwrap();
        assert_eq!(db.schema_version().unwrap(), MIGRATIONS.len());
        let old = db.work_context("w-old").unwrap().unwrap();
        assert_eq!((old.state, old.retired_at, old.used_at), (LineageState::Retired, Some(3), 2));
        assert_eq!(db.restores("w-active").unwrap().len(), 1, "the rebuild lost a restore");
        assert_eq!(db.close_work_context("w-active", LineageState::Completed).unwrap(), Ok(()));
        let done = db.work_context("w-active").unwrap().unwrap();
        assert_eq!(done.state, LineageState::Completed);
        assert!(done.retired_at.is_some());
        assert_eq!(db.close_work_context("w-active", LineageState::Failed).unwrap(), Err(LineageState::Completed));
        assert_eq!(db.close_work_context("w-old", LineageState::Failed).unwrap(), Err(LineageState::Retired));
        // The CHECKs hold: an end needs its time, a state its name.
        for bad in [
            "UPDATE work_contexts SET retired_at = NULL WHERE id = 'w-active'",
            "UPDATE work_contexts SET state = 'bogus' WHERE id = 'w-old'",
            "UPDATE work_contexts SET state = 'active' WHERE id = 'w-old'",
        ] {
            assert!(db.conn.execute(bad, &[]).is_err(), "{bad}");
        }
    }

    #[test]
    fn migration_6_keeps_rows_and_names_layers() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("strata.db");
        {
            // A version-5 database with an image, a snapshot and a pending blob.
            let conn = rusqlite::Connection::open(&p).unwrap();
            for sql in &MIGRATIONS[..5] {
                conn.execute_batch(sql).unwrap();
            }
            conn.pragma_update(None, "user_version", 5).unwrap();
            let (a, b) = ("a".repeat(64), "b".repeat(64));
            let [m, c, x, y] = ["e", "c", "d", "f"].map(|h| format!("sha256:{}", h.repeat(64)));
            conn.execute_batch(&format!(
                "INSERT INTO layers VALUES ('{a}', 1, 1, 0), ('{b}', 2, 2, 0);
                 INSERT INTO images VALUES (1, 'img', '{m}', '{c}', '{{}}', 0);
                 INSERT INTO image_layers VALUES (1, 0, '{a}', '{x}');
                 INSERT INTO snapshots VALUES ('0123456789abcdef', 1, NULL, '{b}', '{y}', 3, 'zstd', 'ready',
                     'fedcba9876543210', '{{}}', 0);
                 INSERT INTO snapshot_blob_pending VALUES ('0123456789abcdef');"
            ))
            .unwrap();
        }
        let mut db = Db::open(&p).unwrap();
        assert_eq!(db.schema_version().unwrap(), MIGRATIONS.len());
        let snap = db.snapshot("0123456789abcdef").unwrap().unwrap();
        assert_eq!(
            (snap.layer.as_str(), snap.diff_id.as_ref().map(Digest::hex)),
            ("b".repeat(64).as_str(), Some("b".repeat(64).as_str()))
        );
        assert!(db.blob_pending(&snap.id).unwrap());
        assert_eq!(db.image_by_id(1).unwrap().unwrap().layers, vec!["a".repeat(64)]);
        assert!(
            db.conn.query_row("PRAGMA foreign_keys", &[], |r| r.get::<_, bool>(0)).unwrap(),
            "foreign keys back on"
        );
        // The layer's own constraints.
        let insert = |db: &mut Db, id: &str, diff: Option<&str>| {
            db.conn.execute(
                "INSERT INTO layers (id, diff_id, size, entries, created_at) VALUES (?1, ?2, 0, 0, 0)",
                params![id, diff],
            )
        };
        assert!(insert(&mut db, &"c".repeat(64), Some(&"d".repeat(64))).is_err(), "a content id is its diff_id");
        assert!(insert(&mut db, &"c".repeat(64), None).is_err(), "a content id is its diff_id");
        assert!(insert(&mut db, "x0123456789abcdef", None).is_err(), "unknown id shape");
        assert!(insert(&mut db, "s0123", None).is_err(), "short suspended id");
        insert(&mut db, "s0123456789abcdef", None).unwrap();
        assert!(db.conn.execute("DELETE FROM layers WHERE id = ?1", params!["b".repeat(64)]).is_err(), "in use");
    }

    #[test]
    fn lineage_constraints_hold_in_the_schema() {
        let mut db = Db::open_in_memory().unwrap();
        let img = db
            .insert_image(&"a".parse().unwrap(), &digest('e'), &digest('c'), &ImageConfig::default(), &[layer('1')])
            .unwrap();
        let wc = |db: &mut Db, id: &str| {
            db.insert_work_context(&WorkContextRow::new(id, img, StartKind::Image, None)).unwrap()
        };
        assert!(wc(&mut db, "w1"));
        assert!(!wc(&mut db, "w1"), "work context ids are unique");
        let l = "1".repeat(64);
        let snap =
            |db: &Db, id: &str, class: &str, state: &str, wc: Option<&str>, seq: Option<i64>, key: Option<&str>| {
                db.conn.execute(
                "INSERT INTO snapshots (id, image_id, layer_id, blob_digest, blob_size, compression, class, state, \
                 work_context, sequence, owner, repo, ref, commit_id, evidence, source_sandbox, info, created_at) \
                 VALUES (?1, ?2, ?3, '', 0, 'zstd', ?4, ?5, ?6, ?7, ?8, ?8, ?8, ?8, ?8, 's', '{}', 0)",
                params![id, img, l, class, state, wc, seq, key],
            )
            };
        // A checkpoint needs a lineage and a place in it, and no baseline key.
        assert!(snap(&db, "000000000000000a", "checkpoint", "ready", None, None, None).is_err());
        assert!(snap(&db, "000000000000000a", "checkpoint", "ready", Some("w1"), None, None).is_err());
        assert!(snap(&db, "000000000000000a", "checkpoint", "ready", Some("w1"), Some(1), Some("k")).is_err());
        assert!(snap(&db, "000000000000000a", "checkpoint", "ready", Some("nope"), Some(1), None).is_err(), "fk");
        snap(&db, "000000000000000a", "checkpoint", "ready", Some("w1"), Some(1), None).unwrap();
        // One ready head per lineage; one sequence number each.
        assert!(snap(&db, "000000000000000b", "checkpoint", "ready", Some("w1"), Some(2), None).is_err());
        assert!(snap(&db, "000000000000000b", "checkpoint", "superseded", Some("w1"), Some(1), None).is_err());
        snap(&db, "000000000000000b", "checkpoint", "superseded", Some("w1"), Some(2), None).unwrap();
        // A baseline has its key and no lineage; one ready baseline per key.
        assert!(snap(&db, "000000000000000c", "baseline", "ready", None, None, None).is_err());
        assert!(snap(&db, "000000000000000c", "baseline", "ready", Some("w1"), None, Some("k")).is_err());
        snap(&db, "000000000000000c", "baseline", "ready", None, None, Some("k")).unwrap();
        assert!(snap(&db, "000000000000000d", "baseline", "ready", None, None, Some("k")).is_err());
        snap(&db, "000000000000000d", "baseline", "superseded", None, None, Some("k")).unwrap();
        assert!(snap(&db, "000000000000000e", "checkpoint", "bogus", Some("w1"), Some(3), None).is_err());
        // A work context's start matches its kind; a head cannot be deleted.
        assert!(db
            .conn
            .execute(
                "INSERT INTO work_contexts (id, image_id, start_kind, start_id, state, created_at, used_at) \
                 VALUES ('w2', ?1, 'image', 'x', 'active', 0, 0)",
                params![img]
            )
            .is_err());
        db.conn.execute("UPDATE work_contexts SET head_id = '000000000000000a' WHERE id = 'w1'", &[]).unwrap();
        assert!(db.conn.execute("DELETE FROM snapshots WHERE id = '000000000000000a'", &[]).is_err());
        assert_eq!(
            db.begin_delete_snapshot("000000000000000a").unwrap(),
            Err(vec!["head of work context w1".to_string()])
        );
        assert!(db.retire_work_context("w1").unwrap());
        assert_eq!(db.snapshot("000000000000000a").unwrap().unwrap().state, SnapshotState::Retired);
        assert!(db.begin_delete_snapshot("000000000000000a").unwrap().is_ok(), "a retired lineage's head may go");
        assert_eq!(db.snapshot("000000000000000a").unwrap().unwrap().state, SnapshotState::Deleting);
        assert_eq!(db.deleting_snapshots().unwrap(), ["000000000000000a"]);
        // Another snapshot lists the same layer: the layer stays.
        assert_eq!(db.held_only_by("000000000000000a").unwrap(), (None, None));
        db.set_published("000000000000000a", "r:5000/fleet:000000000000000a").unwrap();
        assert_eq!(
            db.finish_delete_snapshot("000000000000000a").unwrap(),
            (None, Some("r:5000/fleet:000000000000000a".to_string()))
        );
        assert!(db.snapshot("000000000000000a").unwrap().is_none());
        let queued = db.manifest_deletes().unwrap();
        assert_eq!(queued.len(), 1, "its manifest queued for deletion with the row's removal");
        assert_eq!((queued[0].0.snapshot.as_str(), queued[0].0.attempts), ("000000000000000a", 0));
        // A capture in progress has no sequence; a ready one must.
        assert!(snap(&db, "000000000000000f", "checkpoint", "capturing", Some("w1"), Some(9), None).is_err());
        snap(&db, "000000000000000f", "checkpoint", "capturing", Some("w1"), None, None).unwrap();
        assert!(db.conn.execute("UPDATE snapshots SET state = 'ready' WHERE id = '000000000000000f'", &[]).is_err());
    }

    /// A catalog with one image, lineage `wc` and a running sandbox in it.
    fn one_sandbox_in(wc: &str) -> (Db, i64, SandboxId) {
        let mut db = Db::open_in_memory().unwrap();
        let img = db
            .insert_image(&"a".parse().unwrap(), &digest('e'), &digest('c'), &ImageConfig::default(), &[layer('1')])
            .unwrap();
        db.insert_work_context(&WorkContextRow::new(wc, img, StartKind::Image, None)).unwrap();
        let sb = SandboxId::random();
        let spec = crate::spec::SandboxSpec { work_context: Some(wc.into()), ..Default::default() };
        db.insert_running_sandbox(&sb, img, &spec, 1, 1).unwrap();
        (db, img, sb)
    }

    #[test]
    fn gc_retires_a_lineage_only_while_it_is_stale_and_unused() {
        // A sandbox works in w1 (its row says so, whatever this host holds).
        let (mut db, img, _) = one_sandbox_in("w1");
        for w in ["w2", "w3"] {
            db.insert_work_context(&WorkContextRow::new(w, img, StartKind::Image, None)).unwrap();
        }
        let later = now() + 10;
        assert!(!db.retire_stale_work_context("w1", later).unwrap(), "a sandbox works in it");
        // w2 was used after the cutoff (a resume since gc listed it).
        assert!(!db.retire_stale_work_context("w2", now() - 1000).unwrap(), "used since");
        assert!(db.retire_stale_work_context("w3", later).unwrap());
        assert!(!db.retire_stale_work_context("w3", later).unwrap(), "once");
        let state = |db: &Db, w: &str| db.work_context(w).unwrap().unwrap().state;
        assert_eq!(
            [state(&db, "w1"), state(&db, "w2"), state(&db, "w3")],
            [LineageState::Active, LineageState::Active, LineageState::Retired]
        );
        // A launch into w3 that began before gc retired it: its activation
        // fails and records nothing.
        let late = crate::spec::SandboxSpec { work_context: Some("w3".into()), ..Default::default() };
        let r = db.activate_sandbox(&SandboxId::random(), img, &late, 1, 1, Rung::Image, None, &[]);
        assert!(matches!(&r, Err(DbError::RetiredMeanwhile(w)) if w == "w3"), "{r:?}");
        assert_eq!(db.list_sandboxes().unwrap().len(), 1);
        assert!(db.restores("w3").unwrap().is_empty());
    }

    #[test]
    fn a_renewal_rewrites_only_the_lifetime() {
        let (db, _, sb) = one_sandbox_in("w1");
        // A checkpoint moved the row's head; a newer build added a field.
        db.conn
            .execute(
                "UPDATE sandboxes SET spec = json_set(spec, '$.observed_head', '000000000000000a', '$.newer', 'x') \
                 WHERE id = ?1",
                params![sb.as_str()],
            )
            .unwrap();
        let life = crate::spec::Lifetime { deadline_ms: Some(5), ..Default::default() };
        assert!(db.set_sandbox_lifetime(&sb, &life).unwrap());
        assert_eq!(db.sandbox_lineage(&sb).unwrap(), (Some("w1".into()), Some("000000000000000a".parse().unwrap())));
        let newer: Option<String> = db
            .conn
            .query_row("SELECT json_extract(spec, '$.newer') FROM sandboxes WHERE id = ?1", params![sb.as_str()], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(newer.as_deref(), Some("x"));
        let spec = &db.list_sandboxes().unwrap()[0].spec;
        assert_eq!(spec.lifetime, life);
        assert!(!db.set_sandbox_lifetime(&SandboxId::random(), &life).unwrap());
    }

    #[test]
    fn a_capture_is_a_row_from_its_start_and_ends_appended_or_failed() {
        let (mut db, img, sb) = one_sandbox_in("w");
        let (l, _) = layer('2');
        let begin = |db: &mut Db| {
            let mut row = SnapshotRow::new(img, None, &l, &sb, serde_json::json!({}));
            row.id = db.begin_capture(&sb, img, None).unwrap().unwrap();
            row
        };
        // Two captures at once: both visible, neither a head, no sequence.
        let mut a = begin(&mut db);
        let b = begin(&mut db);
        for r in [&a, &b] {
            let got = db.snapshot(&r.id).unwrap().unwrap();
            assert_eq!((got.state, got.sequence), (SnapshotState::Capturing, None));
        }
        assert_eq!(db.work_context("w").unwrap().unwrap().head_id, None);
        // One completes: the same row, now the head with its layer.
        a.layer = l.id.clone();
        a.blob_digest = Some(digest('b'));
        db.append_checkpoint(&sb, &mut a, &l, false, false).unwrap().unwrap();
        let got = db.snapshot(&a.id).unwrap().unwrap();
        assert_eq!((got.state, got.sequence, got.layer), (SnapshotState::Ready, Some(1), l.id.clone()));
        assert!(!db.layer_exists(LayerId::suspended(&a.id).as_str()).unwrap(), "placeholder gone");
        // The other fails: never a head, its reason kept; interrupted ones
        // fail at start-up.
        db.capture_failed(&b.id, "no space").unwrap();
        let got = db.snapshot(&b.id).unwrap().unwrap();
        assert_eq!((got.state, got.info["capture_error"].as_str()), (SnapshotState::Failed, Some("no space")));
        assert_eq!(db.work_context("w").unwrap().unwrap().head_id, Some(a.id.clone()));
        let c = begin(&mut db);
        assert_eq!(db.fail_interrupted_captures().unwrap(), 1);
        assert_eq!(db.snapshot(&c.id).unwrap().unwrap().state, SnapshotState::Failed);
    }

    #[test]
    fn images_share_layers_and_rm_returns_orphans() {
        let mut db = Db::open_in_memory().unwrap();
        let cfg = ImageConfig::default();
        let a: ImageName = "a".parse().unwrap();
        let b: ImageName = "b".parse().unwrap();
        let ia = db.insert_image(&a, &digest('e'), &digest('c'), &cfg, &[layer('1'), layer('2')]).unwrap();
        let ib = db.insert_image(&b, &digest('e'), &digest('c'), &cfg, &[layer('1')]).unwrap();
        assert!(db.insert_image(&a, &digest('e'), &digest('c'), &cfg, &[]).is_err(), "names are unique");
        assert_eq!(db.image_by_name(&a).unwrap().unwrap().layers, vec!["1".repeat(64), "2".repeat(64)]);
        assert_eq!(db.delete_image(ia).unwrap().unwrap(), vec!["2".repeat(64)]);
        assert_eq!(db.delete_image(ib).unwrap().unwrap(), vec!["1".repeat(64)]);
        assert!(db.all_layers().unwrap().is_empty());
    }

    #[test]
    fn image_in_use_is_not_deleted() {
        let mut db = Db::open_in_memory().unwrap();
        let name: ImageName = "a".parse().unwrap();
        let img = db.insert_image(&name, &digest('e'), &digest('c'), &ImageConfig::default(), &[layer('1')]).unwrap();
        let id = SandboxId::random();
        db.insert_running_sandbox(&id, img, &crate::spec::SandboxSpec::default(), 42, 7).unwrap();
        assert_eq!(db.delete_image(img).unwrap(), Err(vec![id.to_string()]));
        db.delete_sandbox(&id).unwrap();
        assert!(db.delete_image(img).unwrap().is_ok());
    }

    #[test]
    fn an_e2b_sandboxs_work_context_is_never_stale() {
        let mut db = Db::open_in_memory().unwrap();
        let img =
            db.insert_image(&"a".parse().unwrap(), &digest('e'), &digest('c'), &ImageConfig::default(), &[]).unwrap();
        for id in ["plain", "e2b-paused"] {
            db.insert_work_context(&WorkContextRow::new(id, img, StartKind::Image, None)).unwrap();
        }
        db.insert_e2b_sandbox(&E2bSandbox {
            id: "iabc".into(),
            owner: "0".repeat(64),
            token: "t".into(),
            template: "base".into(),
            work_context: "e2b-paused".into(),
            spec: E2bSpec { timeout: 300, ..Default::default() },
            sandbox: None,
            started_at: 0,
        })
        .unwrap();
        assert_eq!(db.stale_lineages(i64::MAX).unwrap(), vec!["plain".to_string()]);
        db.delete_e2b_sandbox("iabc").unwrap();
        assert_eq!(db.stale_lineages(i64::MAX).unwrap().len(), 2);
    }

    #[test]
    fn the_e2b_process_table_round_trips_and_goes_with_its_sandbox() {
        let mut db = Db::open_in_memory().unwrap();
        let img =
            db.insert_image(&"a".parse().unwrap(), &digest('e'), &digest('c'), &ImageConfig::default(), &[]).unwrap();
        let id = SandboxId::random();
        db.insert_running_sandbox(&id, img, &crate::spec::SandboxSpec::default(), 42, 7).unwrap();
        let row = |pid: u32| E2bProcess {
            sandbox: id.to_string(),
            pid,
            exec_id: (1 << 51) + u64::from(pid),
            tag: Some("t".into()),
            config: serde_json::json!({"cmd": "/bin/bash", "args": ["-c", "x"]}),
            cwd: "/home/user".into(),
            stdin: true,
            pty: false,
            deadline: Some(1_700_000_000_000),
        };
        db.insert_e2b_process(&row(7)).unwrap();
        db.insert_e2b_process(&row(3)).unwrap();
        // A pid reused by a later command replaces the row.
        db.insert_e2b_process(&E2bProcess { tag: None, ..row(7) }).unwrap();
        assert_eq!(db.e2b_processes(id.as_str()).unwrap(), vec![row(3), E2bProcess { tag: None, ..row(7) }]);
        assert_eq!(db.e2b_process_sandboxes().unwrap(), vec![id.to_string()]);
        db.delete_e2b_process(id.as_str(), 3, 1).unwrap();
        assert_eq!(db.e2b_processes(id.as_str()).unwrap().len(), 2, "another exec id's row went");
        db.delete_e2b_process(id.as_str(), 3, (1 << 51) + 3).unwrap();
        assert_eq!(db.e2b_processes(id.as_str()).unwrap().len(), 1);
        db.delete_sandbox(&id).unwrap();
        assert!(db.e2b_process_sandboxes().unwrap().is_empty(), "rows outlived their sandbox");
    }

    #[test]
    fn sandbox_state_is_constrained() {
        let mut db = Db::open_in_memory().unwrap();
        let img =
            db.insert_image(&"a".parse().unwrap(), &digest('e'), &digest('c'), &ImageConfig::default(), &[]).unwrap();
        let id = SandboxId::random();
        db.insert_running_sandbox(&id, img, &crate::spec::SandboxSpec::default(), 42, 7).unwrap();
        assert!(db.conn.execute("UPDATE sandboxes SET state = 'bogus' WHERE id = ?1", params![id.as_str()]).is_err());
        let rows = db.list_sandboxes().unwrap();
        assert_eq!(rows[0].state, SandboxState::Running);
        assert_eq!(rows[0].shim_pid, Some(42));
    }

    #[test]
    fn a_lost_hosts_sandbox_is_marked_stopped_only_while_that_host_is_down_and_stays_so() {
        use crate::db::hosts::HostClaim;
        let claim = |id, deadline_ms| HostClaim { id, machine: "m", root: "/r", version: "0", info: "{}", deadline_ms };
        let mut db = Db::open_in_memory().unwrap();
        db.register_host(&claim("b", 60_000)).unwrap();
        let img =
            db.insert_image(&"a".parse().unwrap(), &digest('e'), &digest('c'), &ImageConfig::default(), &[]).unwrap();
        let id = SandboxId::random();
        db.insert_running_sandbox(&id, img, &crate::spec::SandboxSpec::default(), 42, 7).unwrap();
        // Host b is up: no other host may stop its sandbox; nor is it on a.
        assert!(!db.stop_lost_sandbox(id.as_str(), "b").unwrap());
        db.host_stopped().unwrap();
        assert!(!db.stop_lost_sandbox(id.as_str(), "b").unwrap(), "a host that stopped adopts its sandboxes");
        db.register_host(&claim("b", -1)).unwrap();
        db.register_host(&claim("a", 60_000)).unwrap();
        assert_eq!(db.mark_hosts_down().unwrap().len(), 1);
        assert!(!db.stop_lost_sandbox(id.as_str(), "a").unwrap(), "not on host a");
        assert!(db.stop_lost_sandbox(id.as_str(), "b").unwrap());
        // b back: the row stays stopped whatever b sets, and b lists it.
        db.register_host(&claim("b", 60_000)).unwrap();
        db.set_sandbox_state(&id, SandboxState::Paused).unwrap();
        assert_eq!(db.list_sandboxes().unwrap()[0].state, SandboxState::Stopped);
        assert_eq!(db.stopped_sandboxes().unwrap(), vec![id.clone()]);
        assert_eq!(db.sandbox_place(id.as_str()).unwrap(), Some((Some("b".into()), SandboxState::Stopped)));
        // A removal of b's own that failed puts its row back.
        db.unstop_sandbox(&id, SandboxState::Paused).unwrap();
        assert_eq!(db.list_sandboxes().unwrap()[0].state, SandboxState::Paused);
        assert!(db.stopped_sandboxes().unwrap().is_empty());
    }
}
