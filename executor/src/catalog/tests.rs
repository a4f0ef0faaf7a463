//! The catalog's own tests: schema, migrations, constraints and the
//! queries' rules, on SQLite in memory.

use rusqlite::params;

use super::*;
use crate::ids::{ImageName, LayerId, SandboxId};
use crate::oci::ImageConfig;

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
    assert!(db.conn.query_row("PRAGMA foreign_keys", &[], |r| r.get::<_, bool>(0)).unwrap(), "foreign keys back on");
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
    let wc =
        |db: &mut Db, id: &str| db.insert_work_context(&WorkContextRow::new(id, img, StartKind::Image, None)).unwrap();
    assert!(wc(&mut db, "w1"));
    assert!(!wc(&mut db, "w1"), "work context ids are unique");
    let l = "1".repeat(64);
    let snap = |db: &Db, id: &str, class: &str, state: &str, wc: Option<&str>, seq: Option<i64>, key: Option<&str>| {
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
    assert_eq!(db.begin_delete_snapshot("000000000000000a").unwrap(), Err(vec!["head of work context w1".to_string()]));
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
        let mut row = SnapshotRow::new(img, None, &l, &sb, Default::default());
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
    assert_eq!((got.state, got.info.capture_error.as_deref()), (SnapshotState::Failed, Some("no space")));
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
    let img = db.insert_image(&"a".parse().unwrap(), &digest('e'), &digest('c'), &ImageConfig::default(), &[]).unwrap();
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
    let img = db.insert_image(&"a".parse().unwrap(), &digest('e'), &digest('c'), &ImageConfig::default(), &[]).unwrap();
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
    let img = db.insert_image(&"a".parse().unwrap(), &digest('e'), &digest('c'), &ImageConfig::default(), &[]).unwrap();
    let id = SandboxId::random();
    db.insert_running_sandbox(&id, img, &crate::spec::SandboxSpec::default(), 42, 7).unwrap();
    assert!(db.conn.execute("UPDATE sandboxes SET state = 'bogus' WHERE id = ?1", params![id.as_str()]).is_err());
    let rows = db.list_sandboxes().unwrap();
    assert_eq!(rows[0].state, SandboxState::Running);
    assert_eq!(rows[0].shim_pid, Some(42));
}

#[test]
fn a_lost_hosts_sandbox_is_marked_stopped_only_while_that_host_is_down_and_stays_so() {
    use crate::catalog::hosts::HostClaim;
    let claim = |id, deadline_ms| HostClaim { id, machine: "m", root: "/r", version: "0", info: "{}", deadline_ms };
    let mut db = Db::open_in_memory().unwrap();
    db.register_host(&claim("b", 60_000)).unwrap();
    let img = db.insert_image(&"a".parse().unwrap(), &digest('e'), &digest('c'), &ImageConfig::default(), &[]).unwrap();
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
