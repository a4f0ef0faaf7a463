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
//! With a file system that lets copies be proven current (`precopy.rs`),
//! the capture is first written ahead, while the sandbox runs
//! ([`speculate`]): the same walk and the same tar, except that each file
//! of [`precopy::MIN`] bytes or more not changed lately is copied first
//! and the tar gets a hole and a [`Segment`] naming the copy. A follower
//! compresses that tar as it grows, so the blob is made while the sandbox
//! runs. Then, frozen, the capture is written again: each file whose copy
//! is still current becomes the same segment, so what is left frozen is
//! the walk, the headers, the small files, and what changed. As it writes,
//! the frozen capture compares its tar with the one written ahead (each
//! byte it writes with the byte there, each segment with the segment
//! there: [`Ahead`]); if they are the same, byte for byte, the blob made
//! ahead is the snapshot's. Else it is discarded and the frozen tar is
//! compressed after the thaw. Readers of a tar ([`TarFollower`])
//! read a segment's bytes from its copy, so what they see is the whole
//! tar; the hydration links the copy into the layer instead of writing it
//! again.

use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::precopy::{self, PreCopy, Precopied, Precopier};
use super::{RunEvent, Sandbox, SandboxError};
use crate::store::diff::{self, DeltaStats};

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
    /// Writing ahead of the freeze: takes the copies.
    copier: Option<Precopier>,
    segments: Vec<Segment>,
    /// The capture written ahead, compared with what is written here.
    against: Option<Against>,
    /// Some bytes went in by `copy_file_range`, not through `write`: not
    /// compared (and a tar written ahead so cannot be confirmed).
    spliced: bool,
    /// Writes fail once the sandbox is going away.
    pub(super) gone: super::Gone,
}

/// A capture's tar written ahead of the freeze (by [`speculate`]): the
/// file, its segments and length.
#[derive(Debug)]
pub struct Ahead {
    tar: PathBuf,
    segments: Vec<Segment>,
    len: u64,
}

/// Compares the tar being written with an [`Ahead`] one: each byte
/// written with the byte at the same offset there, each segment with the
/// segment there (same place, length and copy; copies are immutable).
/// Stops comparing at the first difference.
struct Against {
    ahead: Arc<Ahead>,
    file: std::fs::File,
    /// Segments of `ahead` met so far.
    met: usize,
    same: bool,
    buf: Vec<u8>,
}

impl Against {
    fn bytes(&mut self, at: u64, bytes: &[u8]) {
        use std::os::unix::fs::FileExt;
        if self.same {
            self.buf.resize(bytes.len(), 0);
            self.same = at + bytes.len() as u64 <= self.ahead.len
                && self.file.read_exact_at(&mut self.buf, at).is_ok()
                && self.buf == bytes;
        }
    }

    fn segment(&mut self, seg: &Segment) {
        let there = self.ahead.segments.get(self.met);
        self.same &= there.is_some_and(|t| (t.offset, t.len, &t.copy.path) == (seg.offset, seg.len, &seg.copy.path));
        self.met += 1;
    }

    /// Whether the whole tar, `len` bytes, is the one written ahead.
    fn same(&self, len: u64) -> bool {
        self.same && self.met == self.ahead.segments.len() && len == self.ahead.len
    }
}

/// A range of a capture's tar whose bytes are in a pre-copied file (the
/// tar has a hole there): a large file's content.
#[derive(Debug, Clone)]
pub struct Segment {
    pub offset: u64,
    pub len: u64,
    pub copy: PreCopy,
}

impl SparseFile {
    const BLOCK: usize = 64 * 1024;

    pub(super) fn new(file: std::fs::File, progress: Option<Arc<TarProgress>>) -> SparseFile {
        SparseFile {
            file,
            len: 0,
            progress,
            splice: true,
            pre: None,
            copier: None,
            segments: Vec::new(),
            against: None,
            spliced: false,
            gone: super::Gone::default(),
        }
    }

    /// Compare what is written with `ahead` (see [`SparseFile::same`]).
    fn compare(&mut self, ahead: &Arc<Ahead>) -> std::io::Result<()> {
        let file = std::fs::File::open(&ahead.tar)?;
        self.against = Some(Against { ahead: ahead.clone(), file, met: 0, same: true, buf: Vec::new() });
        Ok(())
    }

    /// Whether everything written so far is the tar written ahead, whole
    /// (nothing spliced uncompared).
    fn same(&self) -> bool {
        !self.spliced && self.against.as_ref().is_some_and(|a| a.same(self.len))
    }

    /// Leave a hole for `len` bytes that `copy` holds.
    fn refer(&mut self, copy: PreCopy, len: u64) -> std::io::Result<()> {
        use std::io::{Seek, SeekFrom};
        let seg = Segment { offset: self.len, len, copy };
        if let Some(a) = &mut self.against {
            a.segment(&seg);
        }
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
            self.gone.check()?;
            // The next data extent [data, hole); without SEEK_DATA, all data.
            let data = match lseek(src.as_raw_fd(), pos as i64, Whence::SeekData) {
                Ok(d) => (d as u64).min(len),
                Err(Errno::ENXIO) => len,
                Err(_) => pos,
            };
            let hole = lseek(src.as_raw_fd(), data as i64, Whence::SeekHole).map_or(len, |h| (h as u64).min(len));
            let (mut off_in, mut off_out) = (data as i64, (start + data) as i64);
            while (off_in as u64) < hole {
                self.gone.check()?;
                let want = (hole - off_in as u64).min(STEP) as usize;
                match nix::fcntl::copy_file_range(src, Some(&mut off_in), &self.file, Some(&mut off_out), want) {
                    Ok(0) => return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the file shrank")),
                    Ok(_) => {
                        // Copied inside the kernel: not compared.
                        self.spliced = true;
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
            crate::store::extents::copy_exactly(src, len - pos, &mut buffered)?;
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
/// changed since becomes a reference to the copy; writing ahead, a file
/// the pre-copier takes becomes one; else a large file's content is
/// spliced in after what is buffered; else `false` (copied). Writing
/// ahead, a large file spliced means the frozen capture will splice it too
/// (it has no copy), uncompared: the tar written ahead cannot be
/// confirmed, so its follower is stopped at once; the walk goes on for
/// the copies.
fn splice_into_tar(
    w: &mut &mut BufWriter<SparseFile>,
    src: &std::fs::File,
    meta: &std::fs::Metadata,
) -> std::io::Result<bool> {
    use std::io::Write;
    let len = meta.len();
    let mut copy = match &w.get_ref().pre {
        Some(pre) if len >= precopy::MIN => pre.reusable(meta).cloned(),
        _ => None,
    };
    if let (None, Some(copier)) = (&copy, &mut w.get_mut().copier) {
        copy = copier.take(src, meta, |file, src, len, gone| {
            let mut sparse = SparseFile::new(file, None);
            sparse.gone = gone;
            sparse.splice_from(src, len)?;
            sparse.finish()
        })?;
    }
    if copy.is_none() && len < SPLICE_MIN {
        return Ok(false);
    }
    w.flush()?;
    let sf = w.get_mut();
    let r = match copy {
        Some(copy) => sf.refer(copy, len),
        None => sf.splice_from(src, len),
    };
    if let (true, Some(_), Some(p)) = (sf.spliced, &sf.copier, &sf.progress) {
        p.cancel();
    }
    r.map(|()| true)
}

/// A capture written ahead of the freeze, by [`speculate`].
pub struct Speculation {
    /// The copies taken; the frozen capture refers to those still current.
    pub pre: Arc<Precopied>,
    /// The tar, if the walk got through; else why not (a tree changing
    /// under it can make it fail; a large file that could not be copied
    /// makes it useless).
    pub ahead: Result<Arc<Ahead>, String>,
}

/// Write `upper`'s capture ahead to `tar` while the sandbox runs, taking
/// pre-copies with `copier`; each write is published to `progress`, which
/// is ended here. Needs no freeze: the walk goes by directory fds and
/// never follows a symlink (`diff.rs`), and nothing it writes is used
/// unless the frozen capture writes the same tar.
pub fn speculate(
    upper: &Path,
    tar: &Path,
    mut copier: Precopier,
    progress: Arc<TarProgress>,
    gone: &super::Gone,
    since: Option<&crate::store::stamps::Stamps>,
) -> Speculation {
    use std::io::Write;
    let started = Instant::now();
    let file = match std::fs::File::create(tar) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!("write ahead {}: {e}", tar.display());
            progress.end(false);
            let ahead = Err(format!("create {}: {e}", tar.display()));
            return Speculation { pre: Arc::new(copier.finish(started.elapsed())), ahead };
        }
    };
    let mut sparse = SparseFile::new(file, Some(progress.clone()));
    sparse.gone = gone.clone();
    copier.gone = gone.clone();
    sparse.copier = Some(copier);
    let mut w = BufWriter::with_capacity(1 << 20, sparse);
    let walked = diff::write_delta_unhashed(upper, &mut w, Some(splice_into_tar), since)
        .map_err(|e| crate::error::chain(&e))
        .and_then(|_| w.flush().map_err(|e| crate::error::chain(&e)));
    let (mut sparse, _) = w.into_parts();
    let copier = sparse.copier.take();
    let segments = std::mem::take(&mut sparse.segments);
    let len = sparse.len;
    let walked = walked.and_then(|()| match sparse.spliced {
        true => Err("a file of 1 MiB or more could not be copied (open for writing, or changed lately)".into()),
        false => Ok(()),
    });
    let ahead = walked
        .and_then(|()| sparse.finish().map_err(|e| crate::error::chain(&e)))
        .map(|()| Arc::new(Ahead { tar: tar.to_path_buf(), segments, len }));
    if let Err(e) = &ahead {
        tracing::debug!("write ahead of {}: {e}", upper.display());
    }
    progress.end(ahead.is_ok());
    let took = started.elapsed();
    Speculation { pre: Arc::new(copier.map(|c| c.finish(took)).unwrap_or_default()), ahead }
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
    /// `Some(ok)` once the capture ended (or was cancelled: `false`).
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

    /// Stop the follower (its reads fail), whether or not the tar is
    /// complete: what it makes is not wanted.
    pub fn cancel(&self) {
        self.lock().end = Some(false);
        self.cv.notify_all();
    }

    /// A guard that ends the capture as failed when dropped, unless it
    /// ended before: held by the code that drives a capture, so that a
    /// panic anywhere in it (the thread unwinding) cannot leave a
    /// follower waiting forever, and with it the scope that joins both.
    pub fn end_on_drop(self: &Arc<Self>) -> EndOnDrop {
        EndOnDrop(self.clone())
    }
}

/// See [`TarProgress::end_on_drop`].
pub struct EndOnDrop(Arc<TarProgress>);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        self.0.end(false);
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
        TarFollower::of_file(&cap.tar, cap.segments.clone())
    }

    /// Reads a finished capture's tar, whose `segments` are in their
    /// pre-copied files.
    pub fn of_file(tar: &Path, segments: Vec<Segment>) -> std::io::Result<TarFollower> {
        let file = std::fs::File::open(tar)?;
        let len = file.metadata()?.len();
        Ok(TarFollower { path: tar.to_path_buf(), file: Some(file), pos: 0, segments, open: None, progress: None, len })
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
        self.gone.check()?;
        // Up to the next block boundary at most; all zeros become a hole
        // (the file system allocates whole blocks of it only if data lands
        // next to it).
        let n = buf.len().min(Self::BLOCK - (self.len % Self::BLOCK as u64) as usize);
        let n = if buf[..n].iter().all(|&b| b == 0) {
            self.file.seek(SeekFrom::Current(n as i64))?;
            n
        } else {
            self.file.write(&buf[..n])?
        };
        if let Some(a) = &mut self.against {
            a.bytes(self.len, &buf[..n]);
        }
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
    /// Whether it is, byte for byte, the tar written ahead.
    pub same_as_ahead: bool,
    /// What it saw of each entry (for the next capture to write only what
    /// changed since).
    pub stamps: crate::store::stamps::Stamps,
}

impl Capture {
    /// The pre-copied file holding exactly the `len` bytes at `offset`.
    pub fn prepared(&self, offset: u64, len: u64) -> Option<PathBuf> {
        prepared_in(&self.segments, offset, len)
    }
}

/// The pre-copied file among `segments` (by offset) holding exactly the
/// `len` bytes at `offset`.
pub fn prepared_in(segments: &[Segment], offset: u64, len: u64) -> Option<PathBuf> {
    let i = segments.partition_point(|s| s.offset < offset);
    segments.get(i).filter(|s| s.offset == offset && s.len == len).map(|s| s.copy.path.to_path_buf())
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
    /// published to it (the caller ends it). With `spec`, files it copied
    /// that did not change since are referred to, not copied, and the tar
    /// is compared with the one it wrote ([`Capture::same_as_ahead`]). With
    /// `since`, only what changed since those stamps is written.
    pub fn capture(
        &self,
        upper: &Path,
        tar: &Path,
        progress: Option<Arc<TarProgress>>,
        spec: Option<&Speculation>,
        since: Option<&crate::store::stamps::Stamps>,
    ) -> Result<Capture, SandboxError> {
        let started = Instant::now();
        let state = self.transition(RunEvent::Capture, "checkpoint", || Ok(()))?;
        let froze = matches!(state, super::RunState::Capturing { was_paused: false });
        let mut result = if froze { self.cgroup.freeze(FREEZE_TIMEOUT).map_err(SandboxError::Freezer) } else { Ok(()) };
        if froze && result.is_ok() {
            crate::failpoint::hit("checkpoint:frozen");
        }
        let written = result.as_ref().ok().map(|_| {
            std::fs::File::create(tar)
                .map_err(|source| SandboxError::Io { step: "create checkpoint tar", source })
                .and_then(|f| {
                    // With a follower, or a capture written ahead to
                    // compare with, the capture only copies (the hydration
                    // hashes the tar after the thaw).
                    let unhashed = progress.is_some() || spec.is_some();
                    let mut sparse = SparseFile::new(f, progress);
                    sparse.gone = self.gone.clone();
                    if let Some(ahead) = spec.and_then(|s| s.ahead.as_ref().ok()) {
                        // Not comparing only costs the blob made ahead.
                        let _ = sparse.compare(ahead);
                    }
                    sparse.pre = spec.map(|s| s.pre.clone());
                    let mut w = BufWriter::with_capacity(1 << 20, sparse);
                    let r = if unhashed {
                        diff::write_delta_unhashed(upper, &mut w, Some(splice_into_tar), since)
                            .map(|(s, stamps)| (s, None, stamps))
                    } else {
                        diff::write_delta_since(upper, &mut w, since).map(|(s, h, stamps)| (s, Some(h), stamps))
                    }
                    .map_err(SandboxError::Capture)?;
                    // No fsync: the tar is scratch under tmp/ (blob and layer are
                    // synced when written) and the sandbox is frozen meanwhile.
                    let mut sparse = w
                        .into_inner()
                        .map_err(|e| SandboxError::Io { step: "flush checkpoint tar", source: e.into_error() })?;
                    let same_as_ahead = sparse.same();
                    let segments = std::mem::take(&mut sparse.segments);
                    sparse.finish().map_err(|source| SandboxError::Io { step: "finish checkpoint tar", source })?;
                    Ok((r, segments, same_as_ahead))
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
        let ((stats, diff_id, stamps), segments, same_as_ahead) =
            written.unwrap_or(Err(SandboxError::Dead(self.id.clone())))?;
        Ok(Capture { tar: tar.to_path_buf(), diff_id, stats, frozen, segments, same_as_ahead, stamps })
    }
}

#[cfg(test)]
mod tests;
