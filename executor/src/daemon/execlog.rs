//! The exec log is written behind the answer. A finished command's record
//! is queued and the exec answers without waiting for the catalog (one
//! insert, its locks and WAL frames, was 50-70 µs of a 1 ms exec on
//! SQLite; on PostgreSQL it is a round trip more). A thread at nice 10
//! writes what is queued, in order, all of it in one transaction. While
//! commands keep ending it looks at the queue every [`LINGER`] instead of
//! being woken for each record: a wake-up of a thread on an idle CPU is
//! an inter-processor interrupt, 20 µs of the answering thread's time in
//! this VM. Only a record that finds it asleep (idle since its last look)
//! wakes it.
//!
//! Nothing reads around the queue: whatever reads a live sandbox's records
//! (its log, a checkpoint or suspend sealing them, a rollback finding
//! where its log starts over) first settles it ([`Daemon::settle_exec_log`]),
//! which writes everything queued before it. A record is queued only while
//! its sandbox is not going, checked under the queue's lock (as the insert
//! was under the database's): a removal or rollback marks the sandbox
//! going before it settles, so a record is either queued before (and
//! written before anything reads) or not at all.
//!
//! A daemon killed outright loses what is queued and not yet written (at
//! most [`LINGER`] of commands); a stop settles first. Until a checkpoint, a sandbox's files are not durable either
//! (docs/state.md).

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::catalog::ExecRecord;
use crate::catalog::SnapshotRow;
use crate::daemon::{lock, Daemon};

#[derive(Default)]
pub(crate) struct ExecLog {
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Held from taking records off the queue until they are in the
    /// catalog, so a settle returns only after what was queued before it
    /// is written.
    writing: Mutex<()>,
}

/// How long the writer waits for more records after it wrote some.
const LINGER: Duration = Duration::from_millis(5);

#[derive(Default)]
struct Queue {
    records: Vec<ExecRecord>,
    /// A writer thread runs (else each record is written as it comes).
    writer: bool,
    /// The writer waits to be woken (it found nothing at its last look).
    asleep: bool,
}

/// A snapshot's sealed exec log: its chain's segments, root first.
pub(crate) fn snapshot_log(
    db: &crate::catalog::Db,
    id: &str,
    output: bool,
) -> Result<Vec<crate::catalog::ExecRecord>, crate::catalog::DbError> {
    let mut out = Vec::new();
    for s in db.snapshot_chain(id)? {
        out.extend(own_log(db, &s, output)?);
    }
    Ok(out)
}

/// The exec records a snapshot seals itself (its segment of the log):
/// its source sandbox's records with ids in `(log_from, log_upto]`; for a
/// pulled snapshot, the records its pull inserted, whatever sandbox ran
/// them (`log_pulled`). None for a snapshot that records no log.
pub(crate) fn own_log(
    db: &crate::catalog::Db,
    s: &SnapshotRow,
    output: bool,
) -> Result<Vec<crate::catalog::ExecRecord>, crate::catalog::DbError> {
    let Some((from, upto)) = s.info.log_segment() else { return Ok(Vec::new()) };
    let sandbox = (!s.info.log_pulled).then_some(s.source_sandbox.as_str());
    db.exec_records(sandbox, from, Some(upto), output)
}

impl Daemon {
    /// Start the exec log's writer thread. Without it, a record is
    /// written before its exec answers.
    pub fn start_exec_log(self: &Arc<Self>) {
        // Before the thread looks: it ends once it finds no writer wanted.
        lock(&self.exec_log.queue).writer = true;
        let d = self.clone();
        let spawned = super::background("exec-log", "execs write their record before they answer", move || {
            // Background work: not before the answers it was taken off.
            let _ = strata_shim::sys::set_thread_nice(10);
            let wake = &d.exec_log.wake;
            let mut linger = false;
            loop {
                {
                    let mut q = lock(&d.exec_log.queue);
                    while q.records.is_empty() && q.writer {
                        q = if linger {
                            linger = false;
                            wake.wait_timeout(q, LINGER).map_or_else(|p| p.into_inner().0, |(q, _)| q)
                        } else {
                            q.asleep = true;
                            wake.wait(q).unwrap_or_else(|p| p.into_inner())
                        };
                    }
                    if !q.writer {
                        return;
                    }
                }
                crate::failpoint::hit("exec-log:write");
                d.settle_exec_log();
                linger = true;
            }
        });
        if spawned.is_none() {
            lock(&self.exec_log.queue).writer = false;
            self.settle_exec_log();
        }
    }

    /// Stop the writer and write what it left. Records that come later
    /// (a request past the stop's grace) are written as they come.
    pub(crate) fn stop_exec_log(&self) {
        lock(&self.exec_log.queue).writer = false;
        self.exec_log.wake.notify_all();
        self.settle_exec_log();
    }

    /// Queue a finished command's record, unless its sandbox is going.
    pub(crate) fn queue_exec_record(&self, sb: &crate::sandbox::Sandbox, rec: ExecRecord) {
        let mut q = lock(&self.exec_log.queue);
        if sb.gone().is_set() {
            return;
        }
        q.records.push(rec);
        if !q.writer {
            drop(q);
            self.settle_exec_log();
        } else if std::mem::take(&mut q.asleep) {
            drop(q);
            self.exec_log.wake.notify_one();
        }
    }

    /// Write every record queued so far; call before reading a live
    /// sandbox's exec records.
    pub(crate) fn settle_exec_log(&self) {
        let _writing = lock(&self.exec_log.writing);
        let records = std::mem::take(&mut lock(&self.exec_log.queue).records);
        if records.is_empty() {
            return;
        }
        if let Err(e) = lock(&self.db).insert_exec_records(&records) {
            tracing::warn!("exec log: {} records, not all written: {}", records.len(), crate::error::chain(&e));
        }
    }

    /// The id of a live sandbox's last exec record (0: none), settled.
    pub(crate) fn last_exec_record(&self, id: &str) -> Result<i64, crate::catalog::DbError> {
        self.settle_exec_log();
        lock(&self.db).last_exec_record(id)
    }

    /// Keep a finished command in the sandbox's exec log.
    pub fn record_exec(
        &self,
        sb: &crate::sandbox::Sandbox,
        req: &crate::sandbox::ExecRequest,
        s: &crate::sandbox::ExecSummary,
    ) {
        self.telemetry.exec(s.duration);
        let rec = crate::catalog::ExecRecord {
            id: 0,
            sandbox_id: sb.id.to_string(),
            argv: req.argv.clone(),
            cwd: req.cwd.clone().unwrap_or_else(|| sb.defaults.cwd.clone()),
            started_at: s.started_at.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0),
            duration_ms: s.duration.as_secs_f64() * 1000.0,
            exit_code: s.status.shell_code(),
            output_bytes: s.output_bytes,
            output: Some(s.kept.clone()),
        };
        // A command that ends after its sandbox began to go (removed, or
        // rolled back: the discarded timeline) is not logged (`execlog.rs`).
        self.queue_exec_record(sb, rec);
    }
}
