//! Checkpoint capture: quiesce the sandbox, write its upper dir as an
//! uncompressed OCI layer tar, resume it. Only this part runs frozen, and
//! it only copies: another thread follows the tar as it grows
//! ([`TarFollower`]) and compresses it into the blob. The follower never
//! slows the writer down (it reads what is already written, from the page
//! cache), so compression never lengthens the pause, yet the blob is
//! finished about when the tar is. Hydrating the tar into a lower (which
//! also hashes it: the diff_id) happens after the thaw (see
//! `snapshots.rs`).
//!
//! Large files are copied before the freeze (`precopy.rs`); for each one
//! still unchanged, the frozen capture leaves a hole in the tar and records
//! a [`Segment`] naming the copy. Readers of the tar ([`TarFollower`]) read
//! a segment's bytes from its copy, so what they see is the whole tar; the
//! hydration links the copy into the layer instead of writing it again.
//! What is left frozen is the walk, the headers, the small files, and the
//! large files that changed since their copy (copied as `cp` would).

use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::precopy::{self, Precopied};
use super::{RunEvent, Sandbox, SandboxError};
use crate::diff::{self, DeltaStats};

/// How long the kernel may take to freeze every task.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(10);

/// A file writer that leaves holes for aligned blocks of zeros, so the
/// frozen capture of a sparse file (or any long run of zeros) costs no disk
/// writes. The content read back is identical.
pub(super) struct SparseFile {
    file: std::fs::File,
    len: u64,
    progress: Option<Arc<TarProgress>>,
    /// Whether `copy_file_range` from the upper works (not across file
    /// systems, e.g. from a sandbox's `--disk`).
    splice: bool,
    /// Files copied before the freeze; where one is still current, the
    /// tar gets a hole and a [`Segment`] instead of its content.
    pre: Option<Arc<Precopied>>,
    segments: Vec<Segment>,
}

/// A range of a capture's tar whose bytes are in a pre-copied file (the
/// tar has a hole there): a large file's content.
#[derive(Debug, Clone)]
pub struct Segment {
    pub offset: u64,
    pub len: u64,
    pub copy: precopy::Copy,
}

impl SparseFile {
    const BLOCK: usize = 64 * 1024;

    pub(super) fn new(file: std::fs::File, progress: Option<Arc<TarProgress>>) -> SparseFile {
        SparseFile { file, len: 0, progress, splice: true, pre: None, segments: Vec::new() }
    }

    /// Leave a hole for `len` bytes that `copy` holds.
    fn refer(&mut self, copy: precopy::Copy, len: u64) -> std::io::Result<()> {
        use std::io::{Seek, SeekFrom};
        let seg = Segment { offset: self.len, len, copy };
        self.len += len;
        self.file.seek(SeekFrom::Start(self.len))?;
        if let Some(p) = &self.progress {
            p.publish_segment(seg.clone(), self.len);
        }
        self.segments.push(seg);
        Ok(())
    }

    /// Give the file its full length (a trailing hole is not written).
    pub(super) fn finish(self) -> std::io::Result<()> {
        self.file.set_len(self.len)
    }

    fn advance(&mut self, n: usize) {
        self.len += n as u64;
        if let Some(p) = &self.progress {
            p.publish(self.len);
        }
    }

    /// Append the first `len` bytes of `src` at the end, copied inside the
    /// kernel (`copy_file_range`, as `cp` does: no trip through this
    /// process), holes in `src` left as holes. Where the kernel cannot,
    /// the bytes are read and written.
    pub(super) fn splice_from(&mut self, src: &std::fs::File, len: u64) -> std::io::Result<()> {
        use nix::errno::Errno;
        use nix::unistd::{lseek, Whence};
        use std::io::{Seek, SeekFrom, Write};
        use std::os::fd::AsRawFd;
        /// Bytes per call, so that a follower sees progress.
        const STEP: u64 = 8 << 20;
        let start = self.len;
        let mut pos = 0u64;
        while pos < len && self.splice {
            // The next data extent [data, hole); without SEEK_DATA, all data.
            let data = match lseek(src.as_raw_fd(), pos as i64, Whence::SeekData) {
                Ok(d) => (d as u64).min(len),
                Err(Errno::ENXIO) => len,
                Err(_) => pos,
            };
            let hole = lseek(src.as_raw_fd(), data as i64, Whence::SeekHole).map_or(len, |h| (h as u64).min(len));
            let (mut off_in, mut off_out) = (data as i64, (start + data) as i64);
            while (off_in as u64) < hole {
                let want = (hole - off_in as u64).min(STEP) as usize;
                match nix::fcntl::copy_file_range(src, Some(&mut off_in), &self.file, Some(&mut off_out), want) {
                    Ok(0) => return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the file shrank")),
                    Ok(_) => {
                        if let Some(p) = &self.progress {
                            p.publish(start + off_in as u64);
                        }
                    }
                    Err(Errno::EXDEV | Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP) => {
                        self.splice = false;
                        break;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            pos = off_in as u64;
        }
        // Holes (and a hole at the end) are skipped; the rest, if the
        // kernel could not splice it, goes through `write`.
        self.len = start + pos;
        self.file.seek(SeekFrom::Start(self.len))?;
        if pos < len {
            (&*src).seek(SeekFrom::Start(pos))?;
            // In blocks large enough for `write` to find runs of zeros.
            let mut buffered = BufWriter::with_capacity(1 << 20, &mut *self);
            diff::copy_exactly(src, len - pos, &mut buffered)?;
            buffered.flush()?;
        }
        if let Some(p) = &self.progress {
            p.publish(self.len);
        }
        Ok(())
    }
}

/// Smaller files are copied through the tar's buffer: splicing one costs
/// a flush and four more system calls, more than copying it (a 10 MiB
/// delta of 64 KiB files was frozen 16-28 ms spliced, 11-12 ms copied).
const SPLICE_MIN: u64 = 1 << 20;

/// [`diff::SpliceFile`] for the capture's tar: a file pre-copied and not
/// changed since becomes a reference to the copy; else a large file's
/// content is spliced in after what is buffered; else `false` (copied).
fn splice_into_tar(
    w: &mut &mut BufWriter<SparseFile>,
    src: &std::fs::File,
    meta: &std::fs::Metadata,
) -> std::io::Result<bool> {
    use std::io::Write;
    let len = meta.len();
    let copy = match &w.get_ref().pre {
        Some(pre) if len >= precopy::MIN => pre.reusable(meta).cloned(),
        _ => None,
    };
    if copy.is_none() && len < SPLICE_MIN {
        return Ok(false);
    }
    w.flush()?;
    let sf = w.get_mut();
    match copy {
        Some(copy) => sf.refer(copy, len),
        None => sf.splice_from(src, len),
    }
    .map(|()| true)
}

/// How far a capture has written its tar, shared with a [`TarFollower`].
#[derive(Default)]
pub struct TarProgress {
    state: Mutex<ProgressState>,
    cv: Condvar,
}

#[derive(Default)]
struct ProgressState {
    /// Bytes final so far.
    len: u64,
    /// `Some(ok)` once the capture ended.
    end: Option<bool>,
    segments: Vec<Segment>,
}

impl TarProgress {
    fn lock(&self) -> std::sync::MutexGuard<'_, ProgressState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn publish(&self, len: u64) {
        self.lock().len = len;
        self.cv.notify_all();
    }

    fn publish_segment(&self, seg: Segment, len: u64) {
        let mut st = self.lock();
        st.segments.push(seg);
        st.len = len;
        drop(st);
        self.cv.notify_all();
    }

    /// The capture is over: `ok` if the tar is complete. Later calls are
    /// ignored, so a caller can always end it on its way out.
    pub fn end(&self, ok: bool) {
        self.lock().end.get_or_insert(ok);
        self.cv.notify_all();
    }
}

/// Reads a capture's tar while it is being written: blocks until more is
/// final, ends when the capture has ended, fails if it failed. Bytes past
/// the file's current end are a hole the writer skipped: zeros. Where a
/// [`Segment`] says so, the bytes are read from its pre-copied file.
pub struct TarFollower {
    path: PathBuf,
    file: Option<std::fs::File>,
    pos: u64,
    segments: Vec<Segment>,
    /// The segment file last read, by index.
    open: Option<(usize, std::fs::File)>,
    /// The capture being written; `None` for a finished one of `len` bytes.
    progress: Option<Arc<TarProgress>>,
    len: u64,
}

impl TarFollower {
    pub fn new(path: &Path, progress: Arc<TarProgress>) -> TarFollower {
        TarFollower {
            path: path.to_path_buf(),
            file: None,
            pos: 0,
            segments: Vec::new(),
            open: None,
            progress: Some(progress),
            len: 0,
        }
    }

    /// Reads a finished capture.
    pub fn finished(cap: &Capture) -> std::io::Result<TarFollower> {
        let file = std::fs::File::open(&cap.tar)?;
        let len = file.metadata()?.len();
        Ok(TarFollower {
            path: cap.tar.clone(),
            file: Some(file),
            pos: 0,
            segments: cap.segments.clone(),
            open: None,
            progress: None,
            len,
        })
    }

    /// How far the tar is final (waiting for more); copies new segments.
    fn final_len(&mut self) -> std::io::Result<u64> {
        let Some(progress) = &self.progress else { return Ok(self.len) };
        let mut st = progress.lock();
        while st.len <= self.pos && st.end.is_none() {
            st = progress.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if st.end == Some(false) {
            return Err(std::io::Error::other("the capture failed"));
        }
        self.segments.extend_from_slice(&st.segments[self.segments.len()..]);
        Ok(st.len)
    }
}

impl std::io::Read for TarFollower {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let len = self.final_len()?;
        if len <= self.pos || buf.is_empty() {
            return Ok(0);
        }
        let mut want = buf.len().min((len - self.pos) as usize);
        let i = self.segments.partition_point(|s| s.offset + s.len <= self.pos);
        let in_segment = self.segments.get(i).is_some_and(|s| s.offset <= self.pos);
        let (file, at) = match self.segments.get(i) {
            Some(s) if s.offset <= self.pos => {
                want = want.min((s.offset + s.len - self.pos) as usize);
                let at = self.pos - s.offset;
                let file = match &mut self.open {
                    Some((j, f)) if *j == i => f,
                    open => &open.insert((i, std::fs::File::open(&*s.copy.path)?)).1,
                };
                (file, at)
            }
            next => {
                if let Some(s) = next {
                    want = want.min((s.offset - self.pos) as usize);
                }
                let file = match &mut self.file {
                    Some(f) => f,
                    None => self.file.insert(std::fs::File::open(&self.path)?),
                };
                (&*file, self.pos)
            }
        };
        let n = match file.read_at(&mut buf[..want], at)? {
            // A pre-copy was set to its full length: short means broken.
            0 if in_segment => {
                return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "a pre-copy is short"))
            }
            0 => {
                buf[..want].fill(0);
                want
            }
            n => n,
        };
        self.pos += n as u64;
        Ok(n)
    }
}

impl std::io::Write for SparseFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        use std::io::{Seek, SeekFrom};
        // Up to the next block boundary at most; all zeros become a hole
        // (the file system allocates whole blocks of it only if data lands
        // next to it).
        let n = buf.len().min(Self::BLOCK - (self.len % Self::BLOCK as u64) as usize);
        if buf[..n].iter().all(|&b| b == 0) {
            self.file.seek(SeekFrom::Current(n as i64))?;
            self.advance(n);
            return Ok(n);
        }
        let n = self.file.write(&buf[..n])?;
        self.advance(n);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// A captured delta, still under `tmp/`.
#[derive(Debug, Clone)]
pub struct Capture {
    pub tar: PathBuf,
    /// sha256 hex of the tar; `None` if it was not hashed while frozen
    /// (the hydration hashes it).
    pub diff_id: Option<String>,
    pub stats: DeltaStats,
    /// How long the sandbox was frozen (zero if it was paused already).
    pub frozen: Duration,
    /// Ranges of the tar held by pre-copied files (read it with
    /// [`TarFollower::finished`]).
    pub segments: Vec<Segment>,
}

impl Capture {
    /// The pre-copied file holding exactly the `len` bytes at `offset`.
    pub fn prepared(&self, offset: u64, len: u64) -> Option<PathBuf> {
        let i = self.segments.partition_point(|s| s.offset < offset);
        self.segments.get(i).filter(|s| s.offset == offset && s.len == len).map(|s| s.copy.path.to_path_buf())
    }
}

impl Sandbox {
    /// Run `f` with every process of the sandbox frozen (unless it is paused
    /// already) and new execs refused: for reads of the upper that must not
    /// race with the sandbox (a live upper can swap a directory for a
    /// symlink under a walker's feet).
    pub fn while_frozen<T>(
        &self,
        action: &'static str,
        f: impl FnOnce() -> Result<T, SandboxError>,
    ) -> Result<T, SandboxError> {
        let state = self.transition(RunEvent::Capture, action, || Ok(()))?;
        let froze = matches!(state, super::RunState::Capturing { was_paused: false });
        if froze {
            if let Err(e) = self.cgroup.freeze(FREEZE_TIMEOUT) {
                let _ = self.transition(RunEvent::Captured, "finish", || Ok(()));
                return Err(SandboxError::Freezer(e));
            }
        }
        let r = f();
        if froze {
            let _ = self.cgroup.thaw();
        }
        let _ = self.transition(RunEvent::Captured, "finish", || Ok(()));
        r
    }

    /// Freeze (unless paused), write `upper` as a layer tar to `tar`, thaw.
    /// New execs are refused meanwhile. With `progress`, each write is
    /// published to it (the caller ends it), and files in `pre` that did
    /// not change since they were copied are referred to, not copied.
    pub fn capture(
        &self,
        upper: &Path,
        tar: &Path,
        progress: Option<Arc<TarProgress>>,
        pre: Option<Arc<Precopied>>,
    ) -> Result<Capture, SandboxError> {
        let started = Instant::now();
        let state = self.transition(RunEvent::Capture, "checkpoint", || Ok(()))?;
        let froze = matches!(state, super::RunState::Capturing { was_paused: false });
        let mut result = if froze { self.cgroup.freeze(FREEZE_TIMEOUT).map_err(SandboxError::Freezer) } else { Ok(()) };
        let written = result.as_ref().ok().map(|_| {
            std::fs::File::create(tar)
                .map_err(|source| SandboxError::Io { step: "create checkpoint tar", source })
                .and_then(|f| {
                    // With a follower, the capture only copies (the
                    // hydration hashes the tar after the thaw).
                    let followed = progress.is_some();
                    let mut sparse = SparseFile::new(f, progress);
                    sparse.pre = pre.filter(|_| followed);
                    let mut w = BufWriter::with_capacity(1 << 20, sparse);
                    let r = if followed {
                        diff::write_delta_unhashed(upper, &mut w, Some(splice_into_tar)).map(|s| (s, None))
                    } else {
                        diff::write_delta(upper, &mut w).map(|(s, h)| (s, Some(h)))
                    }
                    .map_err(SandboxError::Capture)?;
                    // No fsync: the tar is scratch under tmp/ (blob and layer are
                    // synced when written) and the sandbox is frozen meanwhile.
                    let mut sparse = w
                        .into_inner()
                        .map_err(|e| SandboxError::Io { step: "flush checkpoint tar", source: e.into_error() })?;
                    let segments = std::mem::take(&mut sparse.segments);
                    sparse.finish().map_err(|source| SandboxError::Io { step: "finish checkpoint tar", source })?;
                    Ok((r, segments))
                })
        });
        // Always resume, whatever happened above.
        if froze {
            if let Err(e) = self.cgroup.thaw() {
                result = Err(SandboxError::Freezer(e));
            }
        }
        let frozen = if froze { started.elapsed() } else { Duration::ZERO };
        let _ = self.transition(RunEvent::Captured, "finish checkpoint", || Ok(()));
        result?;
        let ((stats, diff_id), segments) = written.unwrap_or(Err(SandboxError::Dead(self.id.clone())))?;
        Ok(Capture { tar: tar.to_path_buf(), diff_id, stats, frozen, segments })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};
    use std::os::unix::fs::MetadataExt;

    /// A tree with an empty file, a small one, and a sparse one (data, a
    /// hole, data, a trailing hole).
    fn tree(root: &Path) {
        std::fs::write(root.join("empty"), b"").unwrap();
        std::fs::write(root.join("small"), b"hello\n").unwrap();
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
            diff::write_delta_unhashed(upper.path(), &mut plain, None).unwrap();

            let path = out.path().join(format!("t{i}"));
            let mut w = BufWriter::new(SparseFile::new(std::fs::File::create(&path).unwrap(), None));
            let stats = diff::write_delta_unhashed(upper.path(), &mut w, Some(splice_into_tar)).unwrap();
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

    /// With a pre-copy, the capture writes only headers, small files and
    /// holes; read back with its segments it is the plain tar byte for
    /// byte (while followed, and once finished), a file changed after the
    /// pre-copy is captured afresh, and the unpacker links the copies.
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
        let pre = Arc::new(Precopied::copy(u, &out.path().join("pre")).unwrap());
        assert_eq!(pre.len(), 3, "sparse, big (once for both names), changed");
        std::fs::OpenOptions::new().write(true).open(u.join("d/changed")).unwrap().write_all_at(b"new", 9).unwrap();
        let mut plain = Vec::new();
        diff::write_delta_unhashed(u, &mut plain, None).unwrap();

        let tar = out.path().join("t");
        let progress = Arc::new(TarProgress::default());
        let mut follower = TarFollower::new(&tar, progress.clone());
        let followed = std::thread::spawn(move || {
            let mut all = Vec::new();
            follower.read_to_end(&mut all).map(|_| all)
        });
        let mut sf = SparseFile::new(std::fs::File::create(&tar).unwrap(), Some(progress.clone()));
        sf.pre = Some(pre);
        let mut w = BufWriter::new(sf);
        let stats = diff::write_delta_unhashed(u, &mut w, Some(splice_into_tar)).unwrap();
        let mut sf = w.into_inner().map_err(|e| e.into_error()).unwrap();
        let segments = std::mem::take(&mut sf.segments);
        sf.finish().unwrap();
        progress.end(true);
        assert_eq!(stats.tar_bytes, plain.len() as u64);
        let lens: Vec<u64> = segments.iter().map(|s| s.len).collect();
        assert_eq!(lens, [(4 << 20) + 17, 200 << 20], "d/big and sparse referred to, d/changed copied");
        assert!(std::fs::metadata(&tar).unwrap().blocks() * 512 < 4 << 20, "the tar has holes for them");
        assert!(followed.join().unwrap().unwrap() == plain, "the followed tar differs");

        let cap = Capture { tar: tar.clone(), diff_id: None, stats, frozen: Duration::ZERO, segments };
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
}
