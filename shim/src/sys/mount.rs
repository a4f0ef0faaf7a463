//! The new mount API: overlay mounts (and the legacy option string),
//! detached trees, idmapped mounts, and loop devices for disk caps.

use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;

/// Overlay options every sandbox uses (docs/design.md: the upper must always hold
/// full file data and plain whiteouts, so a captured delta misses nothing).
pub const OVERLAY_FLAGS: [(&str, &str); 4] =
    [("index", "off"), ("metacopy", "off"), ("redirect_dir", "off"), ("xino", "off")];

/// `volatile` (Linux >= 5.10): the overlay skips every sync of its upper:
/// fsync and syncfs inside the sandbox, and, when the sandbox ends and the
/// overlay is unmounted, the syncfs of the upper's whole file system
/// (with a journal, a commit per sandbox). Nothing is lost that was kept:
/// a running sandbox's upper does not outlive a host crash (a restart
/// reaps a sandbox whose shim is gone), and what the daemon keeps of an
/// upper it makes durable itself before a row names it (a checkpoint's
/// layer and blob, a suspended upper). Its marker, `work/work/incompat/
/// volatile`, would refuse a second mount of the same upper and work dir;
/// none is made (a sandbox that starts again gets new ones). Kernels
/// without it (5.9) mount without it.
pub const OVERLAY_VOLATILE: &str = "volatile";

/// An overlay mount to make: lowers topmost first, relative to `layers_dir`.
pub struct OverlayMount<'a> {
    pub layers_dir: &'a Path,
    pub lowers: &'a [PathBuf],
    pub upper: &'a Path,
    pub work: &'a Path,
    pub target: &'a Path,
}

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("fsopen {0}")]
    FsOpen(&'static str, #[source] Errno),
    #[error("fsconfig {key}={value}: {detail}")]
    FsConfig {
        key: String,
        value: String,
        detail: String,
        #[source]
        source: Errno,
    },
    #[error("create {fstype} superblock: {detail}")]
    Create {
        fstype: &'static str,
        detail: String,
        #[source]
        source: Errno,
    },
    #[error("fsmount {0}")]
    FsMount(&'static str, #[source] Errno),
    #[error("move overlay mount to {0}")]
    Move(PathBuf, #[source] Errno),
    #[error("overlay option string is {len} bytes for {lowers} lowers; this kernel lacks lowerdir+ (needs >= 6.8) and the legacy limit is one page")]
    OptionsTooLong { len: usize, lowers: usize },
    #[error("mount overlay at {0} (legacy options)")]
    Legacy(PathBuf, #[source] Errno),
    #[error("path {0:?} contains a NUL byte or a character overlay cannot take (',' or ':')")]
    BadPath(PathBuf),
}

pub(super) fn cstr(p: &Path) -> Result<CString, MountError> {
    CString::new(p.as_os_str().as_encoded_bytes()).map_err(|_| MountError::BadPath(p.into()))
}

/// Read the kernel's error messages queued on an fs context fd (`fsopen(2)`).
pub(super) fn fs_context_log(fd: &OwnedFd) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        match nix::unistd::read(fd.as_raw_fd(), &mut buf) {
            Ok(n) if n > 0 => {
                if !out.is_empty() {
                    out.extend_from_slice(b"; ");
                }
                out.extend_from_slice(&buf[..n]);
            }
            _ => break,
        }
    }
    String::from_utf8_lossy(&out).trim().to_string()
}

pub(super) const FSOPEN_CLOEXEC: libc::c_uint = 1;

pub(super) const FSCONFIG_SET_FLAG: libc::c_uint = 0;

pub(super) const FSCONFIG_SET_STRING: libc::c_uint = 1;

pub(super) const FSCONFIG_CMD_CREATE: libc::c_uint = 6;

pub(super) const FSMOUNT_CLOEXEC: libc::c_uint = 1;

pub(super) const MOUNT_ATTR_RDONLY: libc::c_uint = 0x1;

pub(super) const MOUNT_ATTR_NOSUID: libc::c_uint = 0x2;

pub(super) const MOUNT_ATTR_NODEV: libc::c_uint = 0x4;

pub(super) const MOUNT_ATTR_NOEXEC: libc::c_uint = 0x8;

/// A file system context (`fsopen(2)`) being configured.
pub(super) struct FsContext {
    fd: OwnedFd,
    fstype: &'static str,
}

impl FsContext {
    fn open(fstype: &'static CStr) -> Result<FsContext, MountError> {
        let name = fstype.to_str().unwrap_or("?");
        // SAFETY: fstype is a valid NUL-terminated string.
        let fd = unsafe { libc::syscall(libc::SYS_fsopen, fstype.as_ptr(), FSOPEN_CLOEXEC) };
        if fd < 0 {
            return Err(MountError::FsOpen(name, Errno::last()));
        }
        // SAFETY: fsopen returned a new descriptor that we alone own.
        Ok(FsContext { fd: unsafe { OwnedFd::from_raw_fd(fd as RawFd) }, fstype: name })
    }

    fn set(&self, key: &str, value: &CStr) -> Result<(), MountError> {
        self.config(FSCONFIG_SET_STRING, key, Some(value))
    }

    /// Set a flag parameter (one without a value, e.g. `volatile`).
    fn flag(&self, key: &str) -> Result<(), MountError> {
        self.config(FSCONFIG_SET_FLAG, key, None)
    }

    fn config(&self, cmd: libc::c_uint, key: &str, value: Option<&CStr>) -> Result<(), MountError> {
        let k = CString::new(key).map_err(|_| MountError::BadPath(key.into()))?;
        let v = value.map_or(std::ptr::null(), CStr::as_ptr);
        // SAFETY: the key is NUL-terminated, the value NUL-terminated or
        // null (a flag), and both outlive the call.
        let r = unsafe { libc::syscall(libc::SYS_fsconfig, self.fd.as_raw_fd(), cmd, k.as_ptr(), v, 0) };
        if r < 0 {
            let source = Errno::last();
            return Err(MountError::FsConfig {
                key: key.into(),
                value: value.map(|v| v.to_string_lossy().into_owned()).unwrap_or_default(),
                detail: fs_context_log(&self.fd),
                source,
            });
        }
        Ok(())
    }

    /// Create the superblock and a detached mount of it with `attrs`.
    fn mount(self, attrs: libc::c_uint) -> Result<OwnedFd, MountError> {
        // SAFETY: plain syscall on our fs context fd; null key/value as documented.
        let r = unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                self.fd.as_raw_fd(),
                FSCONFIG_CMD_CREATE,
                std::ptr::null::<libc::c_char>(),
                std::ptr::null::<libc::c_void>(),
                0,
            )
        };
        if r < 0 {
            let source = Errno::last();
            return Err(MountError::Create { fstype: self.fstype, detail: fs_context_log(&self.fd), source });
        }
        // SAFETY: plain syscall on our fs context fd.
        let mfd = unsafe { libc::syscall(libc::SYS_fsmount, self.fd.as_raw_fd(), FSMOUNT_CLOEXEC, attrs) };
        if mfd < 0 {
            return Err(MountError::FsMount(self.fstype, Errno::last()));
        }
        // SAFETY: fsmount returned a new descriptor that we alone own.
        Ok(unsafe { OwnedFd::from_raw_fd(mfd as RawFd) })
    }
}

/// Mount an overlay. Uses the new mount API with `lowerdir+` (one fsconfig
/// call per lower, no length limit; kernel >= 6.8) and falls back to the
/// legacy option string with lowers relative to `layers_dir` on older kernels.
pub fn mount_overlay(m: &OverlayMount<'_>) -> Result<(), MountError> {
    let ctx = FsContext::open(c"overlay")?;
    // Before 6.5 overlayfs had no fs_context parameters of its own: the
    // kernel's legacy wrapper accepts any key (even `lowerdir+`) and only
    // FSCONFIG_CMD_CREATE fails. A key no kernel knows tells the two apart:
    // if it is accepted, use the legacy option string. (Found by the 6.1 VM lane.)
    if ctx.set("strata-probe-unknown-key", c"x").is_ok() {
        return mount_overlay_legacy(m);
    }
    let mut lowers = m.lowers.iter();
    if let Some(first) = lowers.next() {
        match ctx.set("lowerdir+", &cstr(&m.layers_dir.join(first))?) {
            Ok(()) => {}
            Err(MountError::FsConfig { source: Errno::EINVAL, .. }) => {
                return mount_overlay_legacy(m);
            }
            Err(e) => return Err(e),
        }
    }
    for l in lowers {
        ctx.set("lowerdir+", &cstr(&m.layers_dir.join(l))?)?;
    }
    ctx.set("upperdir", &cstr(m.upper)?)?;
    ctx.set("workdir", &cstr(m.work)?)?;
    for (k, v) in OVERLAY_FLAGS {
        ctx.set(k, &CString::new(v).map_err(|_| MountError::BadPath(v.into()))?)?;
    }
    // Overlay's own parameters (this path) came in 6.5, after volatile.
    ctx.flag(OVERLAY_VOLATILE)?;
    // nodev: a device node in the image or the upper is never usable.
    let mfd = ctx.mount(MOUNT_ATTR_NODEV)?;
    attach_tree(mfd.as_fd(), m.target).map_err(|e| MountError::Move(m.target.into(), e))
}

/// A detached, read-only overlay of `lowers` (topmost first; overlayfs wants
/// two when there is no upper) as a mount fd that no mount table lists.
/// With no upper layer overlayfs itself refuses every write, chmod, chown
/// and xattr change (EROFS) whatever the mount's flags, and a file opened
/// through it is the overlay's file: nothing reached through it leads to
/// the files underneath. Used to run the shim (`ShimExe` in the daemon).
/// Works on the legacy fs_context of kernels before 6.5 too: `lowerdir` is
/// one colon-separated value either way.
pub fn readonly_overlay(lowers: &[&Path]) -> Result<OwnedFd, MountError> {
    let mut list = Vec::new();
    for l in lowers {
        let b = l.as_os_str().as_encoded_bytes();
        if b.contains(&b':') || b.contains(&b',') {
            return Err(MountError::BadPath(l.to_path_buf()));
        }
        if !list.is_empty() {
            list.push(b':');
        }
        list.extend_from_slice(b);
    }
    let ctx = FsContext::open(c"overlay")?;
    let list = CString::new(list).map_err(|e| {
        use std::os::unix::ffi::OsStringExt;
        MountError::BadPath(std::ffi::OsString::from_vec(e.into_vec()).into())
    })?;
    ctx.set("lowerdir", &list)?;
    ctx.mount(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
}

/// What `mount(2)` takes as its data: one page.
pub(super) const LEGACY_OPTIONS_MAX: usize = 4096;

/// The legacy `mount(2)` option string, with lowers relative to the layers
/// directory (the caller's cwd at mount time) to stay under one page.
pub fn legacy_overlay_options(m: &OverlayMount<'_>) -> Result<String, MountError> {
    let check = |p: &Path| -> Result<String, MountError> {
        let s = p.to_str().ok_or_else(|| MountError::BadPath(p.into()))?;
        if s.contains([',', ':', '\0']) {
            return Err(MountError::BadPath(p.into()));
        }
        Ok(s.to_string())
    };
    let lowers: Vec<String> = m.lowers.iter().map(|l| check(l)).collect::<Result<_, _>>()?;
    let mut opts = format!("lowerdir={},upperdir={},workdir={}", lowers.join(":"), check(m.upper)?, check(m.work)?);
    for (k, v) in OVERLAY_FLAGS {
        opts.push_str(&format!(",{k}={v}"));
    }
    if opts.len() >= LEGACY_OPTIONS_MAX {
        return Err(MountError::OptionsTooLong { len: opts.len(), lowers: lowers.len() });
    }
    Ok(opts)
}

pub(super) fn mount_overlay_legacy(m: &OverlayMount<'_>) -> Result<(), MountError> {
    use nix::mount::{mount, MsFlags};
    let opts = legacy_overlay_options(m)?;
    let volatile = format!("{opts},{OVERLAY_VOLATILE}");
    let old = std::env::current_dir()
        .map_err(|e| MountError::Legacy(m.target.into(), Errno::from_raw(e.raw_os_error().unwrap_or(0))))?;
    nix::unistd::chdir(m.layers_dir).map_err(|e| MountError::Legacy(m.layers_dir.into(), e))?;
    let overlay = |o: &str| mount(Some("overlay"), m.target, Some("overlay"), MsFlags::MS_NODEV, Some(o));
    // A kernel before 5.10 refuses `volatile` (EINVAL): mount without it.
    // Past one page with it, the string without it is still tried.
    let r = if volatile.len() < LEGACY_OPTIONS_MAX {
        overlay(&volatile).or_else(|e| if e == Errno::EINVAL { overlay(&opts) } else { Err(e) })
    } else {
        overlay(&opts)
    };
    let _ = nix::unistd::chdir(&old);
    r.map_err(|e| MountError::Legacy(m.target.into(), e))
}

/// A sysfs of the calling thread's network namespace, mounted nowhere
/// (`fsmount(2)` without `move_mount`): its files are reached by `openat`
/// on the returned descriptor, and no mount namespace sees it. sysfs shows
/// the network devices of the namespace that made it, so this is how a
/// process whose /sys was mounted elsewhere (one started by `nsenter
/// --net`) reaches its own devices' attributes.
pub fn detached_sysfs() -> Result<OwnedFd, MountError> {
    FsContext::open(c"sysfs")?.mount(MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC)
}

/// A detached copy of the mount at `path` (`open_tree(OPEN_TREE_CLONE)`):
/// taken before pivot_root, attached after it with [`attach_tree`], so the
/// host path is resolved in the host's view and the target in the sandbox's.
pub fn clone_tree(path: &Path) -> Result<OwnedFd, Errno> {
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| Errno::EINVAL)?;
    // SAFETY: `c` is NUL-terminated and outlives the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: open_tree returned a new descriptor that we alone own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `struct mount_attr` from `<linux/mount.h>` (`mount_setattr(2)`).
#[repr(C)]
pub(super) struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// A detached copy of the mount at `path` whose ownership is seen through
/// the user namespace `userns` (an idmapped mount, Linux 5.12; overlayfs
/// takes them as layers from 5.19): a file owned by `n` on disk appears
/// owned by whatever `n` maps to in `userns`, and a file created through it
/// by that id is stored as `n`. Fails with EINVAL where the file system
/// does not support idmapped mounts.
pub fn idmapped_tree(path: &Path, userns: BorrowedFd<'_>) -> Result<OwnedFd, Errno> {
    const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
    let tree = clone_tree(path)?;
    let attr =
        MountAttr { attr_set: MOUNT_ATTR_IDMAP, attr_clr: 0, propagation: 0, userns_fd: userns.as_raw_fd() as u64 };
    // SAFETY: `attr` is a valid mount_attr of the size passed; the empty path
    // with AT_EMPTY_PATH names the detached tree we own.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    Errno::result(r).map(|_| tree)
}

/// Attach a tree from [`clone_tree`] at `target`.
pub fn attach_tree(tree: BorrowedFd<'_>, target: &Path) -> Result<(), Errno> {
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;
    let t = CString::new(target.as_os_str().as_encoded_bytes()).map_err(|_| Errno::EINVAL)?;
    // SAFETY: strings are NUL-terminated; `tree` is a detached mount we own.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    Errno::result(r).map(drop)
}

/// `struct loop_info64` from `<linux/loop.h>`.
#[repr(C)]
pub(super) struct LoopInfo64 {
    device: u64,
    inode: u64,
    rdevice: u64,
    offset: u64,
    sizelimit: u64,
    number: u32,
    encrypt_type: u32,
    encrypt_key_size: u32,
    flags: u32,
    file_name: [u8; 64],
    crypt_name: [u8; 64],
    encrypt_key: [u8; 32],
    init: [u64; 2],
}

/// `struct loop_config` from `<linux/loop.h>` (LOOP_CONFIGURE, Linux 5.8).
#[repr(C)]
pub(super) struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

pub(super) const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;

pub(super) const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;

pub(super) const LO_FLAGS_AUTOCLEAR: u32 = 4;

/// Bind `backing` (an open regular file) to a free loop device with
/// `LO_FLAGS_AUTOCLEAR`: the device detaches itself when its last user
/// (the returned fd, then the filesystem mounted from it) lets go, so a
/// crash cannot leak it. Returns the device's path and an open fd on it.
pub fn attach_loop(backing: BorrowedFd<'_>) -> Result<(PathBuf, OwnedFd), Errno> {
    let ctl = nix::fcntl::open(
        "/dev/loop-control",
        nix::fcntl::OFlag::O_RDWR | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )?;
    // SAFETY: open returned a new descriptor that we alone own.
    let ctl = unsafe { OwnedFd::from_raw_fd(ctl) };
    // Another process may take the device between GET_FREE and CONFIGURE
    // (EBUSY): ask again.
    for _ in 0..32 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a number.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
        let n = Errno::result(n)?;
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = nix::fcntl::open(
            &path,
            nix::fcntl::OFlag::O_RDWR | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )?;
        // SAFETY: open returned a new descriptor that we alone own.
        let dev = unsafe { OwnedFd::from_raw_fd(dev) };
        let cfg = LoopConfig {
            fd: backing.as_raw_fd() as u32,
            block_size: 0,
            info: LoopInfo64 {
                device: 0,
                inode: 0,
                rdevice: 0,
                offset: 0,
                sizelimit: 0,
                number: 0,
                encrypt_type: 0,
                encrypt_key_size: 0,
                flags: LO_FLAGS_AUTOCLEAR,
                file_name: [0; 64],
                crypt_name: [0; 64],
                encrypt_key: [0; 32],
                init: [0; 2],
            },
            reserved: [0; 8],
        };
        // SAFETY: `cfg` is a valid `struct loop_config` that outlives the call;
        // the kernel only reads it.
        let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE as _, &cfg as *const LoopConfig) };
        match Errno::result(r) {
            Ok(_) => return Ok((path, dev)),
            Err(Errno::EBUSY) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Errno::EBUSY)
}
