//! What a checkpoint's capture saw of each entry of a sandbox's upper dir
//! (its [`Stamp`]: inode, ctime in ns, size, mode), so that the next
//! checkpoint writes only what changed since (`diff.rs`), without reading
//! any unchanged file's data.
//!
//! Why the ctime: every change to an inode's data or metadata (write,
//! truncate, chmod, chown, xattr, a link added or removed, a rename) sets
//! it to the current time, and nothing can set it back (unlike the mtime).
//! An entry whose inode, ctime, size and mode are what the last capture
//! recorded is the one that capture wrote. Two things could defeat that,
//! and are ruled out:
//! - A change right after the thaw stamped with the same ctime as one
//!   right before the freeze (file systems stamp with the coarse clock,
//!   one tick of 1 to 10 ms): an entry whose ctime is within two ticks of
//!   the capture's start ([`racy_window_ns`]) is recorded as racy and
//!   written again next time (git's "racily clean" index entries, the
//!   same answer). A change after the thaw is stamped at least the thaw
//!   less one tick, later than the capture's start less one tick.
//! - A stamp taken from another tree: the stamps name the checkpoint they
//!   describe, the snapshot the sandbox started from, and the upper dir's
//!   inode, and are used only when all three still hold.
//!
//! The record is a small binary file next to the sandbox (`stamps`),
//! replaced by rename, so a daemon killed while writing it leaves the old
//! one, which names a checkpoint that either exists (and is still right)
//! or not (and is ignored).
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

/// How close to the capture's start a ctime makes an entry racy: two
/// ticks of the coarse clock file systems stamp with (8 ms at HZ=250;
/// 20 ms if the clock cannot tell).
pub fn racy_window_ns() -> i128 {
    static WINDOW: std::sync::OnceLock<i128> = std::sync::OnceLock::new();
    *WINDOW.get_or_init(|| {
        let tick = nix::time::clock_getres(nix::time::ClockId::CLOCK_REALTIME_COARSE)
            .map(|t| i128::from(t.tv_sec()) * 1_000_000_000 + i128::from(t.tv_nsec()))
            .unwrap_or(10_000_000);
        2 * tick.clamp(1_000_000, 10_000_000)
    })
}

/// One upper entry as a capture saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub ino: u64,
    pub ctime_ns: i128,
    pub size: u64,
    pub mode: u32,
    /// A directory marked opaque by overlay (made where a lower had one).
    pub opaque: bool,
    /// Changed too close to the capture to be told apart from a change
    /// right after it: never taken as unchanged.
    pub racy: bool,
}

impl Stamp {
    pub fn is_dir(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFDIR
    }

    /// Whether `now` is this entry unchanged.
    pub fn unchanged(&self, now: &Stamp) -> bool {
        !self.racy
            && (self.ino, self.ctime_ns, self.size, self.mode, self.opaque)
                == (now.ino, now.ctime_ns, now.size, now.mode, now.opaque)
    }

    /// Whether `now` is the directory recorded (so its entries not listed
    /// as changed are in the earlier layer). A file system may give a
    /// directory made again the inode number of the one removed (ext4
    /// does): one that is opaque now and was not is made again, over a
    /// lower's (overlay marks only a new directory opaque). One that was
    /// opaque and is made again with the same number is opaque again, and
    /// taking it as the same is right: the earlier layer's opaque copy
    /// hides what is below it, and what it held that is gone now gets a
    /// whiteout.
    pub fn same_dir(&self, now: &Stamp) -> bool {
        self.is_dir() && now.is_dir() && self.ino == now.ino && (self.opaque || !now.opaque)
    }
}

/// What one capture saw: for each directory of the upper (by its path in
/// the tree, "" for the root), its entries' names (byte-sorted) and stamps.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stamps {
    dirs: HashMap<PathBuf, Vec<(OsString, Stamp)>>,
    /// The capture's start (ns since the epoch): later ctimes are racy.
    pub taken_ns: i128,
}

/// Which tree some stamps describe: checked before they are used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The checkpoint whose capture recorded them.
    pub snapshot: String,
    /// The snapshot the sandbox started from ("" for its image).
    pub base: String,
    /// The upper dir's (dev, ino).
    pub upper: (u64, u64),
}

const MAGIC: &[u8; 16] = b"strata-stamps 1\n";

impl Stamps {
    /// Stamps for a capture starting now.
    pub fn new(taken_ns: i128) -> Stamps {
        Stamps { dirs: HashMap::new(), taken_ns }
    }

    /// The recorded entries of the directory at `rel`, if it was recorded.
    pub fn children(&self, rel: &Path) -> Option<&[(OsString, Stamp)]> {
        self.dirs.get(rel).map(Vec::as_slice)
    }

    /// Record the directory at `rel` (its entries are added as they are
    /// seen, in name order).
    pub fn open_dir(&mut self, rel: &Path) {
        self.dirs.entry(rel.to_path_buf()).or_default();
    }

    /// Record `name` in the directory at `rel`, racy if its ctime is too
    /// close to the capture's start.
    pub fn record(&mut self, rel: &Path, name: &std::ffi::OsStr, mut stamp: Stamp) {
        stamp.racy |= stamp.ctime_ns >= self.taken_ns - racy_window_ns();
        self.dirs.entry(rel.to_path_buf()).or_default().push((name.to_os_string(), stamp));
    }

    /// How many entries are recorded.
    pub fn len(&self) -> usize {
        self.dirs.values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Write them, with their origin, to `path` (by a rename: whole or
    /// not at all).
    pub fn save(&self, origin: &Origin, path: &Path) -> io::Result<()> {
        let tmp = path.with_extension("tmp");
        let mut w = io::BufWriter::new(std::fs::File::create(&tmp)?);
        w.write_all(MAGIC)?;
        put_bytes(&mut w, origin.snapshot.as_bytes())?;
        put_bytes(&mut w, origin.base.as_bytes())?;
        w.write_all(&origin.upper.0.to_le_bytes())?;
        w.write_all(&origin.upper.1.to_le_bytes())?;
        w.write_all(&self.taken_ns.to_le_bytes())?;
        let mut dirs: Vec<_> = self.dirs.iter().collect();
        dirs.sort_by(|a, b| a.0.cmp(b.0));
        w.write_all(&(dirs.len() as u64).to_le_bytes())?;
        for (rel, entries) in dirs {
            put_bytes(&mut w, rel.as_os_str().as_bytes())?;
            w.write_all(&(entries.len() as u64).to_le_bytes())?;
            for (name, s) in entries {
                put_bytes(&mut w, name.as_bytes())?;
                w.write_all(&s.ino.to_le_bytes())?;
                w.write_all(&s.ctime_ns.to_le_bytes())?;
                w.write_all(&s.size.to_le_bytes())?;
                w.write_all(&s.mode.to_le_bytes())?;
                w.write_all(&[s.racy as u8 | (s.opaque as u8) << 1])?;
            }
        }
        w.into_inner().map_err(|e| e.into_error())?;
        std::fs::rename(&tmp, path)
    }

    /// Read what [`Stamps::save`] wrote; `None` if there is nothing there.
    pub fn load(path: &Path) -> io::Result<Option<(Origin, Stamps)>> {
        let f = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut r = io::BufReader::new(f);
        let mut magic = [0u8; 16];
        r.read_exact(&mut magic)?;
        if &magic != MAGIC {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a stamps file"));
        }
        let text = |b: Vec<u8>| String::from_utf8(b).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e));
        let snapshot = text(get_bytes(&mut r)?)?;
        let base = text(get_bytes(&mut r)?)?;
        let upper = (get_u64(&mut r)?, get_u64(&mut r)?);
        let mut stamps = Stamps::new(get_i128(&mut r)?);
        for _ in 0..get_u64(&mut r)? {
            let rel = PathBuf::from(OsString::from_vec(get_bytes(&mut r)?));
            let n = get_u64(&mut r)?;
            let mut entries = Vec::with_capacity(n.min(1 << 16) as usize);
            for _ in 0..n {
                let name = OsString::from_vec(get_bytes(&mut r)?);
                let (ino, ctime_ns, size) = (get_u64(&mut r)?, get_i128(&mut r)?, get_u64(&mut r)?);
                let mut m = [0u8; 5];
                r.read_exact(&mut m)?;
                let mode = u32::from_le_bytes([m[0], m[1], m[2], m[3]]);
                let (racy, opaque) = (m[4] & 1 != 0, m[4] & 2 != 0);
                entries.push((name, Stamp { ino, ctime_ns, size, mode, opaque, racy }));
            }
            stamps.dirs.insert(rel, entries);
        }
        Ok(Some((Origin { snapshot, base, upper }, stamps)))
    }
}

/// What [`prune`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pruned {
    /// Entries removed: unchanged since the capture, in its layer already.
    pub removed: u64,
    /// Whiteouts made for names gone since.
    pub whiteouts: u64,
    /// Directories made again since, marked opaque.
    pub opaque_dirs: u64,
    /// Removals that failed (the entry stays: the layer is still right,
    /// only larger).
    pub failed: u64,
}

/// What [`prune`] will do, decided before it changes anything.
#[derive(Debug, Default)]
struct Plan {
    whiteouts: Vec<PathBuf>,
    opaque: Vec<PathBuf>,
    /// Directories that are the ones recorded: never opaque in the layer.
    not_opaque: Vec<PathBuf>,
    /// Unchanged entries, children before their directory.
    remove: Vec<(PathBuf, bool)>,
}

const OPAQUE: &std::ffi::CStr = c"trusted.overlay.opaque";

/// Make `layer`, a stopped sandbox's upper moved into the layer store
/// (overlay form: 0/0 character devices are whiteouts, an opaque directory
/// has `trusted.overlay.opaque=y`), the increment over the capture that
/// recorded `since`, in place and without reading file data: the same
/// decisions `diff.rs` makes for an incremental capture. Nothing else may
/// use the tree meanwhile.
///
/// In two steps, so that a failure never leaves a tree that is neither:
/// first the whiteouts for names gone since and the opaque marks of
/// directories made again (the tree stays right as the whole upper it
/// was: those names are gone, those directories replaced); an error
/// there is returned, and the tree can go back to the sandbox. Then, the
/// tree being right as an increment, the opaque marks of the directories
/// that are the ones recorded go (their other entries are in the earlier
/// layer) and the unchanged entries are removed, each step keeping it
/// right as an increment; a failure there only leaves an entry in
/// ([`Pruned::failed`]).
pub fn prune(layer: &Path, since: &Stamps) -> io::Result<Pruned> {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    let mut plan = Plan::default();
    plan_dir(layer, Path::new(""), since, &mut plan)?;
    let mut p = Pruned::default();
    for w in &plan.whiteouts {
        mknod(w, SFlag::S_IFCHR, Mode::empty(), makedev(0, 0))?;
        p.whiteouts += 1;
    }
    for d in &plan.opaque {
        strata_shim::sys::lsetxattr(&cpath(d)?, OPAQUE, b"y")?;
        p.opaque_dirs += 1;
    }
    for d in &plan.not_opaque {
        match strata_shim::sys::lremovexattr(&cpath(d)?, OPAQUE) {
            Ok(()) | Err(nix::errno::Errno::ENODATA) => {}
            // Left opaque, it would hide the earlier layer's entries: its
            // own are kept (the removals below are of other entries).
            Err(e) => {
                tracing::warn!("prune {}: {e}", d.display());
                p.failed += 1;
            }
        }
    }
    for (path, dir) in &plan.remove {
        let r = if *dir { std::fs::remove_dir(path) } else { std::fs::remove_file(path) };
        match r {
            Ok(()) => p.removed += 1,
            Err(_) => p.failed += 1,
        }
    }
    Ok(p)
}

fn cpath(p: &Path) -> io::Result<std::ffi::CString> {
    std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|_| io::ErrorKind::InvalidInput.into())
}

/// Plan the directory at `rel`; whether it will be empty after.
fn plan_dir(root: &Path, rel: &Path, since: &Stamps, plan: &mut Plan) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let dir = root.join(rel);
    let mut names: Vec<OsString> =
        std::fs::read_dir(&dir)?.map(|e| e.map(|e| e.file_name())).collect::<Result<_, _>>()?;
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    let mut before = since.children(rel).unwrap_or_default().iter().peekable();
    let mut left = 0usize;
    for name in names {
        while let Some((gone, _)) = before.next_if(|(b, _)| b.as_bytes() < name.as_bytes()) {
            plan.whiteouts.push(dir.join(gone));
            left += 1;
        }
        let was = before.next_if(|(b, _)| *b == name).map(|(_, s)| *s);
        let path = dir.join(&name);
        let m = std::fs::symlink_metadata(&path)?;
        let opaque = m.is_dir() && strata_shim::sys::lgetxattr(&cpath(&path)?, OPAQUE).is_ok_and(|v| v == b"y");
        let now = Stamp {
            ino: m.ino(),
            ctime_ns: i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()),
            size: m.size(),
            mode: m.mode(),
            opaque,
            racy: false,
        };
        let same_dir = was.is_some_and(|w| w.same_dir(&now));
        let unchanged = was.is_some_and(|w| w.unchanged(&now));
        if same_dir {
            plan.not_opaque.push(path.clone());
            if plan_dir(root, &rel.join(&name), since, plan)? && unchanged {
                plan.remove.push((path, true));
                continue;
            }
        } else if unchanged {
            plan.remove.push((path, false));
            continue;
        } else if m.is_dir() && was.is_some() {
            plan.opaque.push(path);
        }
        left += 1;
    }
    for (gone, _) in before {
        plan.whiteouts.push(dir.join(gone));
        left += 1;
    }
    Ok(left == 0)
}

fn put_bytes(w: &mut impl Write, b: &[u8]) -> io::Result<()> {
    w.write_all(&(b.len() as u32).to_le_bytes())?;
    w.write_all(b)
}

fn get_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn get_i128(r: &mut impl Read) -> io::Result<i128> {
    let mut b = [0u8; 16];
    r.read_exact(&mut b)?;
    Ok(i128::from_le_bytes(b))
}

fn get_bytes(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    let len = u32::from_le_bytes(b) as usize;
    if len > 1 << 20 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "a name longer than 1 MiB"));
    }
    let mut v = vec![0u8; len];
    r.read_exact(&mut v)?;
    Ok(v)
}

/// Now, in ns since the epoch.
pub fn now_ns() -> i128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i128)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_round_trip_and_racy_entries_never_pass_as_unchanged() {
        let mut s = Stamps::new(1_000_000_000_000);
        let old =
            Stamp { ino: 5, ctime_ns: 1_000_000, size: 3, mode: libc::S_IFREG | 0o644, opaque: false, racy: false };
        let late = Stamp { ctime_ns: 1_000_000_000_000 - 1, ..old };
        s.open_dir(Path::new(""));
        s.record(Path::new(""), "a".as_ref(), old);
        s.record(Path::new(""), std::ffi::OsStr::from_bytes(b"\xff"), late);
        s.open_dir(Path::new("empty"));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stamps");
        let origin = Origin { snapshot: "snap".into(), base: String::new(), upper: (1, 2) };
        s.save(&origin, &path).unwrap();
        let (o, back) = Stamps::load(&path).unwrap().unwrap();
        assert_eq!((o, &back), (origin, &s));
        let root = back.children(Path::new("")).unwrap();
        assert!(root[0].1.unchanged(&old));
        assert!(root[1].1.racy && !root[1].1.unchanged(&late), "a ctime 1 ns before the capture is racy");
        assert_eq!(back.children(Path::new("empty")), Some(&[][..]));
        assert_eq!(back.children(Path::new("missing")), None);
        assert!(Stamps::load(&dir.path().join("none")).unwrap().is_none());
        std::fs::write(&path, b"garbage").unwrap();
        assert!(Stamps::load(&path).is_err());
    }
}
