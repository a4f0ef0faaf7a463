//! `Meter`: the reader between a decompressor and the `tar` parser.
//!
//! It hashes and counts every byte the parser sees (the uncompressed stream,
//! whose sha256 is the layer's diff_id), records whether the stream below it
//! failed (so a decompression error can be told apart from a tar framing
//! error after the `tar` crate has wrapped it), and caps what the parser may
//! read while it looks for the next entry. That cap matters because the `tar`
//! crate buffers PAX and GNU long-name records whole in memory: without it a
//! small gzip bomb declaring a multi-gigabyte PAX header exhausts the daemon.
#![forbid(unsafe_code)]

use std::cell::Cell;
use std::io::{self, Read};

use sha2::{Digest as _, Sha256};

use super::Digest;

/// Bytes the parser may read between two entries: the header blocks plus the
/// PAX / GNU long-name records that describe one entry.
pub const HEADER_BUDGET: u64 = 1 << 20;

/// State shared between a `Meter` (owned by the `tar::Archive`) and the code
/// driving the archive.
#[derive(Debug, Default)]
pub struct MeterState {
    budget: Cell<Option<u64>>,
    source_failed: Cell<bool>,
    over_budget: Cell<bool>,
}

impl MeterState {
    /// Limits the following reads to `HEADER_BUDGET` bytes in all.
    pub fn limit_headers(&self) {
        self.budget.set(Some(HEADER_BUDGET));
    }

    /// Lifts the limit (while entry data is read).
    pub fn unlimited(&self) {
        self.budget.set(None);
    }

    /// Whether the reader below the meter returned an error.
    pub fn source_failed(&self) -> bool {
        self.source_failed.get()
    }

    /// Whether the header budget ran out.
    pub fn over_budget(&self) -> bool {
        self.over_budget.get()
    }
}

/// Hashes and counts the bytes read through it.
pub struct Meter<'s, R> {
    inner: R,
    hasher: Sha256,
    count: u64,
    state: &'s MeterState,
}

impl<'s, R: Read> Meter<'s, R> {
    /// A meter over `inner`, reporting through `state`.
    pub fn new(inner: R, state: &'s MeterState) -> Self {
        Meter { inner, hasher: Sha256::new(), count: 0, state }
    }

    /// Reads the rest of the stream, so that trailers (gzip CRC and length)
    /// are checked and hashed.
    pub fn drain(&mut self) -> io::Result<u64> {
        self.state.unlimited();
        io::copy(self, &mut io::sink())
    }

    /// The digest and the byte count of everything read.
    pub fn finish(self) -> (Digest, u64) {
        (Digest::from_hasher(self.hasher), self.count)
    }
}

impl<R: Read> Read for Meter<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut want = buf.len();
        let budget = self.state.budget.get();
        if let Some(left) = budget {
            if left == 0 && want > 0 {
                self.state.over_budget.set(true);
                return Err(io::Error::other("tar headers exceed the size limit"));
            }
            want = want.min(usize::try_from(left).unwrap_or(usize::MAX));
        }
        let n = match self.inner.read(&mut buf[..want]) {
            Ok(n) => n,
            Err(e) => {
                if e.kind() != io::ErrorKind::Interrupted {
                    self.state.source_failed.set(true);
                }
                return Err(e);
            }
        };
        if let Some(left) = budget {
            self.state.budget.set(Some(left - n as u64));
        }
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_counts_and_enforces_the_budget() {
        let state = MeterState::default();
        let data = vec![7u8; HEADER_BUDGET as usize + 10];
        let mut m = Meter::new(&data[..], &state);
        state.limit_headers();
        let mut sink = Vec::new();
        let err = m.read_to_end(&mut sink).unwrap_err();
        assert!(state.over_budget(), "{err}");
        assert!(!state.source_failed());
        assert_eq!(sink.len() as u64, HEADER_BUDGET);
        assert_eq!(m.drain().unwrap(), 10);
        let (digest, count) = m.finish();
        assert_eq!(count, data.len() as u64);
        assert_eq!(digest, Digest::sha256(&data));
    }
}
