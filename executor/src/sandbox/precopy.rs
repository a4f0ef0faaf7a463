//! Pre-copy: a checkpoint copies the upper's files of [`MIN`] bytes and
//! more while the sandbox still runs (as the walk that writes the capture
//! ahead reaches each: `checkpoint::speculate`), and the frozen capture
//! then only checks that each is unchanged (its `fstat`) instead of
//! copying it. Live migration does the same with memory pages (CRIU's
//! pre-dump); here the unit is a file.
//!
//! A copy is reused only if the file provably did not change after it was
//! taken. Every change to a file's data needs it open for writing (a
//! shared writable mapping holds such an open too) and sets its ctime to
//! the current time, though when the change begins, not when it ends (a
//! long `write` has set ctime before its data is in). So:
//!
//! 1. `t0` = the coarse clock, before anything else;
//! 2. per file: a read lease, taken and dropped at once, proves that nobody
//!    has it open for writing now (so no change is in flight, and any
//!    later one opens it after `t0`); then `fstat`: a ctime in the second
//!    of `t0` or later means it changed lately: not copied; else it is;
//! 3. frozen: the file's (size, mtime, ctime) must still be what step 2
//!    saw. A change after step 2 began after `t0`, so it set a ctime in
//!    `t0`'s second or later. (Whole seconds: some file systems keep no
//!    more, e.g. ext4 with 128-byte inodes, once the inode is re-read.)
//!
//! Only on ext4, XFS and btrfs, whose writes through a mapping update the
//! times (`page_mkwrite`; tmpfs's do not). What remains is the clock: a
//! host whose wall clock steps back by more than the time since `t0` could
//! give a later change an old ctime, which would still have to equal the
//! recorded one, with mtime and size equal too.
//!
//! The lease costs a sandbox something only if it opens a pre-copied
//! candidate for writing in the same instant: its open waits until the
//! lease is dropped (microseconds), or fails with `EWOULDBLOCK` if it was
//! `O_NONBLOCK`. The signal the kernel then sends the daemon is SIGURG,
//! ignored (`sys::no_writers`).
//!
//! Everything here is best effort: a file that cannot be pre-copied is
//! captured while frozen, as without pre-copy.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// File systems whose mapped writes update ctime (`page_mkwrite`).
const TRUSTED_FS: [i64; 3] = [
    0xEF53,      // ext2/3/4
    0x5846_5342, // XFS
    0x9123_683E, // btrfs
];

/// Smallest file pre-copied. Each costs an inode and a lease before the
/// freeze, and a reference in the tar (a flush) while frozen, which is
/// about what copying a file of a few pages costs while frozen.
pub const MIN: u64 = 16 << 10;

/// A file's identity and the times that change with its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// A file's content, copied before the freeze, under the pre-copy
/// directory; the hydration links it into the layer. (Paths, not open
/// files: a delta of many large files would hold as many descriptors.)
#[derive(Debug, Clone)]
pub struct PreCopy {
    pub path: Arc<Path>,
}

/// The copies one pre-copy made, by (dev, ino) of the original.
#[derive(Debug, Default)]
pub struct Precopied {
    files: HashMap<(u64, u64), (Stamp, PreCopy)>,
    /// Bytes copied (apparent sizes: a sparse file's holes count).
    pub bytes: u64,
    pub took: Duration,
}

impl Precopied {
    /// The copy of a file (its `fstat` now, frozen), if it is still exactly
    /// that file's content.
    pub fn reusable(&self, meta: &std::fs::Metadata) -> Option<&PreCopy> {
        let now = Stamp::of(meta);
        match self.files.get(&(now.dev, now.ino)) {
            Some((then, copy)) if *then == now => Some(copy),
            _ => None,
        }
    }

    /// Delete the copies not in `used` (their files changed and were
    /// captured afresh), so that they do not hold disk space meanwhile.
    pub fn remove_unused<'a>(&self, used: impl Iterator<Item = &'a Path>) {
        let used: std::collections::HashSet<&Path> = used.collect();
        for (_, copy) in self.files.values() {
            if !used.contains(&*copy.path) {
                let _ = std::fs::remove_file(&copy.path);
            }
        }
    }
}

/// Takes the copies, one file at a time, as the walk that writes the
/// capture ahead of the freeze (`checkpoint::speculate`) reaches each.
pub struct Precopier {
    dir: PathBuf,
    /// `CLOCK_REALTIME_COARSE` at the start: the clock file times come from.
    t0: (i64, i64),
    done: Precopied,
    /// A copy could not be written (a full disk, say): all are dropped.
    failed: bool,
    /// Copies stop once the sandbox is going away.
    pub(super) gone: super::Gone,
}

impl Precopier {
    /// A pre-copier for `upper` writing into `dir` (created here); `None`
    /// on a file system whose copies could not be proven current.
    pub fn new(upper: &Path, dir: &Path) -> std::io::Result<Option<Precopier>> {
        let t0 = nix::time::clock_gettime(nix::time::ClockId::CLOCK_REALTIME_COARSE)?;
        let fs = nix::sys::statfs::statfs(upper)?;
        if !TRUSTED_FS.contains(&(fs.filesystem_type().0 as i64)) {
            return Ok(None);
        }
        std::fs::create_dir(dir)?;
        let done = Precopied::default();
        Ok(Some(Precopier {
            dir: dir.into(),
            t0: (t0.tv_sec(), t0.tv_nsec()),
            done,
            failed: false,
            gone: super::Gone::default(),
        }))
    }

    /// Copy `src` (a file of the live upper, open for reading; `meta` its
    /// `fstat`) if it has [`MIN`] bytes or more, nobody has it open for
    /// writing, and it has not changed since before `t0`'s second. `None`
    /// if not copied; an error if the copy failed (`src` shrank, or the
    /// copy could not be written).
    /// `copy` writes `src`'s first `len` bytes into the new file, holes
    /// left as holes (the capture's own writer: `checkpoint.rs`), ending
    /// early with an error once `gone` is set.
    pub fn take(
        &mut self,
        src: &File,
        meta: &std::fs::Metadata,
        copy: impl FnOnce(File, &File, u64, super::Gone) -> std::io::Result<()>,
    ) -> std::io::Result<Option<PreCopy>> {
        if meta.len() < MIN || self.failed || strata_shim::sys::no_writers(src.as_fd()).is_err() {
            return Ok(None);
        }
        let stamp = Stamp::of(&src.metadata()?);
        if stamp != Stamp::of(meta)
            || stamp.ctime.0 >= self.t0.0
            || self.done.files.contains_key(&(stamp.dev, stamp.ino))
        {
            return Ok(None);
        }
        let path = self.dir.join(self.done.files.len().to_string());
        let copied = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .and_then(|file| copy(file, src, stamp.size, self.gone.clone()));
        if let Err(e) = copied {
            // The original shrank: it changed (the walk fails on it too).
            self.failed |= e.kind() != std::io::ErrorKind::UnexpectedEof;
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        self.done.bytes += stamp.size;
        let copy = PreCopy { path: path.into() };
        self.done.files.insert((stamp.dev, stamp.ino), (stamp, copy.clone()));
        Ok(Some(copy))
    }

    /// The copies taken; none if one failed to be written (they are
    /// removed, leaving the space to the capture).
    pub fn finish(self, took: Duration) -> Precopied {
        if self.failed {
            let _ = std::fs::remove_dir_all(&self.dir);
            return Precopied { took, ..Precopied::default() };
        }
        Precopied { took, ..self.done }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, Write};

    /// Pre-copy `upper` as a checkpoint does: while writing its capture
    /// ahead (`checkpoint::speculate`).
    fn precopy(upper: &Path, work: &Path) -> Precopied {
        let Some(copier) = Precopier::new(upper, &work.join("pre")).unwrap() else { return Precopied::default() };
        let progress = Arc::new(super::super::TarProgress::default());
        let spec = super::super::speculate(
            upper,
            &work.join("ahead.tar"),
            copier,
            progress,
            &super::super::Gone::default(),
            None,
        );
        Arc::try_unwrap(spec.pre).unwrap()
    }

    fn big(path: &Path, byte: u8) {
        std::fs::write(path, vec![byte; 3 << 20]).unwrap();
    }

    /// A process with a shared writable mapping of `path`: it writes 1 at
    /// offset 0 at once; when told, 2 at offset 4096, and it closes.
    /// (A separate process, as in a sandbox; and this crate has no unsafe.)
    const MAPPER: &str = "import mmap, sys\n\
        f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0)\n\
        m[0] = 1; print('ready', flush=True); sys.stdin.readline()\n\
        m[4096] = 2; m.close(); f.close(); print('done', flush=True)\n";

    /// Writes 3 at offset 4096 of `path` through a new shared mapping.
    const MAP_ONCE: &str = "import mmap, sys\n\
        f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); m[4096] = 3; m.close()\n";

    /// Files written before the pre-copy are copied and reused while
    /// unchanged; a file open for writing (here: mapped) is not copied; a
    /// write, a truncate, a rename over it, or a write through a mapping
    /// made after the pre-copy void the copy.
    #[test]
    fn a_copy_is_reused_only_while_the_file_is_unchanged() {
        let upper = tempfile::tempdir_in("/var/tmp").unwrap();
        let work = tempfile::tempdir_in("/var/tmp").unwrap();
        let u = upper.path();
        std::fs::create_dir(u.join("d")).unwrap();
        for name in ["same", "written", "truncated", "held", "mapped", "d/renamed", "d/other"] {
            big(&u.join(name), 7);
        }
        std::fs::write(u.join("small"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", u.join("link")).unwrap();
        let mut mapper = std::process::Command::new("python3")
            .args(["-c", MAPPER])
            .arg(u.join("held"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let mut said = std::io::BufReader::new(mapper.stdout.take().unwrap()).lines();
        assert_eq!(said.next().unwrap().unwrap(), "ready");
        // Let the clock move to a later second than the files' ctimes.
        std::thread::sleep(Duration::from_millis(1100));

        let pre = precopy(u, work.path());
        assert_eq!(pre.files.len(), 6, "the large files not open for writing are copied");
        assert_eq!(pre.bytes, 6 * (3 << 20));
        let copied = |name: &str| {
            let copy = pre.reusable(&std::fs::metadata(u.join(name)).unwrap()).unwrap();
            std::fs::read(&copy.path).unwrap()
        };

        writeln!(mapper.stdin.as_mut().unwrap()).unwrap();
        assert_eq!(said.next().unwrap().unwrap(), "done");
        assert!(mapper.wait().unwrap().success());
        assert_eq!(std::fs::read(u.join("held")).unwrap()[4096], 2);
        let once = std::process::Command::new("python3").args(["-c", MAP_ONCE]).arg(u.join("mapped")).status();
        assert!(once.unwrap().success());
        assert_eq!(std::fs::read(u.join("mapped")).unwrap()[4096], 3);
        // Same size after each: only the times tell.
        use std::os::unix::fs::FileExt;
        std::fs::OpenOptions::new().write(true).open(u.join("written")).unwrap().write_all_at(b"more", 5).unwrap();
        let t = std::fs::OpenOptions::new().write(true).open(u.join("truncated")).unwrap();
        t.set_len(1 << 20).unwrap();
        t.set_len(3 << 20).unwrap();
        big(&u.join("d/new"), 7);
        std::fs::rename(u.join("d/new"), u.join("d/renamed")).unwrap();

        let check = |name: &str, reused: bool| {
            assert_eq!(pre.reusable(&std::fs::metadata(u.join(name)).unwrap()).is_some(), reused, "{name}");
        };
        check("same", true);
        check("d/other", true);
        check("held", false);
        check("written", false);
        check("truncated", false);
        check("mapped", false);
        check("d/renamed", false);
        assert_eq!(copied("same"), vec![7; 3 << 20]);
    }

    /// A file changed in the second the pre-copy starts is left to the
    /// capture: some file systems keep whole seconds only.
    #[test]
    fn a_file_changed_this_second_is_not_copied() {
        let upper = tempfile::tempdir_in("/var/tmp").unwrap();
        let work = tempfile::tempdir_in("/var/tmp").unwrap();
        // Early in a second (past the coarse clock's tick), so that the
        // copy starts in it too.
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
        std::thread::sleep(Duration::from_nanos(1_050_000_000 - u64::from(now.subsec_nanos())));
        big(&upper.path().join("f"), 1);
        let pre = precopy(upper.path(), work.path());
        assert!(pre.files.is_empty());
    }

    /// Not on tmpfs: its mapped writes leave the times alone.
    #[test]
    fn nothing_is_copied_from_tmpfs() {
        let upper = tempfile::tempdir_in("/dev/shm").unwrap();
        big(&upper.path().join("f"), 1);
        std::thread::sleep(Duration::from_millis(1100));
        let work = tempfile::tempdir_in("/var/tmp").unwrap();
        let pre = precopy(upper.path(), work.path());
        assert!(pre.files.is_empty());
    }
}
