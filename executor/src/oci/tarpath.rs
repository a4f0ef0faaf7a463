//! Lexical checks on tar entry names and link targets, shared by the layer
//! unpacker and the OCI archive reader. Pure functions on bytes, no I/O: the
//! file system walk that refuses symlinks lives in `unpack`.
#![forbid(unsafe_code)]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// Longest entry name or link target accepted, in bytes (Linux `PATH_MAX`).
pub const PATH_MAX: usize = 4096;
/// Longest single path component accepted, in bytes (Linux `NAME_MAX`).
pub const NAME_MAX: usize = 255;
/// Longest entry name quoted back in an error; hostile names can be huge.
const SHOWN: usize = 512;

/// What is wrong with a tar entry name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// The raw name has no bytes at all.
    #[error("has an empty name")]
    Empty,
    /// A NUL byte inside the name (possible through PAX `path` records).
    #[error("has a NUL byte in its name")]
    Nul,
    /// The name starts with `/`.
    #[error("has an absolute path")]
    Absolute,
    /// A `..` component: the name could climb out of the root.
    #[error("escapes the root through '..'")]
    DotDot,
    /// Longer than `PATH_MAX`.
    #[error("has a name longer than {PATH_MAX} bytes")]
    PathTooLong,
    /// A component longer than `NAME_MAX`.
    #[error("has a path component longer than {NAME_MAX} bytes")]
    NameTooLong,
    /// More than `MAX_DEPTH` components.
    #[error("is nested deeper than {MAX_DEPTH} directories")]
    TooDeep,
}

/// The deepest entry a layer may hold, and the deepest directory a capture,
/// diff or compaction descends into (`diff` walks trees recursively; this
/// keeps every walker far from the end of its stack).
pub const MAX_DEPTH: usize = 512;

/// Splits an entry name into its components. `.` components, repeated and
/// trailing slashes are dropped (so `./a//b/` is `["a", "b"]`); `./` alone is
/// the root and gives no components. Absolute names, `..` anywhere, NUL bytes
/// and over-long names are refused.
pub fn components(raw: &[u8]) -> Result<Vec<&[u8]>, PathError> {
    if raw.is_empty() {
        return Err(PathError::Empty);
    }
    if raw.contains(&0) {
        return Err(PathError::Nul);
    }
    if raw.len() > PATH_MAX {
        return Err(PathError::PathTooLong);
    }
    if raw[0] == b'/' {
        return Err(PathError::Absolute);
    }
    let mut out = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err(PathError::DotDot),
            _ if c.len() > NAME_MAX => return Err(PathError::NameTooLong),
            _ => out.push(c),
        }
    }
    if out.len() > MAX_DEPTH {
        return Err(PathError::TooDeep);
    }
    Ok(out)
}

/// Whether a relative symlink target, resolved lexically from a directory
/// `depth` levels below the root, climbs above the root at any point.
pub fn climbs_out(depth: usize, target: &[u8]) -> bool {
    let mut level = depth;
    for c in target.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => match level.checked_sub(1) {
                Some(l) => level = l,
                None => return true,
            },
            _ => level += 1,
        }
    }
    false
}

/// Joins components back into the normal form used as a key (`a/b`).
pub fn join(comps: &[&[u8]]) -> Vec<u8> {
    comps.join(&b'/')
}

/// A readable name for a tar entry type, for error messages.
pub fn kind_name(kind: tar::EntryType) -> &'static str {
    use tar::EntryType as T;
    match kind {
        T::Regular => "regular file",
        T::Link => "hard link",
        T::Symlink => "symlink",
        T::Char => "character device",
        T::Block => "block device",
        T::Directory => "directory",
        T::Fifo => "fifo",
        T::Continuous => "contiguous file",
        T::GNULongName => "GNU long name record",
        T::GNULongLink => "GNU long link record",
        T::GNUSparse => "GNU sparse file",
        T::XGlobalHeader => "PAX global header",
        T::XHeader => "PAX header",
        _ => "unknown entry type",
    }
}

/// A raw name as a path for error messages, cut to a readable length.
pub fn shown(raw: &[u8]) -> PathBuf {
    if raw.len() <= SHOWN {
        return PathBuf::from(OsStr::from_bytes(raw));
    }
    let mut cut = raw[..SHOWN].to_vec();
    cut.extend_from_slice(b"...");
    PathBuf::from(OsStr::from_bytes(&cut))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_dot_and_slashes() {
        assert_eq!(components(b"./a//b/./c/").unwrap(), vec![&b"a"[..], b"b", b"c"]);
        assert!(components(b"./").unwrap().is_empty());
        assert!(components(b".").unwrap().is_empty());
        assert_eq!(components(b"a").unwrap(), vec![&b"a"[..]]);
        assert_eq!(components(b"..a/b..").unwrap(), vec![&b"..a"[..], b"b.."]);
    }

    #[test]
    fn refuses_hostile_names() {
        assert_eq!(components(b""), Err(PathError::Empty));
        assert_eq!(components(b"a\0b"), Err(PathError::Nul));
        assert_eq!(components(b"/etc/passwd"), Err(PathError::Absolute));
        assert_eq!(components(b"//etc"), Err(PathError::Absolute));
        assert_eq!(components(b".."), Err(PathError::DotDot));
        assert_eq!(components(b"a/../../b"), Err(PathError::DotDot));
        assert_eq!(components(b"a/.."), Err(PathError::DotDot));
        assert_eq!(components(&[b'a'; 256]), Err(PathError::NameTooLong));
        assert!(components(&[b'a'; 255]).is_ok());
        let long = b"a/".repeat(2049);
        assert_eq!(components(&long), Err(PathError::PathTooLong));
    }

    #[test]
    fn detects_climbing_symlink_targets() {
        assert!(!climbs_out(0, b"a/b"));
        assert!(climbs_out(0, b".."));
        assert!(climbs_out(0, b"a/../../b"));
        assert!(!climbs_out(1, b"../b"));
        assert!(climbs_out(1, b"../../b"));
        assert!(climbs_out(2, b"../../../../../../tmp/x"));
        assert!(!climbs_out(2, b"./../.././x/"));
        // Climbing out and back in is still refused: the walk leaves the root.
        assert!(climbs_out(0, b"../root/x"));
    }

    #[test]
    fn shortens_long_names_for_messages() {
        assert_eq!(shown(b"a/b"), PathBuf::from("a/b"));
        assert_eq!(shown(&[b'x'; 10_000]).as_os_str().len(), SHOWN + 3);
    }
}
