//! Pre-copy: a checkpoint copies the upper's files of [`MIN`] bytes and
//! more while the sandbox still runs, and the frozen capture then only checks that each is
//! unchanged (one `fstat`) instead of copying it. Live migration does the
//! same with memory pages (CRIU's pre-dump); here the unit is a file.
//!
//! A copy is reused only if the file provably did not change after it was
//! taken. Every change to a file's data sets its ctime to the current time:
//! `write` and friends, `truncate`, `fallocate`, and a write through a shared
//! mapping (the first write to a clean page faults into the file system's
//! `page_mkwrite`, which updates the times). So:
//!
//! 1. `t0` = the coarse clock, before anything else;
//! 2. per file: write its dirty pages out and wait (`sync_file_range`; the
//!    kernel write-protects every mapping of a page it cleans, so that any
//!    later write through a mapping faults), then `fstat`; a ctime at or
//!    after `t0` means it changed meanwhile: not copied; else it is copied;
//! 3. frozen: the file's (size, mtime, ctime) must still be what step 2
//!    saw. A change after `t0` would have given it a ctime >= t0.
//!
//! Only on ext4, XFS and btrfs, whose `page_mkwrite` updates the times
//! (tmpfs's mapped writes do not). What remains is the clock: a host whose
//! wall clock steps back could give a later change an old ctime, which
//! still has to equal the recorded one to the nanosecond, with mtime and
//! size equal too.
//!
//! Everything here is best effort: a file that cannot be pre-copied is
//! captured while frozen, as without pre-copy.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

/// File systems whose mapped writes update ctime (`page_mkwrite`).
const TRUSTED_FS: [i64; 3] = [
    0xEF53,      // ext2/3/4
    0x5846_5342, // XFS
    0x9123_683E, // btrfs
];

/// Smallest file pre-copied. Each costs an inode and a `sync_file_range`
/// before the freeze (and a reference in the tar, with a flush, while
/// frozen), which is more than copying a small file while frozen: with
/// 64 KiB, 1 GiB of 64 KiB files was pre-copied in 2.05 s and frozen
/// 0.78 s, and its blob took 3.8 s (against 2.4 s and 2.4 s without).
pub const MIN: u64 = 1 << 20;

/// Deepest directory the walk enters (the frozen capture takes the rest).
const MAX_DEPTH: usize = 128;

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
pub struct Copy {
    pub path: Arc<Path>,
}

/// The copies one pre-copy made, by (dev, ino) of the original.
#[derive(Debug, Default)]
pub struct Precopied {
    files: HashMap<(u64, u64), (Stamp, Copy)>,
    /// Bytes copied.
    pub bytes: u64,
    pub took: Duration,
}

impl Precopied {
    /// Copy every regular file of at least [`MIN`] bytes under `upper` into
    /// `dir` (created here), while the sandbox runs. On an error (a full
    /// disk, say) `dir` is removed again, leaving the space to the capture.
    pub fn copy(upper: &Path, dir: &Path) -> std::io::Result<Precopied> {
        let started = Instant::now();
        let t0 = nix::time::clock_gettime(nix::time::ClockId::CLOCK_REALTIME_COARSE)?;
        let t0 = (t0.tv_sec(), t0.tv_nsec());
        let root = File::open(upper)?;
        let fs = nix::sys::statfs::fstatfs(&root)?;
        let mut done = Precopied::default();
        if !TRUSTED_FS.contains(&(fs.filesystem_type().0 as i64)) {
            return Ok(done);
        }
        std::fs::create_dir(dir)?;
        let mut walk = Walk { dir, t0, done: &mut done };
        if let Err(e) = walk.dir(root.as_fd(), 0) {
            let _ = std::fs::remove_dir_all(dir);
            return Err(e);
        }
        done.took = started.elapsed();
        Ok(done)
    }

    /// The copy of `src` (opened for `len` bytes, frozen), if it is still
    /// exactly that file's content.
    pub fn reusable(&self, src: &File, len: u64) -> Option<&Copy> {
        let now = Stamp::of(&src.metadata().ok()?);
        match self.files.get(&(now.dev, now.ino)) {
            Some((then, copy)) if *then == now && now.size == len => Some(copy),
            _ => None,
        }
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }
}

struct Walk<'a> {
    dir: &'a Path,
    /// `CLOCK_REALTIME_COARSE` at the start: the clock file times come from.
    t0: (i64, i64),
    done: &'a mut Precopied,
}

impl Walk<'_> {
    /// Walks a live tree by file descriptors, never following a symlink:
    /// a sandbox swapping a directory for a link only makes an open fail.
    fn dir(&mut self, fd: BorrowedFd<'_>, depth: usize) -> std::io::Result<()> {
        use nix::dir::{Dir, Type};
        let mut names = Vec::new();
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
        for entry in Dir::openat(Some(fd.as_raw_fd()), ".", flags, Mode::empty())?.iter().flatten() {
            let name = entry.file_name().to_owned();
            if name.to_bytes() != b"." && name.to_bytes() != b".." {
                names.push((name, entry.file_type()));
            }
        }
        for (name, kind) in names {
            match kind {
                Some(Type::Directory) if depth < MAX_DEPTH => {
                    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
                    if let Ok(sub) = strata_shim::sys::openat(fd, &name, flags, 0) {
                        self.dir(sub.as_fd(), depth + 1)?;
                    }
                }
                Some(Type::File) | None => self.file(fd, &name)?,
                _ => {}
            }
        }
        Ok(())
    }

    /// Copies one file if it is large, unchanged since `t0`, and regular.
    /// Errors reading it skip it; errors writing the copy end the walk.
    fn file(&mut self, parent: BorrowedFd<'_>, name: &std::ffi::CStr) -> std::io::Result<()> {
        use nix::sys::stat::{fstatat, SFlag};
        // Most files are small: looked at, not opened.
        match fstatat(Some(parent.as_raw_fd()), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st)
                if SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFREG
                    && st.st_size as u64 >= MIN => {}
            _ => return Ok(()),
        }
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY;
        let Ok(src) = strata_shim::sys::openat(parent, name, flags, 0).map(File::from) else { return Ok(()) };
        match src.metadata() {
            Ok(m) if m.is_file() && m.size() >= MIN => {}
            _ => return Ok(()),
        }
        if strata_shim::sys::write_out(src.as_fd()).is_err() {
            return Ok(());
        }
        let Ok(meta) = src.metadata() else { return Ok(()) };
        let stamp = Stamp::of(&meta);
        if stamp.ctime >= self.t0 || self.done.files.contains_key(&(stamp.dev, stamp.ino)) {
            return Ok(());
        }
        let path = self.dir.join(self.done.files.len().to_string());
        let copy = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
        let mut sparse = super::checkpoint::SparseFile::new(copy, None);
        match sparse.splice_from(&src, stamp.size) {
            Ok(()) => {}
            // The original shrank: it changed; the capture takes it.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                drop(sparse);
                return std::fs::remove_file(&path);
            }
            Err(e) => return Err(e),
        }
        sparse.finish()?;
        self.done.bytes += stamp.size;
        self.done.files.insert((stamp.dev, stamp.ino), (stamp, Copy { path: path.into() }));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, Write};

    fn big(path: &Path, byte: u8) {
        std::fs::write(path, vec![byte; 3 << 20]).unwrap();
    }

    /// A process with a shared writable mapping of `path`: it writes 1 at
    /// offset 0 at once, and 2 at offset 4096 when told, then unmaps.
    /// (A separate process, as in a sandbox; and this crate has no unsafe.)
    const MAPPER: &str = "import mmap, sys\n\
        f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0)\n\
        m[0] = 1; print('ready', flush=True); sys.stdin.readline()\n\
        m[4096] = 2; m.close(); print('done', flush=True)\n";

    /// Files written before the pre-copy are copied and reused while
    /// unchanged; a write, a truncate, a rename over it, or a write
    /// through a mapping made before the pre-copy all void the copy.
    #[test]
    fn a_copy_is_reused_only_while_the_file_is_unchanged() {
        let upper = tempfile::tempdir_in("/var/tmp").unwrap();
        let work = tempfile::tempdir_in("/var/tmp").unwrap();
        let u = upper.path();
        std::fs::create_dir(u.join("d")).unwrap();
        for name in ["same", "written", "truncated", "mapped", "d/renamed", "d/other"] {
            big(&u.join(name), 7);
        }
        std::fs::write(u.join("small"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", u.join("link")).unwrap();
        // A shared mapping, dirtied before the pre-copy: its page table
        // entry stays writable unless the pre-copy cleans the page.
        let mut mapper = std::process::Command::new("python3")
            .args(["-c", MAPPER])
            .arg(u.join("mapped"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let mut said = std::io::BufReader::new(mapper.stdout.take().unwrap()).lines();
        assert_eq!(said.next().unwrap().unwrap(), "ready");
        // Let the coarse clock move past the files' ctimes.
        std::thread::sleep(Duration::from_millis(30));

        let pre = Precopied::copy(u, &work.path().join("pre")).unwrap();
        assert_eq!(pre.len(), 6, "the six large files are copied");
        assert_eq!(pre.bytes, 6 * (3 << 20));
        let copied = |name: &str| {
            let copy = pre.reusable(&File::open(u.join(name)).unwrap(), 3 << 20).unwrap();
            std::fs::read(&copy.path).unwrap()
        };
        assert_eq!(copied("mapped")[0], 1, "the copy has what was written through the mapping");

        writeln!(mapper.stdin.as_mut().unwrap()).unwrap();
        assert_eq!(said.next().unwrap().unwrap(), "done");
        assert!(mapper.wait().unwrap().success());
        assert_eq!(std::fs::read(u.join("mapped")).unwrap()[4096], 2);
        // Same size after each: only the times tell.
        use std::os::unix::fs::FileExt;
        std::fs::OpenOptions::new().write(true).open(u.join("written")).unwrap().write_all_at(b"more", 5).unwrap();
        let t = std::fs::OpenOptions::new().write(true).open(u.join("truncated")).unwrap();
        t.set_len(1 << 20).unwrap();
        t.set_len(3 << 20).unwrap();
        big(&u.join("d/new"), 7);
        std::fs::rename(u.join("d/new"), u.join("d/renamed")).unwrap();

        let check = |name: &str, reused: bool| {
            let f = File::open(u.join(name)).unwrap();
            let len = f.metadata().unwrap().len();
            assert_eq!(pre.reusable(&f, len).is_some(), reused, "{name}");
        };
        check("same", true);
        check("d/other", true);
        check("written", false);
        check("truncated", false);
        check("mapped", false);
        check("d/renamed", false);
        assert_eq!(copied("same"), vec![7; 3 << 20]);
    }

    /// Not on tmpfs: its mapped writes leave the times alone.
    #[test]
    fn nothing_is_copied_from_tmpfs() {
        let upper = tempfile::tempdir_in("/dev/shm").unwrap();
        big(&upper.path().join("f"), 1);
        std::thread::sleep(Duration::from_millis(30));
        let work = tempfile::tempdir_in("/var/tmp").unwrap();
        let pre = Precopied::copy(upper.path(), &work.path().join("pre")).unwrap();
        assert!(pre.is_empty());
    }
}
