//! Deleting a directory tree of any depth (issue 17: a sandbox makes trees
//! 40,000 levels deep by `mkdir a; cd a`, far past PATH_MAX).
//!
//! `std::fs::remove_dir_all` recurses on the stack and holds one descriptor
//! per level: at 15,000 levels it overflowed a 2 MiB thread's stack (the
//! daemon aborted on `strata rm`), at 30,000 it ran out of descriptors (the
//! start-up sweep failed and the daemon would not start). [`remove_all`]
//! keeps its position as a heap stack of names, holds one directory open
//! (plus one listing of it) at a time, climbs back with `..` checked
//! against the device and inode it left, and never crosses a mount.
//!
//! Owns: removal of trees, and reading which mounts sit under a path. Does not own deciding what may be removed
//! (the store checks for mounts and holds first).

#![forbid(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use nix::dir::{Dir, Type};
use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{fstat, fstatat, Mode, SFlag};
use nix::unistd::{unlinkat, UnlinkatFlags};
use strata_shim::sys;

fn err(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// A directory's identity, to check that `..` leads back where we came from.
fn id_of(fd: &OwnedFd) -> io::Result<(u64, u64)> {
    let st = fstat(fd.as_raw_fd()).map_err(err)?;
    Ok((st.st_dev, st.st_ino))
}

fn open_dir(parent: &OwnedFd, name: &std::ffi::CStr) -> Result<OwnedFd, Errno> {
    sys::openat(parent.as_fd(), name, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW, 0)
}

fn open_path(path: &Path) -> io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW).open(path)?;
    Ok(f.into())
}

/// How many signs of a tree changing under `remove_all` it bears.
const MAX_SURPRISES: u32 = 64;

/// What one pass over a directory found.
enum Pass {
    /// Nothing was left in it.
    Empty,
    /// Entries were removed; look again (a listing may miss entries of a
    /// directory changed while it is read).
    Removed,
    /// This subdirectory is not empty: go into it.
    Descend(CString),
}

/// One pass over `dir`: unlink what is not a directory, rmdir empty
/// directories, stop at the first non-empty one.
fn pass(dir: &OwnedFd) -> io::Result<Pass> {
    // A listing of its own (a fresh offset); `dir` itself stays the
    // descriptor names are resolved against.
    let mut listing =
        Dir::openat(Some(dir.as_raw_fd()), ".", OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(err)?;
    let mut removed = false;
    for entry in listing.iter() {
        let entry = entry.map_err(err)?;
        let name = entry.file_name();
        if matches!(name.to_bytes(), b"." | b"..") {
            continue;
        }
        let is_dir = match entry.file_type() {
            Some(t) => t == Type::Directory,
            None => match fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => SFlag::from_bits_truncate(st.st_mode & libc::S_IFMT) == SFlag::S_IFDIR,
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(err(e)),
            },
        };
        let how = if is_dir { UnlinkatFlags::RemoveDir } else { UnlinkatFlags::NoRemoveDir };
        match unlinkat(Some(dir.as_raw_fd()), name, how) {
            Ok(()) | Err(Errno::ENOENT) => removed = true,
            Err(Errno::ENOTEMPTY | Errno::EEXIST) if is_dir => return Ok(Pass::Descend(name.to_owned())),
            Err(e) => return Err(err(e)),
        }
    }
    Ok(if removed { Pass::Removed } else { Pass::Empty })
}

/// Remove `path` and everything below it, whatever its depth, holding at
/// most three descriptors. A symlink is removed, not followed; a mount
/// inside the tree stops the removal with an error (nothing of it is
/// touched). A missing `path` is not an error.
pub fn remove_all(path: &Path) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        r => r?,
    };
    if !meta.is_dir() {
        return std::fs::remove_file(path);
    }
    let mut cur = open_path(path)?;
    let (dev, _) = id_of(&cur)?;
    // Names from the top down to `cur`, each with its parent's identity.
    let mut stack: Vec<(CString, (u64, u64))> = Vec::new();
    // What a tree at rest never shows: a second pass in a row over one
    // directory that still finds entries, an emptied directory that is not
    // empty on the way back up. A few come from listings that missed an
    // entry; many mean someone is writing the tree (a process of another
    // sandbox holding a descriptor of it, say), which must not hold the
    // remover forever.
    let mut surprises = 0;
    let mut again = false;
    let surprise = |n: &mut u32| {
        *n += 1;
        if *n > MAX_SURPRISES {
            return Err(io::Error::other(format!("{}: still being written while it is removed", path.display())));
        }
        Ok(())
    };
    loop {
        let found = pass(&cur)?;
        if matches!(found, Pass::Removed) && again {
            surprise(&mut surprises)?;
        }
        again = matches!(found, Pass::Removed);
        match found {
            Pass::Removed => continue,
            Pass::Descend(name) => {
                let child = open_dir(&cur, &name).map_err(err)?;
                let (child_dev, _) = id_of(&child)?;
                if child_dev != dev {
                    return Err(io::Error::other(format!("{}: a mount inside the tree (not removed)", path.display())));
                }
                stack.push((name, id_of(&cur)?));
                cur = child;
            }
            Pass::Empty => {
                let Some((name, parent_id)) = stack.pop() else { break };
                let parent = open_dir(&cur, c"..").map_err(err)?;
                if id_of(&parent)? != parent_id {
                    return Err(io::Error::other(format!("{}: the tree moved while it was removed", path.display())));
                }
                cur = parent;
                match unlinkat(Some(cur.as_raw_fd()), name.as_c_str(), UnlinkatFlags::RemoveDir) {
                    // Not empty after all (a listing missed an entry): the
                    // next pass finds it and goes back in.
                    Ok(()) | Err(Errno::ENOENT) => {}
                    Err(Errno::ENOTEMPTY | Errno::EEXIST) => surprise(&mut surprises)?,
                    Err(e) => return Err(err(e)),
                }
            }
        }
    }
    drop(cur);
    std::fs::remove_dir(path)
}

/// The kernel escapes space, tab, newline and backslash in mount points as
/// `\ooo` octal.
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Mount points at or below `path` in the caller's mount namespace, in
/// mount order (a later one may sit on an earlier one). Read here, not with
/// `procfs`: its `MountInfo::mount_point` keeps the kernel's octal escapes
/// (`\040` for a space), so a root path with a space would match nothing.
pub fn mounts_under(path: &Path) -> Vec<String> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else { return vec![] };
    let prefix = path.to_string_lossy().into_owned();
    let below = format!("{}/", prefix.trim_end_matches('/'));
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape)
        .filter(|mp| *mp == prefix || mp.starts_with(&below))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Make `depth` nested directories `d` under `top` by descriptor (the
    /// path would be far past PATH_MAX), with a file and a symlink at
    /// every 1000th level.
    fn deep(top: &Path, depth: usize) {
        let mut cur = open_path(top).unwrap();
        for i in 0..depth {
            nix::sys::stat::mkdirat(Some(cur.as_raw_fd()), "d", Mode::from_bits_truncate(0o755)).unwrap();
            if i % 1000 == 0 {
                let f = sys::openat(cur.as_fd(), c"f", libc::O_CREAT | libc::O_WRONLY, 0o644).unwrap();
                drop(f);
                nix::unistd::symlinkat("/etc", Some(cur.as_raw_fd()), "link").unwrap();
            }
            cur = open_dir(&cur, c"d").unwrap();
        }
    }

    /// This process's descriptors that point into `dir` (counting all of
    /// them would race with the other tests' threads). A directory deep in
    /// the tree has a path too long to read back: ENAMETOOLONG counts too.
    fn open_fds_under(dir: &Path) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| match std::fs::read_link(e.path()) {
                Ok(target) => target.starts_with(dir),
                Err(err) => err.raw_os_error() == Some(libc::ENAMETOOLONG),
            })
            .count()
    }

    #[test]
    fn a_tree_far_past_path_max_is_removed_on_a_small_stack() {
        let t = tempfile::tempdir().unwrap();
        let top = t.path().join("top");
        std::fs::create_dir(&top).unwrap();
        deep(&top, 40_000);
        // A thread with a 64 KiB stack: recursion of any kind would overflow it.
        let p = top.clone();
        let r =
            std::thread::Builder::new().stack_size(64 * 1024).spawn(move || remove_all(&p)).unwrap().join().unwrap();
        r.unwrap();
        assert!(!top.exists());
        assert_eq!(open_fds_under(t.path()), 0, "descriptors leaked");
        // /etc, the target of the symlinks, is untouched.
        assert!(Path::new("/etc/passwd").exists());
    }

    #[test]
    fn a_directory_written_while_it_is_removed_does_not_hold_the_remover() {
        let t = tempfile::tempdir().unwrap();
        let top = t.path().join("busy");
        std::fs::create_dir_all(top.join("sub")).unwrap();
        // A writer with a descriptor of `sub`, as a process of another
        // sandbox could hold one, creates entries as fast as it can.
        let dir = open_path(&top.join("sub")).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let name = CString::new(format!("f{i}")).unwrap();
                    if sys::openat(dir.as_fd(), &name, libc::O_CREAT | libc::O_WRONLY, 0o644).is_err() {
                        break; // `sub` is gone
                    }
                    i += 1;
                }
            })
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let p = top.clone();
        std::thread::spawn(move || tx.send(remove_all(&p)));
        let r = rx.recv_timeout(std::time::Duration::from_secs(20)).expect("remove_all never returned");
        if let Err(e) = &r {
            assert!(e.to_string().contains("still being written while it is removed"), "{e}");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.join().unwrap();
        // At rest, it goes.
        remove_all(&top).unwrap();
        assert!(!top.exists());
    }

    #[test]
    fn wide_trees_files_and_missing_paths() {
        let t = tempfile::tempdir().unwrap();
        let top = t.path().join("wide");
        for i in 0..300 {
            let d = top.join(format!("d{i}/e"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("f"), "x").unwrap();
            std::fs::write(top.join(format!("f{i}")), "y").unwrap();
        }
        remove_all(&top).unwrap();
        assert!(!top.exists());
        remove_all(&top).unwrap();
        let f = t.path().join("file");
        std::fs::write(&f, "z").unwrap();
        remove_all(&f).unwrap();
        assert!(!f.exists());
    }

    #[test]
    fn octal_escapes_are_decoded() {
        assert_eq!(unescape(r"/a\040b\011c\134d"), "/a b\tc\\d");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert_eq!(unescape(r"/short\04"), r"/short\04");
    }

    #[test]
    fn mounts_under_matches_whole_components() {
        // "/" is always mounted; "/pro" must not match "/proc".
        assert!(!mounts_under(Path::new("/")).is_empty());
        assert!(mounts_under(Path::new("/pro")).is_empty());
    }
}
