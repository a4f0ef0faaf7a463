//! A file's data extents (`SEEK_DATA`/`SEEK_HOLE`), so that what the
//! daemon does with a sandbox's sparse file costs what it holds, not what
//! it claims: `truncate -s 16G` makes a file of 0 blocks that, read
//! through, is 16 GiB of zeros to read, hash, compress and scan (61-106 s
//! of daemon CPU per checkpoint before this module).
//!
//! Used by the delta writer (`diff.rs`: a file with holes becomes a GNU
//! sparse tar entry of its extents) and by compaction (`flatten`: copies
//! keep their holes).
#![forbid(unsafe_code)]

use std::fs::File;
use std::io::{self, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

use nix::errno::Errno;
use nix::unistd::{lseek, Whence};

/// Copy exactly `len` bytes of `src` from its current offset to `out`; a
/// file that ends sooner (it shrank while read) is an error.
pub fn copy_exactly(src: &File, len: u64, out: &mut impl Write) -> io::Result<()> {
    match io::copy(&mut io::Read::take(src, len), out)? {
        n if n == len => Ok(()),
        n => Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("{n} of {len} bytes: the file shrank"))),
    }
}

/// Holes smaller than this in all are not worth a sparse entry (its map
/// and the extra headers cost more than the zeros).
pub const MIN_HOLES: u64 = 1 << 20;

/// Most extents a sparse entry lists; past this the nearest extents are
/// joined (the zeros between them read as data), so that a file fragmented
/// on purpose costs a map of at most a few hundred KiB (the unpacker takes
/// up to 2^20 entries).
pub const MAX_EXTENTS: usize = 16 << 10;

/// Data extents `(offset, length)` of a file of `len` bytes, as the file
/// system reports them (whole blocks; the last may end at `len`): sorted,
/// disjoint, at most [`MAX_EXTENTS`]. `None` when the file has less than [`MIN_HOLES`] of
/// holes (the common case, told from its block count alone), or the file
/// system cannot say where they are.
pub fn data_extents(file: &File, meta: &std::fs::Metadata) -> io::Result<Option<Vec<(u64, u64)>>> {
    let len = meta.size();
    if meta.blocks().saturating_mul(512).saturating_add(MIN_HOLES) > len {
        return Ok(None);
    }
    let fd = file.as_raw_fd();
    let mut extents: Vec<(u64, u64)> = Vec::new();
    let mut pos = 0u64;
    while pos < len {
        let data = match lseek(fd, pos as i64, Whence::SeekData) {
            Ok(d) => d as u64,
            Err(Errno::ENXIO) => break, // only a hole from here on
            Err(Errno::EINVAL | Errno::EOPNOTSUPP) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        if data >= len {
            break;
        }
        let hole = match lseek(fd, data as i64, Whence::SeekHole) {
            Ok(h) => (h as u64).min(len),
            Err(Errno::ENXIO) => len, // shrank meanwhile: the read finds out
            Err(e) => return Err(e.into()),
        };
        if hole <= data {
            return Err(io::Error::other("SEEK_HOLE did not advance: the file changed while it was read"));
        }
        extents.push((data, hole - data));
        pos = hole;
    }
    let extents = join_nearest(extents, MAX_EXTENTS);
    let data: u64 = extents.iter().map(|&(_, n)| n).sum();
    Ok((len - data.min(len) >= MIN_HOLES).then_some(extents))
}

/// Join the extents separated by the smallest gaps until at most `max`
/// are left (ties: the earlier gap first, so the result is deterministic).
fn join_nearest(extents: Vec<(u64, u64)>, max: usize) -> Vec<(u64, u64)> {
    if extents.len() <= max || max == 0 {
        return extents;
    }
    let mut gaps: Vec<(u64, usize)> =
        extents.windows(2).enumerate().map(|(i, w)| (w[1].0 - (w[0].0 + w[0].1), i)).collect();
    gaps.sort_unstable();
    let mut join = vec![false; extents.len()];
    for &(_, i) in &gaps[..extents.len() - max] {
        join[i] = true; // extent i runs on into extent i + 1
    }
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(max);
    let mut extending = false;
    for (i, &(s, n)) in extents.iter().enumerate() {
        match out.last_mut() {
            Some((os, on)) if extending => *on = s + n - *os,
            _ => out.push((s, n)),
        }
        extending = join[i];
    }
    out
}

/// Copy `src` (`meta` its `fstat`) to the empty file `dst`, holes kept as
/// holes where `src` has enough of them to matter; returns the bytes
/// `dst` then holds (its length).
pub fn copy_file(src: &File, meta: &std::fs::Metadata, dst: &File) -> io::Result<u64> {
    let len = meta.size();
    let Some(extents) = data_extents(src, meta)? else {
        return io::copy(&mut &*src, &mut &*dst);
    };
    for (off, n) in extents {
        (&*src).seek(SeekFrom::Start(off))?;
        (&*dst).seek(SeekFrom::Start(off))?;
        copy_exactly(src, n, &mut &*dst)?;
    }
    dst.set_len(len)?;
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    fn sparse(dir: &std::path::Path, len: u64, data_at: &[u64]) -> File {
        let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(dir.join("s")).unwrap();
        f.set_len(len).unwrap();
        for &at in data_at {
            f.write_all_at(&[7u8; 4096], at).unwrap();
        }
        f.sync_all().unwrap();
        f
    }

    #[test]
    fn a_file_with_holes_lists_its_data_only() {
        let t = tempfile::tempdir().unwrap();
        let f = sparse(t.path(), 64 << 20, &[0, 32 << 20]);
        let got = data_extents(&f, &f.metadata().unwrap()).unwrap().expect("sparse");
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].0, 0);
        assert_eq!(got[1].0, 32 << 20);
        assert!(got.iter().all(|&(s, n)| s % 512 == 0 && n % 512 == 0 && (4096..(1 << 20)).contains(&n)), "{got:?}");
        // No data at all: no extents, still sparse.
        let empty = tempfile::tempdir().unwrap();
        let h = sparse(empty.path(), 16 << 30, &[]);
        assert_eq!(data_extents(&h, &h.metadata().unwrap()).unwrap(), Some(vec![]));
        // A file without holes worth it is not sparse.
        let full = tempfile::tempdir().unwrap();
        let mut d = File::create(full.path().join("d")).unwrap();
        d.write_all(&vec![1u8; 3 << 20]).unwrap();
        assert_eq!(data_extents(&d, &d.metadata().unwrap()).unwrap(), None);
    }

    #[test]
    fn too_many_extents_join_across_the_smallest_gaps() {
        let e = vec![(0, 512), (1024, 512), (10_240, 512), (10_752 + 512, 512), (100_000 * 512, 1000)];
        let got = join_nearest(e.clone(), 3);
        assert_eq!(got, vec![(0, 1536), (10_240, 1536), (100_000 * 512, 1000)]);
        assert_eq!(join_nearest(e.clone(), 1), vec![(0, 100_000 * 512 + 1000)]);
        assert_eq!(join_nearest(e.clone(), 10), e);
    }

    #[test]
    fn a_copy_keeps_the_holes_and_the_bytes() {
        let t = tempfile::tempdir().unwrap();
        let f = sparse(t.path(), 1 << 30, &[4096, 512 << 20]);
        let dst = File::options().read(true).write(true).create_new(true).open(t.path().join("copy")).unwrap();
        assert_eq!(copy_file(&f, &f.metadata().unwrap(), &dst).unwrap(), 1 << 30);
        let m = dst.metadata().unwrap();
        assert_eq!(m.len(), 1 << 30);
        assert!(m.blocks() * 512 < 1 << 20, "the copy is not sparse: {} blocks", m.blocks());
        let mut buf = [0u8; 4096];
        dst.read_exact_at(&mut buf, 512 << 20).unwrap();
        assert_eq!(buf, [7u8; 4096]);
        dst.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(buf, [0u8; 4096]);
    }
}
