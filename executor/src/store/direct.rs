//! A file writer for large files that must reach the disk anyway and are
//! not read back soon (snapshot blobs): whole chunks go to the disk with
//! `O_DIRECT` from a thread of its own, and whenever that thread is still
//! busy, the caller writes the next chunk through the page cache instead.
//!
//! A buffered write copies every byte into freshly allocated page-cache
//! pages, which the later sync writes out again; a direct write has the
//! disk read the bytes from one reused buffer. Where allocating page cache
//! is what costs (a VM whose host takes back free guest pages, so that each
//! new page faults in the host) direct writes halve the memory a checkpoint
//! touches; where the disk is the slower path, the page cache takes the
//! rest, so the writer is never slower than a buffered one.
//!
//! Chunks sit at fixed offsets (chunk `i` at `i * CHUNK`), so the two paths
//! write disjoint ranges and can finish in any order. File systems that
//! refuse `O_DIRECT` (tmpfs before 6.6, some FUSE mounts) get buffered
//! writes only; the bytes in the file are the same either way.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::mpsc::{self, TryRecvError};
use std::thread::JoinHandle;

/// Address alignment that every block device accepts for `O_DIRECT` (the
/// logical block size is at most the page size); offsets and lengths are
/// multiples of `CHUNK`.
const ALIGN: usize = 4096;
/// Bytes per write.
const CHUNK: usize = 1 << 20;
/// Chunks: one being filled, one queued, one being written.
const BUFFERS: usize = 3;

/// `CHUNK` bytes at an `ALIGN`ed address (inside a slightly larger `Vec`).
struct Chunk {
    buf: Vec<u8>,
    start: usize,
}

impl Chunk {
    fn new() -> Chunk {
        let buf = vec![0u8; CHUNK + ALIGN];
        let start = buf.as_ptr().align_offset(ALIGN);
        Chunk { buf, start }
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + CHUNK]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + CHUNK]
    }
}

/// The direct path: a thread with its own open file description of the
/// file (`O_DIRECT` is a property of the description).
struct Direct {
    full: mpsc::SyncSender<(Chunk, u64)>,
    empty: mpsc::Receiver<Chunk>,
    thread: JoinHandle<io::Result<()>>,
}

pub struct DirectWriter {
    file: File,
    chunk: Chunk,
    len: usize,
    /// File offset of `chunk`.
    offset: u64,
    direct: Option<Direct>,
    /// Chunks handed to the direct path and written buffered.
    counts: (u64, u64),
}

impl DirectWriter {
    /// Write `file` (opened for writing, empty) from offset 0, directly
    /// where its file system allows it.
    pub fn new(file: File) -> DirectWriter {
        let reopened = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(format!("/proc/self/fd/{}", file.as_raw_fd()));
        let direct = reopened.ok().and_then(|d| {
            let buffered = file.try_clone().ok()?;
            let (full, filled) = mpsc::sync_channel(1);
            let (give_back, empty) = mpsc::sync_channel(BUFFERS);
            for _ in 1..BUFFERS {
                let _ = give_back.send(Chunk::new());
            }
            let thread = std::thread::Builder::new()
                .name("blob-writer".into())
                .spawn(move || write_chunks(d, buffered, filled, give_back))
                .ok()?;
            Some(Direct { full, empty, thread })
        });
        DirectWriter { file, chunk: Chunk::new(), len: 0, offset: 0, direct, counts: (0, 0) }
    }

    /// Write what is buffered, wait for the direct writes and return the
    /// file, or the first error any write met.
    pub fn finish(mut self) -> io::Result<File> {
        tracing::debug!("blob written: {} chunks direct, {} buffered", self.counts.0, self.counts.1);
        let tail = self.file.write_all_at(&self.chunk.bytes()[..self.len], self.offset);
        if let Some(d) = self.direct.take() {
            d.join()?;
        }
        tail?;
        self.file.try_clone()
    }

    /// Write the full chunk: hand it to the direct writer if it has a
    /// spare one to give back, else through the page cache, here.
    fn write_chunk(&mut self) -> io::Result<()> {
        let spare = match &self.direct {
            Some(d) => match d.empty.try_recv() {
                Ok(c) => Some(c),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => return Err(self.direct_failed()),
            },
            None => None,
        };
        match (spare, &self.direct) {
            (Some(next), Some(d)) => {
                let chunk = std::mem::replace(&mut self.chunk, next);
                if d.full.send((chunk, self.offset)).is_err() {
                    return Err(self.direct_failed());
                }
                self.counts.0 += 1;
            }
            _ => {
                self.file.write_all_at(self.chunk.bytes(), self.offset)?;
                self.counts.1 += 1;
            }
        }
        self.offset += CHUNK as u64;
        self.len = 0;
        Ok(())
    }

    /// The direct writer stopped early: its error.
    fn direct_failed(&mut self) -> io::Error {
        match self.direct.take().map(Direct::join) {
            Some(Err(e)) => e,
            _ => io::Error::other("the blob writer thread stopped early"),
        }
    }
}

impl Direct {
    /// No more chunks: wait for the thread to write what it has.
    fn join(self) -> io::Result<()> {
        drop(self.full);
        self.thread.join().unwrap_or_else(|_| Err(io::Error::other("the blob writer thread panicked")))
    }
}

/// Dropped unfinished (its producer failed): the thread is still waited
/// for, so no write outlives the writer.
impl Drop for DirectWriter {
    fn drop(&mut self) {
        if let Some(d) = self.direct.take() {
            let _ = d.join();
        }
    }
}

impl Write for DirectWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.len == CHUNK {
            self.write_chunk()?;
        }
        let n = data.len().min(CHUNK - self.len);
        self.chunk.bytes_mut()[self.len..self.len + n].copy_from_slice(&data[..n]);
        self.len += n;
        Ok(n)
    }

    /// Nothing: the last, partial chunk is written by `finish`.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The writer thread. A file system that takes the flag but refuses a
/// direct write (EINVAL) gets this and every later chunk buffered.
fn write_chunks(
    direct: File,
    buffered: File,
    filled: mpsc::Receiver<(Chunk, u64)>,
    give_back: mpsc::SyncSender<Chunk>,
) -> io::Result<()> {
    let mut is_direct = true;
    for (chunk, offset) in filled {
        let out = if is_direct { &direct } else { &buffered };
        match out.write_all_at(chunk.bytes(), offset) {
            Err(e) if is_direct && e.raw_os_error() == Some(libc::EINVAL) => {
                is_direct = false;
                buffered.write_all_at(chunk.bytes(), offset)?;
            }
            r => r?,
        }
        let _ = give_back.send(chunk);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// Sizes around the chunk and alignment edges, in odd write sizes,
    /// read back byte for byte, on a disk file system (direct) and in the
    /// test's tmp dir (direct or not).
    #[test]
    fn writes_exactly_what_it_was_given() {
        let (a, b) = (tempfile::tempdir_in("/var/tmp").unwrap(), tempfile::tempdir().unwrap());
        let sizes = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, CHUNK, CHUNK + 7, 3 * CHUNK + ALIGN, 40 * CHUNK + 5];
        for (i, (dir, &size)) in [a.path(), b.path()].iter().flat_map(|d| sizes.iter().map(move |s| (d, s))).enumerate()
        {
            let data: Vec<u8> = (0..size).map(|k| (k * 31 + k / 7) as u8).collect();
            let path = dir.join(format!("f{i}"));
            let mut w = DirectWriter::new(File::create(&path).unwrap());
            for piece in data.chunks(4093) {
                w.write_all(piece).unwrap();
            }
            let counts = w.counts;
            if size > 8 * CHUNK && w.direct.is_some() {
                // Filling a chunk is faster than the disk writes one.
                assert!(counts.0 > 0 && counts.1 > 0, "both paths used: {counts:?}");
            }
            drop(w.finish().unwrap());
            let mut back = Vec::new();
            File::open(&path).unwrap().read_to_end(&mut back).unwrap();
            assert_eq!(back.len(), size, "size {size}");
            assert!(back == data, "content of {size} bytes differs");
        }
    }

    #[test]
    fn goes_direct_where_the_file_system_allows() {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = dir.path().join("f");
        let w = DirectWriter::new(File::create(&path).unwrap());
        let can = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(&path).is_ok();
        assert_eq!(w.direct.is_some(), can, "O_DIRECT possible here: {can}");
    }

    #[test]
    fn a_failed_write_is_reported() {
        // Every write to /dev/full fails with ENOSPC, direct or not.
        let mut w = DirectWriter::new(File::options().write(true).open("/dev/full").unwrap());
        let wrote = w.write_all(&vec![7u8; 4 * CHUNK + 1]);
        let err = w.finish().expect_err("writing /dev/full succeeded");
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        assert!(wrote.is_err(), "no write failed before finish()");
    }
}
