//! `strata diff --patch`: what changed between two file trees, as a
//! unified diff in `git diff --no-index` form. Each tree is the merged
//! view of overlay-form layers (topmost first), read without mounting it
//! (`diff::find_in`): whiteouts and opaque directories hide what is below,
//! no symlink inside a layer is followed. A path that resolves to the
//! same file of the same layer in both trees is unchanged without reading
//! it, so comparing a snapshot with its ancestor reads only what the
//! layers between them hold.
//!
//! Text files get hunks (three lines of context); a file that is not
//! UTF-8 or holds a NUL is "Binary files ... differ", as git says; a
//! symlink's content is its target (git's mode 120000). Directories are
//! not shown; other file types are named by their mode.
#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::store::diff::{DiffError, MAX_DEPTH};
use crate::store::layers::{find_in, lower_children};

/// Files larger than this are compared but not shown line by line.
pub const MAX_SHOWN_FILE: u64 = 8 << 20;
/// A patch stops growing at this size; the rest is named, not shown.
pub const MAX_PATCH: usize = 64 << 20;

/// A path's state in one tree.
struct Entry {
    path: PathBuf,
    meta: fs::Metadata,
}

impl Entry {
    fn mode(&self) -> u32 {
        // git's modes: 100644 / 100755 for files, 120000 for symlinks.
        let ft = self.meta.file_type();
        if ft.is_symlink() {
            0o120000
        } else if ft.is_file() {
            0o100000 | if self.meta.mode() & 0o111 != 0 { 0o755 } else { 0o644 }
        } else {
            self.meta.mode()
        }
    }

    fn is_dir(&self) -> bool {
        self.meta.is_dir()
    }

    /// The same file of the same layer: unchanged, nothing read.
    fn same_file(&self, other: &Entry) -> bool {
        self.path == other.path && self.meta.ino() == other.meta.ino() && self.meta.dev() == other.meta.dev()
    }

    /// Its content as a diff shows it: a file's bytes, a symlink's target;
    /// `None` for anything else or a file too large to show.
    fn content(&self) -> Result<Option<Vec<u8>>, DiffError> {
        let ft = self.meta.file_type();
        let io = |source| DiffError::Read { path: self.path.clone(), source };
        if ft.is_symlink() {
            return Ok(Some(fs::read_link(&self.path).map_err(io)?.as_os_str().as_bytes().to_vec()));
        }
        if ft.is_file() && self.meta.len() <= MAX_SHOWN_FILE {
            return Ok(Some(fs::read(&self.path).map_err(io)?));
        }
        Ok(None)
    }
}

/// What `patch` found: the unified diff, and how many paths it names.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Patch {
    pub patch: String,
    pub files: u64,
    /// The patch reached [`MAX_PATCH`]; later files are not in it.
    pub truncated: bool,
}

/// The unified diff from tree `old` to tree `new` (each a list of layer
/// trees, topmost first).
pub fn patch(old: &[PathBuf], new: &[PathBuf]) -> Result<Patch, DiffError> {
    let mut out = Patch::default();
    walk(old, new, Path::new(""), 0, &mut out)?;
    Ok(out)
}

fn lookup(layers: &[PathBuf], rel: &Path) -> Result<Option<Entry>, DiffError> {
    let Some(path) = find_in(layers, rel) else { return Ok(None) };
    match fs::symlink_metadata(&path) {
        Ok(meta) => Ok(Some(Entry { path, meta })),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(DiffError::Read { path, source }),
    }
}

fn walk(old: &[PathBuf], new: &[PathBuf], rel: &Path, depth: usize, out: &mut Patch) -> Result<(), DiffError> {
    if depth > MAX_DEPTH {
        return Err(DiffError::TooDeep { path: rel.to_path_buf() });
    }
    let mut names = lower_children(old, rel);
    names.extend(lower_children(new, rel));
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    names.dedup();
    for name in names {
        let r = rel.join(&name);
        let (a, b) = (lookup(old, &r)?, lookup(new, &r)?);
        let (a_dir, b_dir) = (a.as_ref().is_some_and(Entry::is_dir), b.as_ref().is_some_and(Entry::is_dir));
        // A file replaced by a directory (or back) is a deletion and an
        // addition.
        let a_file = a.as_ref().filter(|_| !a_dir);
        let b_file = b.as_ref().filter(|_| !b_dir);
        if a_file.is_some() || b_file.is_some() {
            file_diff(&r, a_file, b_file, out)?;
        }
        if a_dir || b_dir {
            let (o, n): (&[PathBuf], &[PathBuf]) = (if a_dir { old } else { &[] }, if b_dir { new } else { &[] });
            walk(o, n, &r, depth + 1, out)?;
        }
    }
    Ok(())
}

/// Whether two regular files hold the same bytes (read in step).
fn same_bytes(a: &Entry, b: &Entry) -> Result<bool, DiffError> {
    use std::io::Read;
    if a.meta.len() != b.meta.len() {
        return Ok(false);
    }
    let open = |e: &Entry| fs::File::open(&e.path).map_err(|source| DiffError::Read { path: e.path.clone(), source });
    let (mut fa, mut fb) = (open(a)?, open(b)?);
    let (mut ba, mut bb) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
    loop {
        let n = fa.read(&mut ba).map_err(|source| DiffError::Read { path: a.path.clone(), source })?;
        if n == 0 {
            return Ok(true);
        }
        fb.read_exact(&mut bb[..n]).map_err(|source| DiffError::Read { path: b.path.clone(), source })?;
        if ba[..n] != bb[..n] {
            return Ok(false);
        }
    }
}

fn is_text(b: &[u8]) -> bool {
    !b[..b.len().min(8000)].contains(&0) && std::str::from_utf8(b).is_ok()
}

fn file_diff(rel: &Path, a: Option<&Entry>, b: Option<&Entry>, out: &mut Patch) -> Result<(), DiffError> {
    if let (Some(a), Some(b)) = (a, b) {
        if a.same_file(b) {
            return Ok(());
        }
    }
    let (ca, cb) = (a.map(Entry::content).transpose()?.flatten(), b.map(Entry::content).transpose()?.flatten());
    let (ma, mb) = (a.map(Entry::mode), b.map(Entry::mode));
    let changed_content = match (a, b) {
        (Some(_), Some(_)) if ca.is_some() || cb.is_some() => ca != cb,
        // Neither shown: files too large to show, compared as they are
        // read; special files by their device numbers.
        (Some(a), Some(b)) if a.meta.is_file() && b.meta.is_file() => !same_bytes(a, b)?,
        (Some(a), Some(b)) => a.meta.rdev() != b.meta.rdev(),
        _ => true,
    };
    if !changed_content && ma == mb {
        return Ok(());
    }
    if out.truncated {
        return Ok(());
    }
    if out.patch.len() >= MAX_PATCH {
        out.truncated = true;
        return Ok(());
    }
    out.files += 1;
    let name = rel.display();
    let p = &mut out.patch;
    let _ = writeln!(p, "diff --git a/{name} b/{name}");
    match (ma, mb) {
        (None, Some(m)) => {
            let _ = writeln!(p, "new file mode {m:o}");
        }
        (Some(m), None) => {
            let _ = writeln!(p, "deleted file mode {m:o}");
        }
        (Some(x), Some(y)) if x != y => {
            let _ = writeln!(p, "old mode {x:o}\nnew mode {y:o}");
        }
        _ => {}
    }
    if !changed_content {
        return Ok(());
    }
    let (from, to) = (
        if a.is_some() { format!("a/{name}") } else { "/dev/null".into() },
        if b.is_some() { format!("b/{name}") } else { "/dev/null".into() },
    );
    let empty = Vec::new();
    let shown_a = if a.is_some() { ca.as_ref() } else { Some(&empty) };
    let shown_b = if b.is_some() { cb.as_ref() } else { Some(&empty) };
    match (shown_a, shown_b) {
        (Some(x), Some(y)) if is_text(x) && is_text(y) => {
            let (x, y) = (std::str::from_utf8(x).unwrap_or(""), std::str::from_utf8(y).unwrap_or(""));
            let diff = similar::TextDiff::from_lines(x, y);
            let _ = write!(p, "{}", diff.unified_diff().context_radius(3).header(&from, &to));
            if !p.ends_with('\n') {
                p.push('\n');
            }
        }
        _ => {
            let _ = writeln!(p, "Binary files {from} and {to} differ");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> (tempfile::TempDir, PathBuf) {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("fs");
        fs::create_dir(&root).unwrap();
        for (p, c) in files {
            let path = root.join(p);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, c).unwrap();
        }
        (t, root)
    }

    #[test]
    fn a_patch_shows_hunks_additions_deletions_and_binaries_like_git() {
        let (_b, base) = tree(&[("etc/conf", "a\nb\nc\n"), ("gone", "bye\n"), ("bin/x", "\0\x01")]);
        let (_u, upper) = tree(&[("etc/conf", "a\nB\nc\n"), ("new/file", "hello\n"), ("bin/x", "\0\x02")]);
        // `gone` deleted in the upper: a whiteout (0/0 char device) needs
        // CAP_MKNOD; a test as root makes one, else leaves it out.
        let whiteout = nix::sys::stat::mknod(
            &upper.join("gone"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::empty(),
            0,
        )
        .is_ok();
        let p = patch(std::slice::from_ref(&base), &[upper, base.clone()]).unwrap();
        assert!(
            p.patch.contains(
                "diff --git a/etc/conf b/etc/conf\n--- a/etc/conf\n+++ b/etc/conf\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"
            ),
            "{}",
            p.patch
        );
        assert!(
            p.patch.contains("new file mode 100644\n--- /dev/null\n+++ b/new/file\n@@ -0,0 +1 @@\n+hello\n"),
            "{}",
            p.patch
        );
        assert!(p.patch.contains("Binary files a/bin/x and b/bin/x differ"), "{}", p.patch);
        if whiteout {
            assert!(
                p.patch.contains("deleted file mode 100644\n--- a/gone\n+++ /dev/null\n@@ -1 +0,0 @@\n-bye\n"),
                "{}",
                p.patch
            );
        }
        assert_eq!(p.files, 3 + u64::from(whiteout));
        // The same tree against itself: nothing, and no file read twice.
        let (_s, same) = tree(&[("x", "1\n")]);
        let same = [same];
        assert_eq!(patch(&same, &same).unwrap(), Patch::default());
    }
}
