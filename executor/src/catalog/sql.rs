//! One SQL surface over two engines: the embedded SQLite (rusqlite, the
//! default) and PostgreSQL (the `postgres` client), so every query of the
//! catalog is written once.
//!
//! Queries are SQLite's dialect with `?N` parameters; for PostgreSQL the
//! parameters become `$N` and the few SQLite functions the catalog uses
//! (`json_extract`, `json_set`) are defined by its schema. Values cross
//! the boundary as rusqlite's own `ToSql`/`FromSql` (so model types need
//! one pair of conversions): a PostgreSQL row is read into SQLite's value
//! model (integers, reals, text, blobs, NULL), and a parameter is sent as
//! whatever type the server inferred for it.
//!
//! Writes are serialized as SQLite serializes them: on PostgreSQL every
//! transaction, and every write outside one, first takes one
//! transaction-scoped advisory lock shared by the whole fleet. The
//! catalog's deciding transactions (fenced append, baseline compare-and-
//! swap, reservations) were written for a single writer; under this lock
//! they run exactly so on any number of hosts, while reads never wait.

use std::cell::RefCell;
use std::collections::HashMap;

use rusqlite::types::{FromSql, ToSql, Value, ValueRef};

/// The advisory lock every PostgreSQL write holds (an arbitrary constant:
/// "strata" in ASCII).
const WRITER_LOCK: i64 = 0x73_74_72_61_74_61;

#[derive(Debug, thiserror::Error)]
pub enum SqlError {
    #[error(transparent)]
    Sqlite(#[from] rusqlite::Error),
    #[error(transparent)]
    Postgres(#[from] postgres::Error),
    /// A query for one row found none.
    #[error("no row")]
    NoRows,
    #[error("column {col}: {source}")]
    Decode {
        col: usize,
        #[source]
        source: rusqlite::types::FromSqlError,
    },
    #[error("column {col} has PostgreSQL type {ty}, which the catalog does not use")]
    ColumnType { col: usize, ty: String },
}

impl SqlError {
    /// A unique, foreign-key or CHECK constraint refused the write.
    pub fn is_constraint(&self) -> bool {
        match self {
            SqlError::Sqlite(rusqlite::Error::SqliteFailure(e, _)) => {
                e.code == rusqlite::ErrorCode::ConstraintViolation
            }
            SqlError::Postgres(e) => e.code().is_some_and(|c| c.code().starts_with("23")),
            _ => false,
        }
    }
}

/// `Result<T, SqlError>` where "no row" means `None`.
pub trait Optional<T> {
    fn optional(self) -> Result<Option<T>, SqlError>;
}

impl<T> Optional<T> for Result<T, SqlError> {
    fn optional(self) -> Result<Option<T>, SqlError> {
        match self {
            Ok(v) => Ok(Some(v)),
            Err(SqlError::NoRows) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Which engine holds the catalog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
}

pub type Params<'a> = &'a [&'a dyn ToSql];

/// A column index (a trait, like rusqlite's `RowIndex`, so that `get(0)`
/// infers `usize`).
pub trait Col {
    fn index(self) -> usize;
}

impl Col for usize {
    fn index(self) -> usize {
        self
    }
}

/// One row of a result, from either engine.
pub struct Row<'a>(RowInner<'a>);

enum RowInner<'a> {
    Sqlite(&'a rusqlite::Row<'a>),
    Values(&'a [Value]),
}

impl Row<'_> {
    /// Column `col` as `T` (rusqlite's conversions for both engines).
    pub fn get<I: Col, T: FromSql>(&self, col: I) -> Result<T, SqlError> {
        let col = col.index();
        match &self.0 {
            RowInner::Sqlite(r) => Ok(r.get(col)?),
            RowInner::Values(v) => {
                let value = v.get(col).map(ValueRef::from).ok_or(SqlError::Decode {
                    col,
                    source: rusqlite::types::FromSqlError::Other("no such column".into()),
                })?;
                T::column_result(value).map_err(|source| SqlError::Decode { col, source })
            }
        }
    }
}

/// A connection to the catalog.
pub struct Conn(Inner);

enum Inner {
    Sqlite(rusqlite::Connection),
    // RefCell: the postgres client needs `&mut` for every call; the
    // catalog is used from one thread at a time (behind the daemon's mutex).
    Postgres(Box<RefCell<Pg>>),
}

struct Pg {
    url: String,
    client: postgres::Client,
    statements: HashMap<String, postgres::Statement>,
    in_tx: bool,
    /// The session failed (an I/O error, a FATAL from the server): the
    /// next call outside a transaction connects again.
    broken: bool,
    /// Settings each session starts with (`SET ...`), again after a
    /// reconnect.
    session: Option<String>,
}

impl Conn {
    pub fn sqlite(conn: rusqlite::Connection) -> Conn {
        conn.set_prepared_statement_cache_capacity(256);
        Conn(Inner::Sqlite(conn))
    }

    /// Connect to PostgreSQL (a `postgres://` URL or `key=value` string;
    /// `host=/dir` for a Unix socket). Plain connections only: the catalog
    /// is reached over a Unix socket or a private network.
    pub fn postgres(url: &str) -> Result<Conn, SqlError> {
        let client = postgres::Client::connect(url, postgres::NoTls)?;
        let pg =
            Pg { url: url.to_string(), client, statements: HashMap::new(), in_tx: false, broken: false, session: None };
        Ok(Conn(Inner::Postgres(Box::new(RefCell::new(pg)))))
    }

    /// PostgreSQL ends this session (rolling back its transaction, which
    /// releases the fleet's writer lock) when it sits idle inside a
    /// transaction for `limit`, now and after every reconnect: a host
    /// frozen mid-transaction (stopped, swapped out, its VM paused) must
    /// not stall every other host's writes, its own down-marking among
    /// them. The catalog's transactions do no other work between their
    /// statements. SQLite (one host): nothing to do.
    pub fn end_idle_transactions_after(&self, limit: std::time::Duration) -> Result<(), SqlError> {
        if let Inner::Postgres(pg) = &self.0 {
            // PostgreSQL takes 1..=i32::MAX ms.
            let ms = limit.as_millis().clamp(1, i32::MAX as u128);
            let sql = format!("SET idle_in_transaction_session_timeout = {ms}");
            self.batch(&sql)?;
            pg.borrow_mut().session = Some(sql);
        }
        Ok(())
    }

    pub fn engine(&self) -> Engine {
        match self.0 {
            Inner::Sqlite(_) => Engine::Sqlite,
            Inner::Postgres(_) => Engine::Postgres,
        }
    }

    /// The SQLite connection (migrations and pragmas), if that is the engine.
    pub fn as_sqlite(&self) -> Option<&rusqlite::Connection> {
        match &self.0 {
            Inner::Sqlite(c) => Some(c),
            Inner::Postgres(_) => None,
        }
    }

    /// Run statements without parameters (DDL, `BEGIN`...).
    pub fn batch(&self, sql: &str) -> Result<(), SqlError> {
        match &self.0 {
            Inner::Sqlite(c) => Ok(c.execute_batch(sql)?),
            Inner::Postgres(pg) => {
                let mut pg = pg.borrow_mut();
                let r = pg.client.batch_execute(sql).map_err(SqlError::from);
                pg.check(r)
            }
        }
    }

    /// Run one statement; the number of rows it changed.
    pub fn execute(&self, sql: &str, params: Params<'_>) -> Result<usize, SqlError> {
        match &self.0 {
            Inner::Sqlite(c) => Ok(c.prepare_cached(sql)?.execute(params)?),
            Inner::Postgres(pg) => Ok(pg.borrow_mut().run(sql, params, false)?.1 as usize),
        }
    }

    /// Every row of a query, each mapped by `f`.
    pub fn query<T, C: FromIterator<T>>(
        &self,
        sql: &str,
        params: Params<'_>,
        mut f: impl FnMut(&Row<'_>) -> Result<T, SqlError>,
    ) -> Result<C, SqlError> {
        match &self.0 {
            Inner::Sqlite(c) => {
                let mut st = c.prepare_cached(sql)?;
                let mut rows = st.query(params)?;
                std::iter::from_fn(|| match rows.next() {
                    Ok(Some(r)) => Some(f(&Row(RowInner::Sqlite(r)))),
                    Ok(None) => None,
                    Err(e) => Some(Err(e.into())),
                })
                .collect()
            }
            Inner::Postgres(pg) => {
                let (rows, _) = pg.borrow_mut().run(sql, params, true)?;
                rows.iter().map(|v| f(&Row(RowInner::Values(v)))).collect()
            }
        }
    }

    /// The first row of a query mapped by `f`; [`SqlError::NoRows`] if none.
    pub fn query_row<T>(
        &self,
        sql: &str,
        params: Params<'_>,
        f: impl FnOnce(&Row<'_>) -> Result<T, SqlError>,
    ) -> Result<T, SqlError> {
        match &self.0 {
            Inner::Sqlite(c) => {
                let mut st = c.prepare_cached(sql)?;
                let mut rows = st.query(params)?;
                match rows.next()? {
                    Some(r) => f(&Row(RowInner::Sqlite(r))),
                    None => Err(SqlError::NoRows),
                }
            }
            Inner::Postgres(pg) => {
                let (rows, _) = pg.borrow_mut().run(sql, params, true)?;
                match rows.first() {
                    Some(v) => f(&Row(RowInner::Values(v))),
                    None => Err(SqlError::NoRows),
                }
            }
        }
    }

    /// Begin a transaction. `immediate`: it will write (SQLite takes the
    /// write lock now rather than at its first write). On PostgreSQL every
    /// transaction takes the writer lock. Rolled back unless committed.
    pub fn transaction(&self, immediate: bool) -> Result<Tx<'_>, SqlError> {
        match &self.0 {
            Inner::Sqlite(c) => c.execute_batch(if immediate { "BEGIN IMMEDIATE" } else { "BEGIN" })?,
            Inner::Postgres(pg) => {
                pg.borrow_mut().reconnect_if_closed()?;
                self.batch("BEGIN")?;
                pg.borrow_mut().in_tx = true;
                if let Err(e) = self.execute("SELECT pg_advisory_xact_lock(?1)", &[&WRITER_LOCK]) {
                    let _ = self.end("ROLLBACK");
                    return Err(e);
                }
            }
        }
        Ok(Tx { conn: self, done: false })
    }

    /// End the open transaction with `COMMIT` or `ROLLBACK`. A `COMMIT`
    /// that fails (SQLite busy, a lost PostgreSQL session) rolls back, so
    /// the connection is never left inside a transaction.
    fn end(&self, sql: &str) -> Result<(), SqlError> {
        if let Inner::Postgres(pg) = &self.0 {
            pg.borrow_mut().in_tx = false;
        }
        let r = self.batch(sql);
        if r.is_err() && sql == "COMMIT" {
            let _ = self.batch("ROLLBACK");
        }
        r
    }
}

/// An open transaction; derefs to its connection.
pub struct Tx<'a> {
    conn: &'a Conn,
    done: bool,
}

impl Tx<'_> {
    pub fn commit(mut self) -> Result<(), SqlError> {
        self.done = true;
        self.conn.end("COMMIT")
    }
}

impl std::ops::Deref for Tx<'_> {
    type Target = Conn;
    fn deref(&self) -> &Conn {
        self.conn
    }
}

impl Drop for Tx<'_> {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.conn.end("ROLLBACK");
        }
    }
}

impl Pg {
    /// After a lost connection (a server restart, a network cut), the next
    /// call outside a transaction connects again; one inside a transaction
    /// fails with it (its work is rolled back by the server).
    fn reconnect_if_closed(&mut self) -> Result<(), SqlError> {
        if (self.broken || self.client.is_closed()) && !self.in_tx {
            let mut client = postgres::Client::connect(&self.url, postgres::NoTls)?;
            if let Some(sql) = &self.session {
                client.batch_execute(sql)?;
            }
            self.client = client;
            self.statements.clear();
            self.broken = false;
        }
        Ok(())
    }

    /// Note an error that ended the session (anything but an error the
    /// server reported and survived).
    fn check<T>(&mut self, r: Result<T, SqlError>) -> Result<T, SqlError> {
        if let Err(SqlError::Postgres(e)) = &r {
            self.broken |= e.as_db_error().is_none_or(|d| matches!(d.severity(), "FATAL" | "PANIC"));
        }
        r
    }

    fn statement(&mut self, sql: &str) -> Result<postgres::Statement, SqlError> {
        if let Some(st) = self.statements.get(sql) {
            return Ok(st.clone());
        }
        let st = self.client.prepare(&translate(sql))?;
        self.statements.insert(sql.to_string(), st.clone());
        Ok(st)
    }

    /// Run one statement: its rows (with `rows`) and the number of rows
    /// it returned or changed. A write outside a transaction takes the
    /// writer lock in a transaction of its own.
    fn run(&mut self, sql: &str, params: Params<'_>, rows: bool) -> Result<(Vec<Vec<Value>>, u64), SqlError> {
        let r = self.run_once(sql, params, rows);
        self.check(r)
    }

    fn run_once(&mut self, sql: &str, params: Params<'_>, rows: bool) -> Result<(Vec<Vec<Value>>, u64), SqlError> {
        self.reconnect_if_closed()?;
        let st = self.statement(sql)?;
        let params = pg_params(params)?;
        let refs: Vec<&(dyn postgres::types::ToSql + Sync)> = params.iter().map(|p| p as _).collect();
        if self.in_tx || !is_write(sql) {
            return run_on(&mut self.client, &st, &refs, rows);
        }
        let mut tx = self.client.transaction()?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&WRITER_LOCK])?;
        let out = run_on(&mut tx, &st, &refs, rows)?;
        tx.commit()?;
        Ok(out)
    }
}

fn run_on(
    client: &mut impl postgres::GenericClient,
    st: &postgres::Statement,
    params: &[&(dyn postgres::types::ToSql + Sync)],
    rows: bool,
) -> Result<(Vec<Vec<Value>>, u64), SqlError> {
    if rows {
        let out: Vec<Vec<Value>> = client.query(st, params)?.iter().map(pg_row).collect::<Result<_, _>>()?;
        let n = out.len() as u64;
        Ok((out, n))
    } else {
        Ok((Vec::new(), client.execute(st, params)?))
    }
}

/// Whether a statement writes (so needs the writer lock).
fn is_write(sql: &str) -> bool {
    let head = sql.trim_start().get(..6).unwrap_or("").to_ascii_uppercase();
    matches!(head.as_str(), "INSERT" | "UPDATE" | "DELETE")
}

/// SQLite's `?N` parameters as PostgreSQL's `$N` (outside string literals).
pub fn translate(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut quoted = false;
    for c in sql.chars() {
        match c {
            '\'' => {
                quoted = !quoted;
                out.push(c);
            }
            '?' if !quoted => out.push('$'),
            _ => out.push(c),
        }
    }
    out
}

/// A parameter in SQLite's value model, sent as the type PostgreSQL
/// inferred for its place.
#[derive(Debug)]
struct PgParam(Value);

fn pg_params(params: Params<'_>) -> Result<Vec<PgParam>, SqlError> {
    params
        .iter()
        .map(|p| {
            Ok(PgParam(match p.to_sql()? {
                rusqlite::types::ToSqlOutput::Borrowed(v) => v.into(),
                rusqlite::types::ToSqlOutput::Owned(v) => v,
                _ => return Err(SqlError::Sqlite(rusqlite::Error::InvalidQuery)),
            }))
        })
        .collect()
}

impl postgres::types::ToSql for PgParam {
    fn to_sql(
        &self,
        ty: &postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        use postgres::types::{ToSql as Pg, Type};
        match &self.0 {
            Value::Null => Ok(postgres::types::IsNull::Yes),
            Value::Integer(i) => match *ty {
                Type::INT8 => Pg::to_sql(i, ty, out),
                Type::INT4 => Pg::to_sql(&i32::try_from(*i)?, ty, out),
                Type::INT2 => Pg::to_sql(&i16::try_from(*i)?, ty, out),
                Type::BOOL => Pg::to_sql(&(*i != 0), ty, out),
                Type::FLOAT8 => Pg::to_sql(&(*i as f64), ty, out),
                Type::TEXT | Type::VARCHAR => Pg::to_sql(&i.to_string(), ty, out),
                _ => Err(format!("an integer parameter where {ty} is expected").into()),
            },
            Value::Real(f) => match *ty {
                Type::FLOAT8 => Pg::to_sql(f, ty, out),
                Type::FLOAT4 => Pg::to_sql(&(*f as f32), ty, out),
                _ => Err(format!("a real parameter where {ty} is expected").into()),
            },
            Value::Text(s) => match *ty {
                Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME | Type::UNKNOWN => Pg::to_sql(s, ty, out),
                _ => Err(format!("a text parameter where {ty} is expected").into()),
            },
            Value::Blob(b) => match *ty {
                Type::BYTEA => Pg::to_sql(b, ty, out),
                _ => Err(format!("a blob parameter where {ty} is expected").into()),
            },
        }
    }

    fn accepts(_: &postgres::types::Type) -> bool {
        true
    }

    postgres::types::to_sql_checked!();
}

/// A PostgreSQL row in SQLite's value model.
fn pg_row(row: &postgres::Row) -> Result<Vec<Value>, SqlError> {
    use postgres::types::Type;
    (0..row.len())
        .map(|i| {
            let ty = row.columns()[i].type_();
            Ok(match *ty {
                Type::INT8 => row.try_get::<_, Option<i64>>(i)?.map_or(Value::Null, Value::Integer),
                Type::INT4 => row.try_get::<_, Option<i32>>(i)?.map_or(Value::Null, |v| Value::Integer(v.into())),
                Type::INT2 => row.try_get::<_, Option<i16>>(i)?.map_or(Value::Null, |v| Value::Integer(v.into())),
                Type::BOOL => row.try_get::<_, Option<bool>>(i)?.map_or(Value::Null, |v| Value::Integer(v.into())),
                Type::FLOAT8 => row.try_get::<_, Option<f64>>(i)?.map_or(Value::Null, Value::Real),
                Type::FLOAT4 => row.try_get::<_, Option<f32>>(i)?.map_or(Value::Null, |v| Value::Real(v.into())),
                Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME => {
                    row.try_get::<_, Option<String>>(i)?.map_or(Value::Null, Value::Text)
                }
                Type::BYTEA => row.try_get::<_, Option<Vec<u8>>>(i)?.map_or(Value::Null, Value::Blob),
                _ => return Err(SqlError::ColumnType { col: i, ty: ty.to_string() }),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_become_dollar_numbers_outside_literals() {
        assert_eq!(
            translate("SELECT 1 FROM t WHERE a = ?1 AND b = '?' AND c = ?12"),
            "SELECT 1 FROM t WHERE a = $1 AND b = '?' AND c = $12"
        );
    }

    #[test]
    fn writes_are_told_from_reads() {
        assert!(is_write("  insert into t values (1)"));
        assert!(is_write("UPDATE t SET a = 1"));
        assert!(is_write("DELETE FROM t"));
        assert!(!is_write("SELECT 1"));
        assert!(!is_write("WITH x AS (SELECT 1) SELECT * FROM x"));
    }

    #[test]
    fn sqlite_rows_and_missing_rows() {
        let c = Conn::sqlite(rusqlite::Connection::open_in_memory().unwrap());
        c.batch("CREATE TABLE t (a INTEGER, b TEXT)").unwrap();
        assert_eq!(c.execute("INSERT INTO t VALUES (?1, ?2)", rusqlite::params![1, "x"]).unwrap(), 1);
        let v: (i64, String) = c.query_row("SELECT a, b FROM t", &[], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
        assert_eq!(v, (1, "x".into()));
        let none: Option<i64> = c.query_row("SELECT a FROM t WHERE a = 2", &[], |r| r.get(0)).optional().unwrap();
        assert_eq!(none, None);
        {
            let tx = c.transaction(true).unwrap();
            tx.execute("INSERT INTO t VALUES (2, 'y')", &[]).unwrap();
            // dropped: rolled back
        }
        let all: Vec<i64> = c.query("SELECT a FROM t", &[], |r| r.get(0)).unwrap();
        assert_eq!(all, vec![1]);
    }
}
