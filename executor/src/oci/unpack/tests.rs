//! Unit tests of `unpack_layer`. They pass for a normal user: layers use the
//! caller's own uid/gid, and nothing needs mknod or trusted xattrs. The few
//! root-only behaviours (whiteouts, opaque dirs, foreign owners, file
//! capabilities) are in `root`, ignored by default, and assert they are root.

use super::*;
use crate::oci::corpus::{self, Entry, TarBuilder};
use crate::oci::sys;
use std::ffi::CStr;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use tempfile::TempDir;

struct Fixture {
    tmp: TempDir,
    dest: PathBuf,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("dest");
    fs::create_dir(&dest).unwrap();
    Fixture { tmp, dest }
}

/// Stores `tar` as a blob in `dir` with `compression` and describes it.
fn layer(dir: &Path, tar: &[u8], compression: Compression) -> LayerSource {
    let blob = match compression {
        Compression::None => tar.to_vec(),
        Compression::Gzip => corpus::gzip(tar),
        Compression::Zstd => zstd::encode_all(tar, 3).unwrap(),
    };
    let digest: Digest = corpus::write_blob(dir, &blob).parse().unwrap();
    LayerSource {
        blob_path: dir.join("blobs/sha256").join(digest.hex()),
        digest,
        size: blob.len() as u64,
        media_type: String::new(),
        diff_id: Digest::sha256(tar),
        compression,
    }
}

fn unpack_with(tar: &[u8], compression: Compression) -> (Fixture, Result<UnpackStats, UnpackError>) {
    let f = fixture();
    let l = layer(f.tmp.path(), tar, compression);
    let r = unpack_layer(&l, &f.dest);
    (f, r)
}

fn unpack(tar: &[u8]) -> (Fixture, Result<UnpackStats, UnpackError>) {
    unpack_with(tar, Compression::None)
}

/// Sorted `(path, kind, mode, size or link target)` of a tree.
fn tree(root: &Path) -> Vec<(String, char, u32, String)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, char, u32, String)>) {
        let mut names: Vec<_> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        names.sort();
        for p in names {
            let m = fs::symlink_metadata(&p).unwrap();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let t = m.file_type();
            let (kind, extra) = if t.is_dir() {
                ('d', String::new())
            } else if t.is_symlink() {
                ('l', fs::read_link(&p).unwrap().display().to_string())
            } else if t.is_fifo() {
                ('p', String::new())
            } else {
                ('f', m.len().to_string())
            };
            out.push((rel, kind, m.mode() & 0o7777, extra));
            if t.is_dir() {
                walk(root, &p, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out
}

fn with_mtime(mut e: Entry, mtime: u64) -> Entry {
    e.mtime = mtime;
    e
}

fn xattr(path: &Path, name: &CStr) -> Option<Vec<u8>> {
    sys::lgetxattr(path, name).ok()
}

#[test]
fn unpacks_files_dirs_links_and_metadata() {
    let mut tool = Entry::new(b'0', "bin/tool");
    tool.mode = 0o4755;
    tool.data = b"#!/bin/true\n".to_vec();
    let mut tagged = Entry::new(b'0', "etc/tagged");
    tagged.pax = vec![("mtime".into(), b"1700000000.5".to_vec())];
    let mut ro = Entry::new(b'5', "ro");
    ro.mode = 0o555;
    let tar = TarBuilder::new()
        .dir_mode("./", 0o751)
        .entry(with_mtime(Entry::new(b'5', "etc"), 1000))
        .entry(with_mtime(
            {
                let mut e = Entry::new(b'0', "etc/hostname");
                e.data = b"box\n".to_vec();
                e
            },
            2000,
        ))
        .entry(tool) // parent `bin` is implied
        .symlink("etc/localtime", "/usr/share/zoneinfo/UTC")
        .symlink("bin/sh", "../usr/bin/dash")
        .hardlink("bin/tool2", "bin/tool")
        .fifo("run/fifo")
        .entry(ro)
        .file("ro/inside", b"x")
        .file("replace", b"old")
        .file("replace", b"newer")
        .dir("keep")
        .file("keep/child", b"c")
        .dir_mode("keep", 0o700)
        .file("file-then-dir", b"f")
        .dir("file-then-dir")
        .entry(tagged)
        .finish();
    let (f, r) = unpack(&tar);
    let stats = r.unwrap();
    assert_eq!(stats.entries, 18);
    assert_eq!(stats.bytes, 4 + 12 + 1 + 3 + 5 + 1 + 1);
    assert_eq!(stats.tar_bytes, tar.len() as u64);

    let d = &f.dest;
    let t = tree(d);
    let find = |p: &str| t.iter().find(|e| e.0 == p).unwrap_or_else(|| panic!("{p} missing: {t:#?}"));
    assert_eq!(find("etc/hostname"), &("etc/hostname".into(), 'f', 0o644, "4".into()));
    assert_eq!(find("bin").1, 'd');
    assert_eq!(find("bin").2, 0o755, "implied parents are 0755");
    assert_eq!(find("bin/tool").2, 0o4755, "setuid survives");
    assert_eq!(find("etc/localtime").3, "/usr/share/zoneinfo/UTC");
    assert_eq!(find("bin/sh").3, "../usr/bin/dash");
    assert_eq!(find("run/fifo").1, 'p');
    assert_eq!(find("run/fifo").2, 0o644);
    assert_eq!(find("ro").2, 0o555, "read-only dir mode applied after its children");
    assert_eq!(fs::read(d.join("ro/inside")).unwrap(), b"x");
    assert_eq!(fs::read(d.join("replace")).unwrap(), b"newer");
    assert_eq!(find("keep").2, 0o700, "a dir declared twice keeps children, takes the last mode");
    assert!(d.join("keep/child").exists());
    assert_eq!(find("file-then-dir").1, 'd');
    assert_eq!(fs::metadata(d).unwrap().mode() & 0o7777, 0o751, "./ applies to the root");

    let ino = |p: &str| fs::symlink_metadata(d.join(p)).unwrap().ino();
    assert_eq!(ino("bin/tool"), ino("bin/tool2"));
    assert_eq!(fs::metadata(d.join("bin/tool")).unwrap().nlink(), 2);

    let meta = |p: &str| fs::symlink_metadata(d.join(p)).unwrap();
    assert_eq!(meta("etc").mtime(), 1000, "dir mtime set after its entries");
    assert_eq!(meta("etc/hostname").mtime(), 2000);
    assert_eq!(meta("etc/localtime").mtime(), corpus::MTIME as i64, "symlink mtime, not followed");
    assert_eq!(meta("etc/tagged").mtime(), 1_700_000_000);
    assert_eq!(meta("etc/tagged").mtime_nsec(), 500_000_000);
    let me = nix::unistd::geteuid().as_raw();
    assert!(t.iter().all(|e| meta(&e.0).uid() == me));
}

#[test]
fn user_xattrs_are_restored() {
    let mut f = Entry::new(b'0', "f");
    f.pax = vec![("SCHILY.xattr.user.test".into(), b"hello".to_vec())];
    let mut d = Entry::new(b'5', "d");
    d.pax = vec![("SCHILY.xattr.user.dir".into(), b"1".to_vec())];
    let (fx, r) = unpack(&TarBuilder::new().entry(f).entry(d).finish());
    r.unwrap();
    assert_eq!(xattr(&fx.dest.join("f"), c"user.test").as_deref(), Some(&b"hello"[..]));
    assert_eq!(xattr(&fx.dest.join("d"), c"user.dir").as_deref(), Some(&b"1"[..]));
}

#[test]
fn compressed_layers_unpack_like_plain_ones() {
    let tar = TarBuilder::new().dir("a").file("a/one", &[1u8; 100_000]).symlink("a/l", "one").finish();
    let (plain, r) = unpack_with(&tar, Compression::None);
    r.unwrap();
    for c in [Compression::Gzip, Compression::Zstd] {
        let (f, r) = unpack_with(&tar, c);
        assert_eq!(r.unwrap().tar_bytes, tar.len() as u64);
        assert_eq!(tree(&f.dest), tree(&plain.dest), "{c}");
    }
}

#[test]
fn blob_is_verified_before_anything_is_parsed() {
    let f = fixture();
    // This layer would escape if it were parsed; the digest check comes first.
    let tar = TarBuilder::new().file("../../escape", b"x").finish();
    let mut l = layer(f.tmp.path(), &tar, Compression::None);
    let mut blob = fs::read(&l.blob_path).unwrap();
    blob[600] ^= 1;
    fs::write(&l.blob_path, &blob).unwrap();
    let err = unpack_layer(&l, &f.dest).unwrap_err();
    assert!(matches!(err, UnpackError::BlobDigestMismatch { .. }), "{err}");
    assert_eq!(fs::read_dir(&f.dest).unwrap().count(), 0);

    l.size += 1;
    let err = unpack_layer(&l, &f.dest).unwrap_err();
    assert!(matches!(err, UnpackError::BlobSizeMismatch { .. }), "{err}");
}

#[test]
fn diff_id_mismatch_is_refused() {
    let f = fixture();
    let mut l = layer(f.tmp.path(), &corpus::small_layer(), Compression::Gzip);
    l.diff_id = Digest::sha256(b"other");
    let err = unpack_layer(&l, &f.dest).unwrap_err();
    assert!(matches!(err, UnpackError::DiffIdMismatch { .. }), "{err}");
    assert!(err.to_string().contains("the diff_id is"), "{err}");
}

/// Stores an already-compressed (possibly broken) gzip blob for `tar`.
fn gzip_layer(dir: &Path, tar: &[u8], blob: &[u8]) -> LayerSource {
    let digest: Digest = corpus::write_blob(dir, blob).parse().unwrap();
    LayerSource {
        blob_path: dir.join("blobs/sha256").join(digest.hex()),
        digest,
        size: blob.len() as u64,
        media_type: corpus::LAYER_GZIP.into(),
        diff_id: Digest::sha256(tar),
        compression: Compression::Gzip,
    }
}

#[test]
fn corrupt_gzip_is_refused() {
    let tar = corpus::small_layer();
    let good = corpus::gzip(&tar);
    let n = good.len();
    let mut bad_block = good.clone();
    bad_block[10] = 0xff; // reserved deflate block type
    let mut bad_crc = good.clone();
    bad_crc[n - 8] ^= 0xff; // CRC32 in the trailer
    let mut bad_len = good.clone();
    bad_len[n - 1] ^= 0xff; // ISIZE in the trailer
    let cut = good[..n - 4].to_vec(); // trailer cut short
    for (name, blob) in [("block", bad_block), ("crc", bad_crc), ("isize", bad_len), ("cut", cut)] {
        let f = fixture();
        let l = gzip_layer(f.tmp.path(), &tar, &blob);
        let err = unpack_layer(&l, &f.dest).unwrap_err();
        assert!(matches!(err, UnpackError::Decompress { .. }), "{name}: {err:?}");
        assert!(err.to_string().contains("corrupt gzip stream"), "{err}");
    }
}

#[test]
fn truncated_tar_is_refused() {
    let mut t = TarBuilder::new();
    t.file("f", &[7u8; 2000]);
    let whole = t.bytes();
    // Cut inside the file data.
    let (_, r) = unpack(&whole[..512 + 700]);
    assert!(matches!(r, Err(UnpackError::Truncated { .. })), "{r:?}");
    // Cut inside the data of an entry that has no file (a directory with a
    // declared size), which the extractor skips rather than writes.
    let mut t = TarBuilder::new();
    t.header_only(&Entry::new(b'5', "d"), 4096).raw(&[0u8; 100]);
    let (_, r) = unpack(&t.bytes());
    assert!(matches!(r, Err(UnpackError::Truncated { .. })), "{r:?}");
    // Cut inside a header.
    let (_, r) = unpack(&whole[..300]);
    assert!(matches!(r, Err(UnpackError::Tar { .. })), "{r:?}");
    // A gzip stream cut short is a decompression error.
    let gz = corpus::gzip(&whole);
    let f = fixture();
    let l = gzip_layer(f.tmp.path(), &whole, &gz[..gz.len() / 2]);
    let err = unpack_layer(&l, &f.dest).unwrap_err();
    assert!(matches!(err, UnpackError::Decompress { .. }), "{err:?}");
}

#[test]
fn hostile_corpus_is_refused_and_the_host_is_unchanged() {
    for compression in [Compression::None, Compression::Gzip] {
        for (name, layers, host_path) in corpus::hostile_cases() {
            let f = fixture();
            let (last, earlier) = layers.split_last().unwrap();
            for (i, tar) in earlier.iter().enumerate() {
                let dest = f.tmp.path().join(format!("earlier-{i}"));
                fs::create_dir(&dest).unwrap();
                unpack_layer(&layer(f.tmp.path(), tar, compression), &dest).unwrap();
            }
            let err = unpack_layer(&layer(f.tmp.path(), last, compression), &f.dest).expect_err(name).to_string();
            let want = corpus::expected_message(name);
            assert!(!want.is_empty() && err.contains(want), "{name}: {err}");
            if let Some(p) = host_path {
                assert!(fs::symlink_metadata(p).is_err(), "{name} created {p}");
            }
            // Nothing appeared next to the destination either.
            let mut beside: Vec<_> = fs::read_dir(f.tmp.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .filter(|n| !n.starts_with("earlier-"))
                .collect();
            beside.sort();
            assert_eq!(beside, ["blobs", "dest"], "{name}");
        }
    }
}

#[test]
fn errors_name_the_entry_and_the_symlink() {
    let tar = TarBuilder::new().dir("a").symlink("a/b", "/etc").file("a/b/c/passwd", b"x").finish();
    match unpack(&tar).1 {
        Err(UnpackError::ThroughSymlink { path, symlink, .. }) => {
            assert_eq!(path, Path::new("a/b/c/passwd"));
            assert_eq!(symlink, Path::new("a/b"));
        }
        other => panic!("{other:?}"),
    }
    let tar = TarBuilder::new().file("f", b"").file("f/g", b"").finish();
    match unpack(&tar).1 {
        Err(UnpackError::NotADirectory { component, .. }) => assert_eq!(component, Path::new("f")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn hardlink_targets_must_be_earlier_non_directories() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (TarBuilder::new().hardlink("l", "nothing").finish(), "points to nothing"),
        (TarBuilder::new().hardlink("l", "l").finish(), "points to nothing"),
        (TarBuilder::new().hardlink("l", "later").file("later", b"").finish(), "points to nothing"),
        (TarBuilder::new().dir("d").hardlink("l", "d").finish(), "points to a directory"),
        (TarBuilder::new().hardlink("l", "./").finish(), "points to a directory"),
        (TarBuilder::new().hardlink("l", "").finish(), "empty"),
    ];
    for (tar, want) in cases {
        let err = unpack(&tar).1.unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
    // A hard link to a symlink links the symlink itself.
    let tar = TarBuilder::new().symlink("s", "/etc/passwd").hardlink("l", "s").finish();
    let (f, r) = unpack(&tar);
    r.unwrap();
    let m = fs::symlink_metadata(f.dest.join("l")).unwrap();
    assert!(m.file_type().is_symlink());
    assert_eq!(m.ino(), fs::symlink_metadata(f.dest.join("s")).unwrap().ino());
}

#[test]
fn relative_symlinks_may_not_climb_above_the_root() {
    let ok = TarBuilder::new().symlink("a/b/c", "../../x").symlink("top", ".").symlink("abs", "/../../../etc").finish();
    unpack(&ok).1.unwrap();
    for target in ["../../x", "../..", "b/../../../x", "../a/../../x"] {
        let tar = TarBuilder::new().symlink("a/l", target).finish();
        let err = unpack(&tar).1.unwrap_err();
        assert!(matches!(err, UnpackError::SymlinkEscape { .. }), "{target}: {err}");
    }
    let err = unpack(&TarBuilder::new().symlink("l", "").finish()).1.unwrap_err();
    assert!(matches!(err, UnpackError::InvalidLinkTarget { .. }), "{err}");
}

#[test]
fn unsupported_entry_types_are_refused() {
    for flag in [b'Z', b'V', b'M'] {
        let tar = TarBuilder::new().entry(Entry::new(flag, "x")).finish();
        let err = unpack(&tar).1.unwrap_err();
        assert!(matches!(err, UnpackError::UnsupportedEntry { .. }), "{}: {err}", flag as char);
    }
    // GNU sparse: the `tar` crate refuses it in a ustar header; in a GNU
    // header it would reach `kind()`, which refuses it too.
    let tar = TarBuilder::new().entry(Entry::new(b'S', "x")).finish();
    assert!(unpack(&tar).1.is_err());
}

#[test]
fn owner_ids_must_fit_32_bits() {
    for id in ["4294967295", "4294967296"] {
        let mut e = Entry::new(b'0', "f");
        e.pax = vec![("uid".into(), id.as_bytes().to_vec())];
        let err = unpack(&TarBuilder::new().entry(e).finish()).1.unwrap_err();
        assert!(matches!(err, UnpackError::OwnerRange { .. }), "{err}");
    }
}

#[test]
fn non_directory_root_entries_are_refused() {
    let err = unpack(&TarBuilder::new().file("./", b"x").finish()).1.unwrap_err();
    assert!(matches!(err, UnpackError::RootNotDirectory { .. }), "{err}");
    let err = unpack(&TarBuilder::new().file("", b"x").finish()).1.unwrap_err();
    assert!(matches!(err, UnpackError::InvalidName { problem: PathError::Empty, .. }), "{err}");
}

#[test]
fn aufs_bookkeeping_and_global_headers_are_skipped() {
    let tar = TarBuilder::new()
        .entry(Entry::new(b'g', "pax_global_header"))
        .dir(".wh..wh.plnk")
        .file(".wh..wh.plnk/123.456", b"x")
        .file(".wh..wh.aufs", b"")
        .file("kept", b"k")
        .finish();
    let (f, r) = unpack(&tar);
    assert_eq!(r.unwrap().entries, 5);
    assert_eq!(tree(&f.dest), vec![("kept".into(), 'f', 0o644, "1".into())]);
}

#[test]
fn xattrs_outside_the_allowed_namespaces_are_skipped() {
    let mut e = Entry::new(b'0', "f");
    e.pax = vec![("SCHILY.xattr.security.selinux".into(), b"system_u:object_r:shadow_t:s0".to_vec())];
    let (f, r) = unpack(&TarBuilder::new().entry(e).finish());
    r.unwrap();
    assert!(f.dest.join("f").exists());
}

#[test]
fn destination_must_be_an_empty_directory() {
    let f = fixture();
    let l = layer(f.tmp.path(), &corpus::small_layer(), Compression::None);
    fs::write(f.dest.join("stale"), b"").unwrap();
    let err = unpack_layer(&l, &f.dest).unwrap_err();
    assert!(matches!(err, UnpackError::DestNotEmpty { .. }), "{err}");
    let link = f.tmp.path().join("link");
    std::os::unix::fs::symlink(f.tmp.path().join("blobs"), &link).unwrap();
    let err = unpack_layer(&l, &link).unwrap_err();
    assert!(matches!(err, UnpackError::Io { step: "open destination", .. }), "{err}");
}

#[test]
fn pax_times_keep_fractions() {
    let t = |s: &str| parse_pax_time(s.as_bytes()).map(|t| (t.tv_sec(), t.tv_nsec()));
    assert_eq!(t("1700000000"), Some((1_700_000_000, 0)));
    assert_eq!(t("1700000000.25"), Some((1_700_000_000, 250_000_000)));
    assert_eq!(t("1.123456789999"), Some((1, 123_456_789)));
    assert_eq!(t("-1.5"), Some((-2, 500_000_000)));
    assert_eq!(t("x"), None);
    assert_eq!(t("1.2e3"), None);
}

/// Behaviour that needs root. Run as root with
/// `cargo test -p strata-executor oci:: -- --ignored`.
mod root {
    use super::*;

    fn require_root() {
        assert!(nix::unistd::geteuid().is_root(), "this test needs root; it must not pass when skipped");
    }

    fn is_whiteout(p: &Path) -> bool {
        let m = fs::symlink_metadata(p).unwrap();
        m.file_type().is_char_device() && m.rdev() == 0
    }

    #[test]
    #[ignore = "needs root"]
    fn whiteouts_and_opaque_dirs_become_overlay_form() {
        require_root();
        let tar = TarBuilder::new()
            .file(".wh.gone", b"")
            .file("d/.wh..wh..opq", b"") // before its directory
            .dir("d")
            .file("d/new", b"n")
            .dir("x")
            .file("x/in", b"")
            .file(".wh.x", b"") // same-layer dir: kept, made opaque
            .file(".wh.y", b"")
            .dir("y") // deleted then re-created: opaque
            .file("f", b"")
            .file(".wh.f", b"") // same-layer file: kept
            .file(".wh.z", b"")
            .file("z/child", b"") // re-created as an implied parent: opaque
            .finish();
        let (f, r) = unpack(&tar);
        r.unwrap();
        let d = &f.dest;
        assert!(is_whiteout(&d.join("gone")));
        for dir in ["d", "x", "y", "z"] {
            assert_eq!(xattr(&d.join(dir), c"trusted.overlay.opaque").as_deref(), Some(&b"y"[..]), "{dir}");
        }
        assert!(d.join("d/new").exists() && d.join("x/in").exists() && d.join("z/child").exists());
        assert!(fs::symlink_metadata(d.join("f")).unwrap().is_file());
        assert_eq!(xattr(d, c"trusted.overlay.opaque"), None);
    }

    #[test]
    #[ignore = "needs root"]
    fn foreign_owners_setuid_and_capabilities_are_kept() {
        require_root();
        // vfs_cap_data v2, effective, permitted = CAP_NET_BIND_SERVICE.
        let mut cap = vec![0x01, 0x00, 0x00, 0x02, 0x00, 0x04, 0x00, 0x00];
        cap.resize(20, 0);
        let mut ping = Entry::new(b'0', "bin/ping");
        ping.uid = 1234;
        ping.gid = 5678;
        ping.mode = 0o4750;
        ping.data = b"elf".to_vec();
        ping.pax = vec![("SCHILY.xattr.security.capability".into(), cap.clone())];
        let mut dir = Entry::new(b'5', "home/user");
        dir.uid = 1000;
        dir.gid = 1000;
        dir.mode = 0o2770;
        let mut link = Entry::new(b'2', "home/user/link");
        link.uid = 1000;
        link.gid = 1001;
        link.link = b"/etc/shadow".to_vec();
        let tar = TarBuilder::new().entry(ping).entry(dir).entry(link).finish();
        let (f, r) = unpack(&tar);
        r.unwrap();
        let m = fs::metadata(f.dest.join("bin/ping")).unwrap();
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (1234, 5678, 0o4750));
        assert_eq!(xattr(&f.dest.join("bin/ping"), c"security.capability"), Some(cap));
        let m = fs::metadata(f.dest.join("home/user")).unwrap();
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (1000, 1000, 0o2770));
        let m = fs::symlink_metadata(f.dest.join("home/user/link")).unwrap();
        assert_eq!((m.uid(), m.gid()), (1000, 1001));
        // The symlink's target was not touched.
        assert_eq!(fs::metadata("/etc/shadow").unwrap().uid(), 0);
    }
}

/// A GNU sparse entry (PAX 1.0) at `path` claiming `size` bytes, with
/// `map` as its map text and `data` after it.
fn sparse_entry(path: &str, size: &str, map: &str, data: &[u8]) -> Entry {
    let mut e = Entry::new(b'0', path);
    e.pax = vec![
        ("GNU.sparse.major".into(), b"1".to_vec()),
        ("GNU.sparse.minor".into(), b"0".to_vec()),
        ("GNU.sparse.name".into(), path.as_bytes().to_vec()),
        ("GNU.sparse.realsize".into(), size.as_bytes().to_vec()),
    ];
    let mut body = map.as_bytes().to_vec();
    body.resize(body.len().next_multiple_of(512), 0);
    body.extend_from_slice(data);
    e.data = body;
    e
}

#[test]
fn sparse_files_keep_their_holes_whatever_size_they_claim() {
    // 1 TiB claimed, two extents of data: unpacked at once, no disk used.
    let e = sparse_entry("big", "1099511627776", "2\n0\n3\n1099511627000\n4\n", b"abcwxyz");
    let (f, r) = unpack(&TarBuilder::new().entry(e).finish());
    let stats = r.unwrap();
    assert_eq!(stats.bytes, 1 << 40);
    let file = File::open(f.dest.join("big")).unwrap();
    let m = file.metadata().unwrap();
    assert_eq!(m.len(), 1 << 40);
    assert!(m.blocks() < 64, "written out: {} blocks", m.blocks());
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 4];
    file.read_exact_at(&mut buf[..3], 0).unwrap();
    assert_eq!(&buf[..3], b"abc");
    file.read_exact_at(&mut buf, 1099511627000).unwrap();
    assert_eq!(&buf, b"wxyz");
    file.read_exact_at(&mut buf, 1 << 30).unwrap();
    assert_eq!(buf, [0; 4]);
    // No extents at all: all hole.
    let (f, r) = unpack(&TarBuilder::new().entry(sparse_entry("none", "4096", "0\n", b"")).finish());
    r.unwrap();
    assert_eq!(fs::read(f.dest.join("none")).unwrap(), vec![0u8; 4096]);
}

#[test]
fn malformed_sparse_files_are_refused() {
    let cases: Vec<(&str, Entry)> = vec![
        ("not decimal", sparse_entry("f", "100", "1\n0x0\n3\n", b"abc")),
        ("ends early", sparse_entry("f", "100", "2\n0\n3\n", b"abc")),
        ("too many", sparse_entry("f", "100", "99999999999\n", b"")),
        ("overlap", sparse_entry("f", "100", "2\n0\n3\n2\n3\n", b"abcdef")),
        ("past its size", sparse_entry("f", "100", "1\n98\n3\n", b"abc")),
        ("trailing data", sparse_entry("f", "100", "1\n0\n3\n", b"abcdef")),
        ("short data", sparse_entry("f", "100", "1\n0\n9\n", b"abc")),
        ("bad size", sparse_entry("f", "-1", "0\n", b"")),
        ("huge size", sparse_entry("f", "18446744073709551615", "0\n", b"")),
    ];
    for (what, e) in cases {
        let (f, r) = unpack(&TarBuilder::new().entry(e).finish());
        let err = r.expect_err(what);
        assert!(matches!(err, UnpackError::InvalidSparse { .. } | UnpackError::Truncated { .. }), "{what}: {err}");
        let _ = f;
    }
    // A name that is not the entry's path: readers would disagree on where it goes.
    let mut e = sparse_entry("a", "10", "0\n", b"");
    e.pax[2].1 = b"b".to_vec();
    let err = unpack(&TarBuilder::new().entry(e).finish()).1.unwrap_err();
    assert!(err.to_string().contains("GNU.sparse.name"), "{err}");
    // Other sparse formats (0.0/0.1 keep the map in PAX records) are refused,
    // not read as plain files of map and packed data.
    let mut e = Entry::new(b'0', "old");
    e.pax = vec![("GNU.sparse.map".into(), b"0,3".to_vec()), ("GNU.sparse.size".into(), b"10".to_vec())];
    e.data = b"abc".to_vec();
    let err = unpack(&TarBuilder::new().entry(e).finish()).1.unwrap_err();
    assert!(matches!(err, UnpackError::UnsupportedEntry { .. }), "{err}");
}
