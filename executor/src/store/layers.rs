//! Reading layers back: what a sandbox's upper changed against the layers
//! below it (`diff`), a merged view of overlay-form layers flattened into a
//! directory, and one directory of them copied out as a layer of its own
//! (a baseline's repository). Nothing here follows a symlink out of the
//! layers. Writing an upper as a layer tar is `store/diff.rs`.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{CString, OsStr};
use std::fs::{self, File};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::diff::{descend, keep_xattr, read_err, sorted_names, xattrs, DiffError, OPAQUE_XATTR};
/// One change of a delta, as `docker diff` prints it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Change {
    /// `A` added, `C` changed, `D` deleted.
    pub kind: char,
    /// Absolute path inside the sandbox.
    pub path: String,
}

/// Does `rel` exist in the merged view of `lowers` (topmost first)? A
/// whiteout or an opaque parent in an upper lower hides what is below.
/// `lower/rel`, if every ancestor of it inside `lower` is a real directory:
/// never follow a symlink in a layer to a path outside it (a layer holding
/// `d -> /` must not make `d/x` mean the host's `/x`).
fn in_layer(lower: &Path, rel: &Path) -> Option<PathBuf> {
    let mut p = lower.to_path_buf();
    let comps: Vec<_> = rel.components().collect();
    for (i, c) in comps.iter().enumerate() {
        p.push(c);
        if i + 1 < comps.len() && !fs::symlink_metadata(&p).map(|m| m.is_dir()).unwrap_or(false) {
            return None;
        }
    }
    Some(p)
}

fn in_lowers(lowers: &[PathBuf], rel: &Path) -> bool {
    find_in(lowers, rel).is_some()
}

/// Where `rel` of the merged view of `lowers` (topmost first) is: the
/// path in the topmost layer that has it; `None` if no layer has it or a
/// whiteout or an opaque directory hides it.
pub(crate) fn find_in(lowers: &[PathBuf], rel: &Path) -> Option<PathBuf> {
    for lower in lowers {
        let Some(path) = in_layer(lower, rel) else { continue };
        match fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_char_device() && m.rdev() == 0 => return None,
            Ok(_) => return Some(path),
            Err(_) => {
                // An opaque ancestor in this layer hides everything below it.
                let mut anc = rel.parent();
                while let Some(a) = anc.filter(|a| !a.as_os_str().is_empty()) {
                    if xattrs(&lower.join(a))
                        .map(|x| x.iter().any(|(n, v)| n == OPAQUE_XATTR.as_bytes() && v == b"y"))
                        .unwrap_or(false)
                    {
                        return None;
                    }
                    anc = a.parent();
                }
            }
        }
    }
    None
}

/// Names in the merged view of `lowers` under directory `rel`.
pub(crate) fn lower_children(lowers: &[PathBuf], rel: &Path) -> Vec<std::ffi::OsString> {
    let mut names: Vec<std::ffi::OsString> = Vec::new();
    for lower in lowers {
        let Some(dir) = in_layer(lower, rel) else { continue };
        if !fs::symlink_metadata(&dir).map(|m| m.is_dir()).unwrap_or(false) {
            continue;
        }
        if let Ok(rd) = fs::read_dir(&dir) {
            for e in rd.flatten() {
                if !names.contains(&e.file_name()) && in_lowers(lowers, &rel.join(e.file_name())) {
                    names.push(e.file_name());
                }
            }
        }
    }
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    names
}

/// The changes an upper (or a snapshot's delta layer) makes to `lowers`
/// (layer trees, topmost first), sorted by path.
pub fn changes(upper: &Path, lowers: &[PathBuf]) -> Result<Vec<Change>, DiffError> {
    fn walk(upper: &Path, rel: &Path, lowers: &[PathBuf], out: &mut Vec<Change>) -> Result<(), DiffError> {
        descend(rel)?;
        let dir = upper.join(rel);
        let names = sorted_names(&dir)?;
        for name in names {
            let r = rel.join(&name);
            let host = upper.join(&r);
            let meta = fs::symlink_metadata(&host).map_err(read_err(&host))?;
            let path = format!("/{}", r.display());
            if meta.file_type().is_char_device() && meta.rdev() == 0 {
                if in_lowers(lowers, &r) {
                    out.push(Change { kind: 'D', path });
                }
                continue;
            }
            let existed = in_lowers(lowers, &r);
            out.push(Change { kind: if existed { 'C' } else { 'A' }, path });
            if meta.is_dir() {
                let opaque = xattrs(&host)?.iter().any(|(n, v)| n == OPAQUE_XATTR.as_bytes() && v == b"y");
                if opaque && existed {
                    // Everything the lowers had here and the upper lacks is gone.
                    for child in lower_children(lowers, &r) {
                        if fs::symlink_metadata(host.join(&child)).is_err() {
                            out.push(Change { kind: 'D', path: format!("/{}", r.join(&child).display()) });
                        }
                    }
                }
                walk(upper, &r, lowers, out)?;
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(upper, Path::new(""), lowers, &mut out)?;
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// Flatten overlay-form layers (bottom first) into one overlay-form tree at
/// `dest` (an empty directory): the merged view of the layers, keeping the
/// whiteouts and opaque markers that still matter for whatever lies below
/// them. Used to compact a long snapshot chain into one layer; copies file
/// data (hardlinks within a layer stay hardlinks).
pub fn flatten(layers: &[PathBuf], dest: &Path) -> Result<u64, DiffError> {
    let mut copied = 0;
    for layer in layers {
        let mut links = HashMap::new();
        apply(layer, dest, Path::new(""), Form::Layer, &mut links, &mut copied)?;
    }
    Ok(copied)
}

/// What [`apply`] makes: an overlay-form layer (whiteouts and opaque
/// markers kept for what lies below) or a plain tree (the merged view: a
/// whiteout only removes, overlay's xattrs are dropped, sockets skipped).
#[derive(Clone, Copy, PartialEq)]
enum Form {
    Layer,
    Merged,
}

/// A layer holding the directory `rel` of the merged view of the
/// overlay-form `layers` (topmost first) whole, made at `dest` (an empty
/// directory): `rel`'s ancestors as directories with the merged view's
/// metadata, `rel` itself opaque (whatever lies below it in other layers is
/// hidden), and below it what a mount of `layers` shows there (owners,
/// modes, `user.*` and capability xattrs, mtimes, hardlinks within a layer;
/// no whiteouts). A baseline is such a layer: the repository, and nothing
/// else of the sandbox (`daemon/baseline.rs`).
///
/// No symlink is followed: an ancestor of `rel` that is a symlink (or any
/// other non-directory) in the layer that decides it makes `rel` not a
/// directory ([`DiffError::NotADirectory`]). The caller keeps `layers`
/// still while it runs (a sandbox's upper: frozen). Returns the bytes of
/// file data copied.
pub fn layer_of_dir(layers: &[PathBuf], rel: &Path, dest: &Path) -> Result<u64, DiffError> {
    let comps: Vec<&OsStr> = rel
        .components()
        .map(|c| match c {
            std::path::Component::Normal(n) => Ok(n),
            _ => Err(DiffError::NotADirectory { path: rel.into() }),
        })
        .collect::<Result<_, _>>()?;
    if comps.is_empty() {
        return Err(DiffError::NotADirectory { path: rel.into() });
    }
    descend(rel)?;
    let opaque = |p: &Path| -> Result<bool, DiffError> {
        Ok(xattrs(p)?.iter().any(|(n, v)| n == OPAQUE_XATTR.as_bytes() && v == b"y"))
    };
    // The layers that show something at `rel`, topmost first, and for each
    // ancestor the topmost layer where it is a directory (its metadata).
    let mut shown: Vec<&PathBuf> = Vec::new();
    let mut ancestors: Vec<Option<PathBuf>> = vec![None; comps.len() - 1];
    'layers: for layer in layers {
        let mut p = layer.clone();
        let mut hides_below = false;
        for (i, c) in comps.iter().enumerate() {
            p.push(c);
            let meta = match fs::symlink_metadata(&p) {
                Ok(m) => m,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if hides_below {
                        break 'layers;
                    }
                    continue 'layers;
                }
                Err(e) => return Err(DiffError::Read { path: p, source: e }),
            };
            if !meta.is_dir() {
                // A whiteout, a file or a symlink: `rel` is hidden below here
                // (and is no directory at all if nothing above showed it).
                if shown.is_empty() {
                    return Err(DiffError::NotADirectory { path: rel.into() });
                }
                break 'layers;
            }
            hides_below |= opaque(&p)?;
            match ancestors.get_mut(i) {
                Some(slot) => {
                    slot.get_or_insert_with(|| p.clone());
                }
                None => shown.push(layer),
            }
        }
        if hides_below {
            break;
        }
    }
    let Some(top) = shown.first() else {
        return Err(DiffError::NotADirectory { path: rel.into() });
    };
    let mut d = dest.to_path_buf();
    for (c, src) in comps.iter().zip(&ancestors) {
        d.push(c);
        fs::create_dir(&d).map_err(|source| DiffError::Write { path: d.clone(), source })?;
        if let Some(src) = src {
            let meta = fs::symlink_metadata(src).map_err(read_err(src))?;
            copy_meta(src, &meta, &d, Form::Merged)?;
        }
    }
    let target = dest.join(rel);
    fs::create_dir(&target).map_err(|source| DiffError::Write { path: target.clone(), source })?;
    let mut copied = 0;
    for layer in shown.iter().rev() {
        let mut links = HashMap::new();
        apply(layer, dest, rel, Form::Merged, &mut links, &mut copied)?;
    }
    let src = top.join(rel);
    let meta = fs::symlink_metadata(&src).map_err(read_err(&src))?;
    copy_meta(&src, &meta, &target, Form::Merged)?;
    let c = CString::new(target.as_os_str().as_bytes()).unwrap_or_default();
    let name = CString::new(OPAQUE_XATTR).unwrap_or_default();
    strata_shim::sys::lsetxattr(&c, &name, b"y")
        .map_err(|e| DiffError::Write { path: target.clone(), source: e.into() })?;
    Ok(copied)
}

fn remove_any(p: &Path) -> Result<(), DiffError> {
    match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(p).map_err(read_err(p)),
        Ok(_) => fs::remove_file(p).map_err(read_err(p)),
        Err(_) => Ok(()),
    }
}

/// Copy owner, mode, xattrs (for a layer all, including the opaque
/// marker; for a merged tree those a delta keeps) and mtime.
fn copy_meta(src: &Path, meta: &fs::Metadata, dst: &Path, form: Form) -> Result<(), DiffError> {
    use nix::sys::stat::{utimensat, UtimensatFlags};
    use nix::sys::time::TimeSpec;
    let werr = |e: nix::errno::Errno| DiffError::Write { path: dst.into(), source: e.into() };
    nix::unistd::fchownat(
        None,
        dst,
        Some(nix::unistd::Uid::from_raw(meta.uid())),
        Some(nix::unistd::Gid::from_raw(meta.gid())),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(werr)?;
    if !meta.file_type().is_symlink() {
        fs::set_permissions(dst, std::os::unix::fs::PermissionsExt::from_mode(meta.mode() & 0o7777))
            .map_err(|source| DiffError::Write { path: dst.into(), source })?;
    }
    let cdst = CString::new(dst.as_os_str().as_bytes()).unwrap_or_default();
    for (name, value) in xattrs(src)? {
        if form == Form::Merged && !keep_xattr(&name) {
            continue;
        }
        let n = CString::new(name).unwrap_or_default();
        strata_shim::sys::lsetxattr(&cdst, &n, &value).map_err(werr)?;
    }
    let t = TimeSpec::new(meta.mtime(), meta.mtime_nsec());
    utimensat(None, dst, &t, &t, UtimensatFlags::NoFollowSymlink).map_err(werr)
}

fn apply(
    layer: &Path,
    dest: &Path,
    rel: &Path,
    form: Form,
    links: &mut HashMap<(u64, u64), PathBuf>,
    copied: &mut u64,
) -> Result<(), DiffError> {
    descend(rel)?;
    let dir = layer.join(rel);
    let names = sorted_names(&dir)?;
    let mut dirs = Vec::new();
    for name in names {
        let r = rel.join(&name);
        let src = layer.join(&r);
        let dst = dest.join(&r);
        let meta = fs::symlink_metadata(&src).map_err(read_err(&src))?;
        let ft = meta.file_type();
        let werr = |source| DiffError::Write { path: dst.clone(), source };
        if ft.is_dir() {
            let opaque = xattrs(&src)?.iter().any(|(n, v)| n == OPAQUE_XATTR.as_bytes() && v == b"y");
            let is_dir = fs::symlink_metadata(&dst).map(|m| m.is_dir()).unwrap_or(false);
            if opaque || !is_dir {
                // An opaque directory replaces whatever was below it.
                remove_any(&dst)?;
                fs::create_dir(&dst).map_err(werr)?;
            }
            apply(layer, dest, &r, form, links, copied)?;
            dirs.push((src, meta, dst));
            continue;
        }
        remove_any(&dst)?;
        if form == Form::Merged && ((ft.is_char_device() && meta.rdev() == 0) || ft.is_socket()) {
            // Deleted (a whiteout removes only), or a socket (no content).
            continue;
        }
        if ft.is_char_device() && meta.rdev() == 0 {
            nix::sys::stat::mknod(&dst, nix::sys::stat::SFlag::S_IFCHR, nix::sys::stat::Mode::empty(), 0)
                .map_err(|e| werr(e.into()))?;
            continue;
        }
        if meta.nlink() > 1 {
            if let Some(first) = links.get(&(meta.dev(), meta.ino())) {
                fs::hard_link(first, &dst).map_err(werr)?;
                continue;
            }
            links.insert((meta.dev(), meta.ino()), dst.clone());
        }
        if ft.is_symlink() {
            let target = fs::read_link(&src).map_err(read_err(&src))?;
            std::os::unix::fs::symlink(target, &dst).map_err(werr)?;
        } else if ft.is_fifo() {
            nix::unistd::mkfifo(&dst, nix::sys::stat::Mode::from_bits_truncate(0o600)).map_err(|e| werr(e.into()))?;
        } else if ft.is_file() {
            // Holes stay holes (`fs::copy` writes them out as zeros).
            let from = File::open(&src).map_err(read_err(&src))?;
            let to = File::options().write(true).create_new(true).open(&dst).map_err(werr)?;
            *copied += crate::store::extents::copy_file(&from, &meta, &to).map_err(werr)?;
        } else {
            let kind = if ft.is_char_device() { "character device" } else { "block device or socket" };
            return Err(DiffError::DeviceNode { path: r, kind });
        }
        copy_meta(&src, &meta, &dst, form)?;
    }
    // Directory metadata last: creating children changes their mtime.
    for (src, meta, dst) in dirs {
        copy_meta(&src, &meta, &dst, form)?;
    }
    Ok(())
}
