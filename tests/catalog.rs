//! The catalog's contract, on both engines: the embedded SQLite and
//! PostgreSQL (the suite's own server, `support::pg`). The lineage rules
//! the daemon relies on are checked through `Db` itself, and concurrent
//! appends from two connections (two hosts of a fleet) are raced.

use std::sync::{Arc, Barrier};

use strata::catalog::{Db, LayerRow, SnapshotRow, WorkContextRow};
use strata::ids::{LayerId, SandboxId};
use strata::model::{SnapshotState, StartKind};
use strata::spec::SandboxSpec;
use strata_tests::pg;

type Open = Box<dyn Fn() -> Db + Send + Sync>;

/// A fresh catalog on each engine, and how to open a connection to it
/// (the directory holds the SQLite file).
fn engines() -> (tempfile::TempDir, Vec<(&'static str, Open)>) {
    let dir = tempfile::Builder::new().prefix("strata-test-catalog-").tempdir().unwrap();
    let path = dir.path().join("strata.db");
    let url = pg::database();
    let list: Vec<(&'static str, Open)> = vec![
        ("sqlite", Box::new(move || Db::open(&path).expect("open sqlite"))),
        ("postgres", Box::new(move || Db::open_postgres(&url).expect("open postgres"))),
    ];
    (dir, list)
}

fn layer(n: u64) -> LayerRow {
    LayerRow::content(LayerId::content(&format!("{n:064x}")).unwrap(), 1, 1)
}

/// An image, a lineage of it, and `hosts` sandboxes working for it (each
/// having observed its empty head).
fn lineage(db: &mut Db, wc: &str, hosts: usize) -> (i64, Vec<SandboxId>) {
    let name = "busybox:latest".parse().unwrap();
    let digest = |c: char| format!("sha256:{}", c.to_string().repeat(64)).parse().unwrap();
    let image = db
        .insert_image(&name, &digest('a'), &digest('b'), &Default::default(), &[(layer(u64::MAX), digest('c'))])
        .unwrap();
    assert!(db.insert_work_context(&WorkContextRow::new(wc, image, StartKind::Image, None)).unwrap());
    let sandboxes = (0..hosts)
        .map(|_| {
            let id = SandboxId::random();
            let spec = SandboxSpec { work_context: Some(wc.into()), ..Default::default() };
            db.insert_running_sandbox(&id, image, &spec, 1, 1).unwrap();
            id
        })
        .collect();
    (image, sandboxes)
}

/// Append checkpoint `n` (its own layer) by sandbox `sb`; the fence if the
/// lineage's head moved since `sb` observed it.
fn append(db: &mut Db, image: i64, sb: &SandboxId, n: u64) -> Result<SnapshotRow, strata::catalog::Fence> {
    let l = layer(n);
    let mut snap = SnapshotRow::new(image, None, &l, sb, Default::default());
    db.append_checkpoint(sb, &mut snap, &l, false, false).unwrap().map(|()| snap)
}

#[test]
fn both_engines_open_at_the_same_schema_version() {
    strata_tests::require_root();
    let (_dir, engines) = engines();
    let versions: Vec<usize> = engines.iter().map(|(_, open)| open().schema_version().unwrap()).collect();
    assert_eq!(versions[0], versions[1]);
    // The same tables, columns and indexes.
    let outlines: Vec<_> = engines.iter().map(|(_, open)| open().schema_outline().unwrap()).collect();
    assert_eq!(outlines[0], outlines[1], "the two engines' schemas differ");
    assert!(outlines[0].iter().any(|e| e.starts_with("index snapshots_one_head")), "{:?}", outlines[0]);
    // Opening again migrates nothing.
    for (name, open) in engines {
        let (a, b) = (open(), open());
        assert_eq!(a.schema_version().unwrap(), b.schema_version().unwrap(), "{name}");
    }
}

#[test]
fn an_append_fenced_on_a_moved_head_changes_nothing() {
    strata_tests::require_root();
    let (_dir, engines) = engines();
    for (name, open) in engines {
        let mut db = open();
        let (image, sbs) = lineage(&mut db, "wc", 2);
        let first = append(&mut db, image, &sbs[0], 1).expect("first append");
        // The second sandbox observed the empty head: fenced.
        let fence = append(&mut db, image, &sbs[1], 2);
        assert!(fence.is_err(), "{name}: an append on a moved head must be fenced");
        let snaps = db.lineage_snapshots("wc").unwrap();
        assert_eq!(snaps.len(), 1, "{name}: the fenced append left a row");
        assert!(!db.layer_exists(layer(2).id.as_str()).unwrap(), "{name}: the fenced append left its layer");
        let wc = db.work_context("wc").unwrap().unwrap();
        assert_eq!((wc.head_id, wc.head_seq), (Some(first.id.clone()), 1), "{name}");
    }
}

/// Two hosts (two connections, two threads) race 100 appends to one
/// lineage: each append is fenced on the head its sandbox observed; a
/// fenced host observes the new head and tries again. Exactly one head,
/// sequence 1..=100 without a gap, and every loss a fence.
#[test]
fn two_hosts_racing_appends_leave_one_head_and_a_gap_free_lineage() {
    strata_tests::require_root();
    let (_dir, engines) = engines();
    for (name, open) in engines {
        let mut db = open();
        let (image, sbs) = lineage(&mut db, "race", 2);
        drop(db);
        let open = Arc::new(open);
        let total = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let barrier = Arc::new(Barrier::new(2));
        let threads: Vec<_> = sbs
            .iter()
            .enumerate()
            .map(|(host, sb)| {
                let mut db = open();
                let (sb, total, barrier) = (sb.clone(), total.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let (mut won, mut fenced) = (0u64, 0u64);
                    loop {
                        let n = total.load(std::sync::atomic::Ordering::SeqCst);
                        if n >= 100 {
                            return (won, fenced);
                        }
                        match append(&mut db, image, &sb, 1 + (host as u64) * 1000 + won + fenced) {
                            Ok(_) => {
                                won += 1;
                                total.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            }
                            Err(_) => {
                                // Lost: observe the new head (a scheduler
                                // resumes from it) and try again.
                                fenced += 1;
                                let head = db.work_context("race").unwrap().unwrap().head_id;
                                let spec = SandboxSpec {
                                    work_context: Some("race".into()),
                                    observed_head: head,
                                    ..Default::default()
                                };
                                db.set_sandbox_spec(&sb, &spec).unwrap();
                            }
                        }
                    }
                })
            })
            .collect();
        let results: Vec<(u64, u64)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let db = open();
        let snaps = db.lineage_snapshots("race").unwrap();
        let won: u64 = results.iter().map(|r| r.0).sum();
        assert!((100..=101).contains(&won), "{name}: {results:?}");
        assert_eq!(snaps.len() as u64, won, "{name}: every win is a snapshot, no loss is");
        let mut seqs: Vec<i64> = snaps.iter().map(|s| s.sequence.unwrap()).collect();
        seqs.sort();
        assert_eq!(seqs, (1..=won as i64).collect::<Vec<_>>(), "{name}: the sequence has a gap");
        let heads: Vec<_> = snaps.iter().filter(|s| s.state == SnapshotState::Ready).collect();
        assert_eq!(heads.len(), 1, "{name}: one ready head");
        let wc = db.work_context("race").unwrap().unwrap();
        assert_eq!(wc.head_id.as_ref(), Some(&heads[0].id), "{name}");
        assert_eq!(wc.head_seq, won as i64, "{name}");
        // Fenced appends left no layer row behind.
        let layers = db.all_layers().unwrap();
        assert_eq!(layers.len() as u64, won + 1, "{name}: one layer per snapshot and the image's");
        let fenced: u64 = results.iter().map(|r| r.1).sum();
        assert!(fenced > 0, "{name}: the two hosts never raced ({results:?})");
        eprintln!("{name}: (wins, fences) per host {results:?}");
    }
}

/// A catalog whose PostgreSQL session is cut (a server restart, a failover)
/// answers the call that met the cut with an error and connects again for
/// the next one.
#[test]
fn a_cut_postgres_session_is_opened_again() {
    strata_tests::require_root();
    let url = pg::database();
    let db = Db::open_postgres(&url).unwrap();
    assert!(db.list_images().unwrap().is_empty());
    let mut admin = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let cut = admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid != pg_backend_pid()",
            &[],
        )
        .unwrap();
    assert_eq!(cut, 1, "the catalog's one session");
    // The call that meets the cut fails (or, if the client noticed first,
    // already reconnects); the next one works.
    let _ = db.list_images();
    assert!(db.list_images().unwrap().is_empty());
}

/// A host frozen inside a transaction (SIGSTOPped, swapped out, its VM
/// paused) holds the fleet's writer lock. Its session ends once it sits
/// idle past its limit (the daemon's host deadline), so the other hosts'
/// writes (marking it down among them) go on; its next call connects
/// again, with the same limit.
#[test]
fn a_host_frozen_inside_a_transaction_does_not_stall_the_fleets_writes() {
    strata_tests::require_root();
    let url = pg::database();
    let limit = std::time::Duration::from_millis(300);
    let other = Db::open_postgres(&url).unwrap();
    let frozen = strata::catalog::sql::Conn::postgres(&url).unwrap();
    frozen.end_idle_transactions_after(limit).unwrap();
    let tx = frozen.transaction(true).unwrap();
    let waited = std::time::Instant::now();
    let (done, wrote) = std::sync::mpsc::channel();
    let writer = std::thread::spawn(move || done.send(other.mark_hosts_down().map(|down| down.len())));
    // Without the limit the write waits for as long as the host is frozen.
    match wrote.recv_timeout(std::time::Duration::from_secs(10)) {
        Ok(r) => assert_eq!(r.unwrap(), 0),
        Err(_) => panic!("another host's write still waits for the frozen transaction's lock after 10 s"),
    }
    assert!(waited.elapsed() >= limit / 2, "the write did not wait for the lock at all: {:?}", waited.elapsed());
    writer.join().unwrap().unwrap();
    // Thawed: its transaction is gone (the commit says so); the next call
    // is a new session under the same limit.
    assert!(tx.commit().is_err(), "a transaction the server ended committed");
    let shown: String = frozen.query_row("SHOW idle_in_transaction_session_timeout", &[], |r| r.get(0)).unwrap();
    assert_eq!(shown, "300ms");
}
