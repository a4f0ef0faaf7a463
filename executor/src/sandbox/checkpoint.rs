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
//! A plain copy of the upper is the floor for the frozen time (the delta must
//! be read once while nothing writes it); writing it straight into a tar is
//! that copy, with the OCI conversion done on the way.

use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{RunEvent, Sandbox, SandboxError};
use crate::diff::{self, DeltaStats};

/// How long the kernel may take to freeze every task.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(10);

/// A file writer that leaves holes for aligned blocks of zeros, so the
/// frozen capture of a sparse file (or any long run of zeros) costs no disk
/// writes. The content read back is identical.
struct SparseFile {
    file: std::fs::File,
    len: u64,
    progress: Option<Arc<TarProgress>>,
}

impl SparseFile {
    const BLOCK: usize = 64 * 1024;

    fn new(file: std::fs::File, progress: Option<Arc<TarProgress>>) -> SparseFile {
        SparseFile { file, len: 0, progress }
    }

    /// Give the file its full length (a trailing hole is not written).
    fn finish(self) -> std::io::Result<()> {
        self.file.set_len(self.len)
    }

    fn advance(&mut self, n: usize) {
        self.len += n as u64;
        if let Some(p) = &self.progress {
            p.publish(self.len);
        }
    }
}

/// How far a capture has written its tar, shared with a [`TarFollower`].
#[derive(Default)]
pub struct TarProgress {
    /// (bytes final so far, `Some(ok)` once the capture ended).
    state: Mutex<(u64, Option<bool>)>,
    cv: Condvar,
}

impl TarProgress {
    fn publish(&self, len: u64) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).0 = len;
        self.cv.notify_all();
    }

    /// The capture is over: `ok` if the tar is complete. Later calls are
    /// ignored, so a caller can always end it on its way out.
    pub fn end(&self, ok: bool) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.1.get_or_insert(ok);
        self.cv.notify_all();
    }
}

/// Reads a capture's tar while it is being written: blocks until more is
/// final, ends when the capture has ended, fails if it failed. Bytes past
/// the file's current end are a hole the writer skipped: zeros.
pub struct TarFollower {
    path: PathBuf,
    file: Option<std::fs::File>,
    pos: u64,
    progress: Arc<TarProgress>,
}

impl TarFollower {
    pub fn new(path: &Path, progress: Arc<TarProgress>) -> TarFollower {
        TarFollower { path: path.to_path_buf(), file: None, pos: 0, progress }
    }
}

impl std::io::Read for TarFollower {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let (len, end) = {
            let mut st = self.progress.state.lock().unwrap_or_else(|e| e.into_inner());
            while st.0 <= self.pos && st.1.is_none() {
                st = self.progress.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            *st
        };
        if end == Some(false) {
            return Err(std::io::Error::other("the capture failed"));
        }
        if len <= self.pos || buf.is_empty() {
            return Ok(0);
        }
        let file = match &mut self.file {
            Some(f) => f,
            None => self.file.insert(std::fs::File::open(&self.path)?),
        };
        let want = buf.len().min((len - self.pos) as usize);
        let n = match file.read_at(&mut buf[..want], self.pos)? {
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
        // Whole zero blocks at block-aligned offsets become holes.
        let aligned = self.len.is_multiple_of(Self::BLOCK as u64);
        if aligned && buf.len() >= Self::BLOCK && buf[..Self::BLOCK].iter().all(|&b| b == 0) {
            self.file.seek(SeekFrom::Current(Self::BLOCK as i64))?;
            self.advance(Self::BLOCK);
            return Ok(Self::BLOCK);
        }
        let n = if aligned {
            buf.len().min(Self::BLOCK)
        } else {
            buf.len().min(Self::BLOCK - (self.len % Self::BLOCK as u64) as usize)
        };
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
    /// published to it (the caller ends it).
    pub fn capture(
        &self,
        upper: &Path,
        tar: &Path,
        progress: Option<Arc<TarProgress>>,
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
                    let mut w = BufWriter::with_capacity(1 << 20, SparseFile::new(f, progress));
                    let r = if followed {
                        diff::write_delta_unhashed(upper, &mut w).map(|s| (s, None))
                    } else {
                        diff::write_delta(upper, &mut w).map(|(s, h)| (s, Some(h)))
                    }
                    .map_err(SandboxError::Capture)?;
                    // No fsync: the tar is scratch under tmp/ (blob and layer are
                    // synced when written) and the sandbox is frozen meanwhile.
                    w.into_inner()
                        .map_err(|e| SandboxError::Io { step: "flush checkpoint tar", source: e.into_error() })?
                        .finish()
                        .map_err(|source| SandboxError::Io { step: "finish checkpoint tar", source })?;
                    Ok(r)
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
        let (stats, diff_id) = written.unwrap_or(Err(SandboxError::Dead(self.id.clone())))?;
        Ok(Capture { tar: tar.to_path_buf(), diff_id, stats, frozen })
    }
}
