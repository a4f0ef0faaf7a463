//! Unit tests of `checkpoint`.

use super::*;
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;

/// A tree with an empty file, a small one, a dense one of 2 MiB, and a
/// sparse one (data, a hole, data, a trailing hole), which the tar holds
/// as a sparse entry of its data.
fn tree(root: &Path) {
    std::fs::write(root.join("empty"), b"").unwrap();
    std::fs::write(root.join("small"), b"hello\n").unwrap();
    std::fs::write(root.join("dense"), vec![5u8; 2 << 20]).unwrap();
    let mut f = std::fs::File::create(root.join("sparse")).unwrap();
    f.write_all(&[1u8; 100_000]).unwrap();
    f.seek(SeekFrom::Start(64 << 20)).unwrap();
    f.write_all(&[2u8; 5000]).unwrap();
    f.set_len(200 << 20).unwrap();
}

/// The spliced capture writes the same tar, byte for byte, as the one
/// that reads and writes every byte; on one file system it stays
/// sparse, and from another (no copy_file_range across) it falls back.
#[test]
fn spliced_capture_is_the_same_tar() {
    let out = tempfile::tempdir_in("/var/tmp").unwrap();
    for (i, src) in ["/var/tmp", "/dev/shm"].iter().enumerate() {
        let upper = tempfile::tempdir_in(src).unwrap();
        tree(upper.path());
        let mut plain = Vec::new();
        diff::write_delta_unhashed(upper.path(), &mut plain, None, None).unwrap();

        let path = out.path().join(format!("t{i}"));
        let mut w = BufWriter::new(SparseFile::new(std::fs::File::create(&path).unwrap(), None));
        let (stats, _) = diff::write_delta_unhashed(upper.path(), &mut w, Some(splice_into_tar), None).unwrap();
        let sf = w.into_inner().map_err(|e| e.into_error()).unwrap();
        let spliced_here = sf.splice;
        sf.finish().unwrap();
        let spliced = std::fs::read(&path).unwrap();
        assert_eq!(stats.tar_bytes, spliced.len() as u64);
        assert!(spliced == plain, "tar from {src} differs ({} vs {} bytes)", spliced.len(), plain.len());
        assert_eq!(spliced_here, *src == "/var/tmp", "copy_file_range used from {src}");
        let on_disk = std::fs::metadata(&path).unwrap().blocks() * 512;
        assert!(on_disk < 8 << 20, "the 200 MiB sparse file from {src} took {on_disk} bytes in the tar");
    }
}

/// Reads a tar while it is written, on another thread.
fn follow(tar: &Path, progress: &Arc<TarProgress>) -> std::thread::JoinHandle<std::io::Result<Vec<u8>>> {
    use std::io::Read;
    let mut follower = TarFollower::new(tar, progress.clone());
    std::thread::spawn(move || {
        let mut all = Vec::new();
        follower.read_to_end(&mut all).map(|_| all)
    })
}

/// Writes `u`'s capture ahead into `out`, as a checkpoint does before
/// the freeze; returns it and its tar as a follower read it.
fn ahead(u: &Path, out: &Path) -> (Speculation, Vec<u8>) {
    let tar = out.join("ahead.tar");
    let progress = Arc::new(TarProgress::default());
    let followed = follow(&tar, &progress);
    let copier = Precopier::new(u, &out.join("pre")).unwrap().expect("/var/tmp on ext4, XFS or btrfs");
    let spec = speculate(u, &tar, copier, progress, &super::super::Gone::default(), None);
    (spec, followed.join().unwrap().unwrap())
}

/// The frozen capture's writing (without the freeze) after `spec`:
/// its stats, segments, and whether it is the tar written ahead.
fn frozen(
    u: &Path,
    tar: &Path,
    spec: &Speculation,
    progress: Option<Arc<TarProgress>>,
) -> (DeltaStats, Vec<Segment>, bool) {
    let mut sf = SparseFile::new(std::fs::File::create(tar).unwrap(), progress.clone());
    sf.compare(spec.ahead.as_ref().unwrap()).unwrap();
    sf.pre = Some(spec.pre.clone());
    let mut w = BufWriter::new(sf);
    let (stats, _) = diff::write_delta_unhashed(u, &mut w, Some(splice_into_tar), None).unwrap();
    let mut sf = w.into_inner().map_err(|e| e.into_error()).unwrap();
    let same = sf.same();
    let segments = std::mem::take(&mut sf.segments);
    sf.finish().unwrap();
    if let Some(p) = progress {
        p.end(true);
    }
    (stats, segments, same)
}

/// Written ahead, the capture is the plain tar (large files pre-copied,
/// small ones not); frozen after a change, it writes only headers,
/// small files, holes and what changed, and read back with its
/// segments it is the plain tar byte for byte (while followed, and
/// once finished), and not the same tar as ahead; the unpacker links the
/// copies.
#[test]
fn precopied_capture_reads_as_the_same_tar() {
    use std::io::Read;
    use std::os::unix::fs::FileExt;
    let upper = tempfile::tempdir_in("/var/tmp").unwrap();
    let out = tempfile::tempdir_in("/var/tmp").unwrap();
    let u = upper.path();
    tree(u);
    std::fs::create_dir(u.join("d")).unwrap();
    std::fs::write(u.join("d/big"), vec![3u8; (4 << 20) + 17]).unwrap();
    std::fs::write(u.join("d/changed"), vec![4u8; 2 << 20]).unwrap();
    std::fs::hard_link(u.join("d/big"), u.join("link")).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    let mut plain = Vec::new();
    diff::write_delta_unhashed(u, &mut plain, None, None).unwrap();
    let (spec, written) = ahead(u, out.path());
    assert!(written == plain, "the tar written ahead differs");
    let copied = (4 << 20) + 17 + (2 << 20) + (2 << 20);
    assert_eq!(spec.pre.bytes, copied, "dense, big (once for both names), changed; not small, not sparse");
    std::fs::OpenOptions::new().write(true).open(u.join("d/changed")).unwrap().write_all_at(b"new", 9).unwrap();
    let mut plain = Vec::new();
    diff::write_delta_unhashed(u, &mut plain, None, None).unwrap();

    let tar = out.path().join("t");
    let progress = Arc::new(TarProgress::default());
    let followed = follow(&tar, &progress);
    let (stats, segments, same) = frozen(u, &tar, &spec, Some(progress));
    assert_eq!(stats.tar_bytes, plain.len() as u64);
    let lens: Vec<u64> = segments.iter().map(|s| s.len).collect();
    assert_eq!(lens, [(4 << 20) + 17, 2 << 20], "d/big and dense referred to, d/changed copied, sparse in extents");
    assert!(std::fs::metadata(&tar).unwrap().blocks() * 512 < 4 << 20, "the tar has holes for them");
    assert!(followed.join().unwrap().unwrap() == plain, "the followed tar differs");
    assert!(!same, "a changed tree, the same tar");

    let cap = Capture {
        tar: tar.clone(),
        diff_id: None,
        stats,
        frozen: Duration::ZERO,
        segments,
        same_as_ahead: same,
        stamps: Default::default(),
    };
    let mut finished = Vec::new();
    TarFollower::finished(&cap).unwrap().read_to_end(&mut finished).unwrap();
    assert!(finished == plain, "the finished tar differs");

    let dest = out.path().join("fs");
    std::fs::create_dir(&dest).unwrap();
    let reader = TarFollower::finished(&cap).unwrap();
    let (_, digest) = crate::oci::unpack_capture(reader, &|at, len| cap.prepared(at, len), &dest).unwrap();
    use sha2::Digest as _;
    assert_eq!(digest.hex(), hex::encode(sha2::Sha256::digest(&plain)));
    let big = std::fs::metadata(dest.join("d/big")).unwrap();
    assert_eq!(big.ino(), std::fs::metadata(&cap.segments[0].copy.path).unwrap().ino(), "linked");
    assert_eq!(big.mode() & 0o7777, std::fs::metadata(u.join("d/big")).unwrap().mode() & 0o7777);
    assert_eq!(std::fs::read(dest.join("link")).unwrap(), vec![3u8; (4 << 20) + 17]);
    assert_eq!(&std::fs::read(dest.join("d/changed")).unwrap()[9..12], b"new");
    assert_eq!(std::fs::read(dest.join("sparse")).unwrap(), std::fs::read(u.join("sparse")).unwrap());
}

/// The frozen capture is the one written ahead exactly while the tree
/// is the same: a small file's bytes changed (same size, mtime put
/// back) make it differ, and putting them back makes it equal again.
#[test]
fn a_capture_written_ahead_holds_only_while_nothing_changed() {
    use nix::sys::stat::{utimensat, UtimensatFlags};
    use nix::sys::time::TimeSpec;
    use std::os::unix::fs::MetadataExt;
    let upper = tempfile::tempdir_in("/var/tmp").unwrap();
    let out = tempfile::tempdir_in("/var/tmp").unwrap();
    let u = upper.path();
    std::fs::write(u.join("large"), vec![5u8; 64 << 10]).unwrap();
    std::fs::write(u.join("small"), b"before").unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    let (spec, _) = ahead(u, out.path());
    assert_eq!(spec.pre.bytes, 64 << 10, "only the large file is copied");
    let same = |n: &str| frozen(u, &out.path().join(n), &spec, None).2;
    assert!(same("1"), "unchanged, yet another tar");

    let mtime = std::fs::metadata(u.join("small")).unwrap();
    let put = |bytes: &[u8]| {
        std::fs::write(u.join("small"), bytes).unwrap();
        let t = TimeSpec::new(mtime.mtime(), mtime.mtime_nsec());
        utimensat(None, &u.join("small"), &t, &t, UtimensatFlags::NoFollowSymlink).unwrap();
    };
    put(b"after!");
    assert!(!same("2"), "changed bytes, the same tar");
    put(b"before");
    assert!(same("3"));
}

/// A large file that cannot be copied ahead (here: open for writing)
/// will be spliced uncompared while frozen, so nothing written ahead
/// is kept to be confirmed, and its follower is stopped; the other
/// copies still are.
#[test]
fn a_large_file_not_copied_leaves_nothing_to_confirm() {
    use std::io::Read;
    let upper = tempfile::tempdir_in("/var/tmp").unwrap();
    let out = tempfile::tempdir_in("/var/tmp").unwrap();
    let u = upper.path();
    std::fs::write(u.join("a-copied"), vec![1u8; 64 << 10]).unwrap();
    std::fs::write(u.join("b-open"), vec![2u8; 2 << 20]).unwrap();
    let _writer = std::fs::OpenOptions::new().write(true).open(u.join("b-open")).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    let tar = out.path().join("ahead.tar");
    let progress = Arc::new(TarProgress::default());
    let mut follower = TarFollower::new(&tar, progress.clone());
    let copier = Precopier::new(u, &out.path().join("pre")).unwrap().unwrap();
    let spec = speculate(u, &tar, copier, progress, &super::super::Gone::default(), None);
    assert!(spec.ahead.unwrap_err().contains("could not be copied"));
    assert_eq!(spec.pre.bytes, 64 << 10, "the small file is still copied");
    let mut all = Vec::new();
    assert!(follower.read_to_end(&mut all).is_err(), "the follower was not stopped");
}

#[test]
fn a_writer_that_panics_does_not_leave_its_follower_waiting() {
    use std::io::Read;
    let out = tempfile::tempdir().unwrap();
    let tar = out.path().join("layer.tar");
    let progress = Arc::new(TarProgress::default());
    let mut follower = TarFollower::new(&tar, progress.clone());
    let (done, read) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut all = Vec::new();
        let _ = done.send(follower.read_to_end(&mut all).map(|_| all.len()));
    });
    let writer = {
        let tar = tar.clone();
        std::thread::spawn(move || {
            let _ends = progress.end_on_drop();
            std::fs::write(&tar, [7u8; 1000]).unwrap();
            progress.publish(1000);
            panic!("a bug in the walk");
        })
    };
    assert!(writer.join().is_err());
    let got = read.recv_timeout(Duration::from_secs(10)).expect("the follower still waits");
    assert!(got.is_err(), "a tar cut short by a panic was read as whole: {got:?}");
}

#[test]
fn a_normal_end_outlives_the_guard() {
    let progress = Arc::new(TarProgress::default());
    let guard = progress.end_on_drop();
    progress.end(true);
    drop(guard);
    assert_eq!(progress.lock().end, Some(true));
}
