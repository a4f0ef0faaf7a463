//! The metadata database (the catalog): SQLite (WAL) at `ROOT/strata.db`,
//! or PostgreSQL with `--database` (`postgres.rs`, through `sql.rs`).
//!
//! Owns the schema, its versioned migrations (`PRAGMA user_version`) and every
//! query, one file per table family, as containerd's metadata package is
//! laid out: `migrations`, `images`, `snapshots`, `baselines`, `pulls`,
//! `lineages`, `sandboxes`, `exec_records`, `requests` (idempotency),
//! `hosts`, `manifests`, `e2b`, `results`. Holds no file-system state:
//! callers write metadata first and touch directories after (a start-up
//! sweep removes directories the database does not know, containerd's
//! order).

use std::path::Path;

pub use crate::model::{BlobCompression, LineageState, Rung, SandboxState, SnapshotClass, SnapshotState, StartKind};
use crate::oci::Digest;

mod baselines;
mod e2b;
mod exec_records;
mod hosts;
mod images;
mod lineages;
mod manifests;
mod migrations;
mod postgres;
mod pulls;
mod requests;
mod results;
mod sandboxes;
mod snapshots;
pub mod sql;
#[cfg(test)]
mod tests;

pub use baselines::*;
pub use e2b::{E2bProcess, E2bSandbox, E2bSnapshot, E2bSpec};
pub use exec_records::*;
pub use hosts::{now_ms, Beat, DownHost, HostClaim, HostRow, HostState, Place};
pub use images::*;
pub use lineages::*;
pub use manifests::ManifestDelete;
use migrations::*;
pub use pulls::*;
pub use requests::*;
pub use results::{Evaluation, StoreUsage, MAX_LABEL_KEY, MAX_LABEL_VALUE};
pub use sandboxes::*;
pub use snapshots::*;
use sql::{Conn, Row, SqlError};

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

pub struct Db {
    conn: Conn,
    /// The host this connection acts for (`hosts.rs`).
    host: Option<String>,
}

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
}
