//! Sandbox setup, run once by the shim as PID 1 of its new namespaces, read
//! top to bottom like a recipe (Firecracker's `jailer/src/env.rs`).
//!
//! Owns: the sandbox's mount tree, hostname, loopback, capability set and
//! no_new_privs. Does not own: cgroups (the daemon places the shim in its
//! cgroup before sending the spec) or the layer store (read-only input).
//!
//! Every mount happens in the shim's private mount namespace, after `/` is
//! made recursively private, so none of it is visible on the host and all of
//! it disappears with the namespace when the sandbox's last process exits.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{mknod, Mode, SFlag};
use strata_shim::proto::{ExtraMount, SetupSpec};
use strata_shim::sys;

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("make / recursively private")]
    PrivateRoot(#[source] Errno),
    #[error("mount root overlay")]
    Overlay(#[from] sys::MountError),
    #[error("create mount point {0}")]
    MountPoint(PathBuf, #[source] std::io::Error),
    #[error("mount {what} at {target}")]
    Mount {
        what: &'static str,
        target: PathBuf,
        #[source]
        source: Errno,
    },
    #[error("create device node {0}")]
    DeviceNode(PathBuf, #[source] Errno),
    #[error("create symlink {0}")]
    Symlink(PathBuf, #[source] std::io::Error),
    #[error("pivot_root into {0}")]
    PivotRoot(PathBuf, #[source] Errno),
    #[error("detach the old root")]
    DetachOldRoot(#[source] Errno),
    #[error("set hostname {0:?}")]
    Hostname(String, #[source] Errno),
    #[error("bring loopback up")]
    Loopback(#[source] Errno),
    #[error("restrict capabilities")]
    Capabilities(#[source] caps::errors::CapsError),
    #[error("set no_new_privs")]
    NoNewPrivs(#[source] Errno),
    #[error("mount {0}")]
    Extra(String, #[source] Errno),
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::SeccompError),
    #[error("give the sandbox its boot id at /proc/sys/kernel/random/boot_id")]
    BootId(#[source] std::io::Error),
    #[error("bind the daemon's resolver at /etc/resolv.conf")]
    ResolvConf(#[source] std::io::Error),
    #[error("/proc, /dev and /sys were staged at {staged}, but the root is to be mounted at {rootfs}")]
    StagedElsewhere { staged: PathBuf, rootfs: PathBuf },
}

/// Kernel interfaces a sandbox must not read (host memory, keys, timers
/// and scheduler internals, firmware): as Docker and runc, a file is covered
/// by /dev/null and a directory by an empty read-only tmpfs.
const MASKED_PATHS: [&str; 11] = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/sys/devices/virtual/powercap",
    "/sys/firmware",
];

/// Kernel interfaces a sandbox may read but not write (sysctls, sysrq,
/// interrupts, buses), as Docker and runc.
const READONLY_PATHS: [&str; 5] = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"];

/// Device nodes of the minimal /dev: (name, major, minor), all mode 0666.
const DEVICES: [(&str, u64, u64); 6] =
    [("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0)];

/// /proc, /dev and /sys of a sandbox, masks included, made by [`stage`]
/// before its root exists; [`run`] moves them into the root.
pub struct Staged {
    /// The root mount point they were made on (the shim's third argument).
    at: PathBuf,
    proc: OwnedFd,
    dev: OwnedFd,
    sys: OwnedFd,
}

/// Nothing we mount may propagate back to the host.
fn make_private() -> Result<(), SetupError> {
    mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
        .map_err(SetupError::PrivateRoot)
}

/// Make steps 3-5 and 6c of [`run`] (the parts that need nothing from the
/// spec) ahead of it, on a tmpfs mounted at `at`, the sandbox's root mount
/// point, in our private mount namespace: a warm shim does this before any
/// create asks for it, off the request path. The overlay, mounted over this
/// tmpfs later, hides it; the old root's detach after pivot_root takes it
/// away. Not with a user namespace: the store's directories, `at`
/// included, are closed to us there.
pub fn stage(at: &Path) -> Result<Staged, SetupError> {
    make_private()?;
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(Some("tmpfs"), at, Some("tmpfs"), flags, Some("mode=700,size=16k")).map_err(|source| SetupError::Mount {
        what: "staging tmpfs",
        target: at.into(),
        source,
    })?;
    kernel_filesystems(at, false)?;
    mask_kernel_paths(at)?;
    let open = |rel: &str| {
        let dir = at.join(rel);
        std::fs::File::open(&dir).map(OwnedFd::from).map_err(|e| SetupError::MountPoint(dir, e))
    };
    Ok(Staged { at: at.into(), proc: open("proc")?, dev: open("dev")?, sys: open("sys")? })
}

/// Build the sandbox. `loopback` is how bringing `lo` up went, and `staged`
/// what [`stage`] made, if it ran: the shim does both when it starts, before
/// the daemon connects, so that a warm shim has them done off the request
/// path (they need nothing from the spec).
pub fn run(
    spec: &SetupSpec,
    rootfs: Option<OwnedFd>,
    loopback: Result<(), Errno>,
    staged: Option<Staged>,
) -> Result<(), SetupError> {
    // 1. Nothing we mount may propagate back to the host (`stage` did this
    //    already, in this same mount namespace).
    if staged.is_none() {
        make_private()?;
    }

    // 2. The root filesystem: image layers (read-only) + private upper. In
    //    a user namespace the daemon made it (over idmapped layers, which
    //    only the host's root may create) and sent it as a mount fd. We are
    //    not host root there, so the store's 0700 dirs (and `spec.rootfs`)
    //    are closed to us: attach the tree on top of `/` (our private view;
    //    absolute paths still resolve in the host's tree underneath, for the
    //    device binds) and work relative to it as our cwd until pivot_root.
    let root: &Path = match (spec.userns, rootfs) {
        (false, _) => {
            // The daemon names the root mount point twice (the shim's third
            // argument, for `stage`, and the spec): a mismatch is a daemon
            // bug, refused rather than built around.
            if let Some(k) = staged.as_ref().filter(|k| k.at != spec.rootfs) {
                return Err(SetupError::StagedElsewhere { staged: k.at.clone(), rootfs: spec.rootfs.clone() });
            }
            match &spec.root_dir {
                // The caller's tree, bound whole (its submounts too).
                Some(dir) => {
                    let err = |source| SetupError::Mount { what: "root directory", target: dir.clone(), source };
                    let tree = sys::clone_tree(dir).map_err(err)?;
                    sys::attach_tree(tree.as_fd(), &spec.rootfs).map_err(err)?;
                }
                None => sys::mount_overlay(&sys::OverlayMount {
                    layers_dir: &spec.layers_dir,
                    lowers: &spec.lowers,
                    upper: &spec.upper,
                    work: &spec.work,
                    target: &spec.rootfs,
                })?,
            }
            spec.rootfs.as_path()
        }
        (true, Some(tree)) => {
            let err = |e| SetupError::Mount { what: "root overlay", target: "/".into(), source: e };
            sys::attach_tree(tree.as_fd(), Path::new("/")).map_err(err)?;
            nix::unistd::fchdir(tree.as_raw_fd()).map_err(err)?;
            Path::new(".")
        }
        (true, None) => {
            return Err(SetupError::Mount { what: "root overlay", target: spec.rootfs.clone(), source: Errno::EBADF })
        }
    };

    // 3-5. /proc, a minimal /dev, read-only /sys: staged, with their masks
    //      (see `stage`), or made here.
    match &staged {
        Some(k) => {
            for (rel, fd) in [("proc", &k.proc), ("dev", &k.dev), ("sys", &k.sys)] {
                let target = mount_point(root, rel)?;
                sys::attach_tree(fd.as_fd(), &target).map_err(|source| SetupError::Mount {
                    what: "staged file system",
                    target,
                    source,
                })?;
            }
        }
        None => kernel_filesystems(root, spec.userns)?,
    }

    // 5b. Host directories for cache mounts, cloned while the host's view
    //     is still ours; attached after pivot_root (step 6b).
    let mut caches = Vec::new();
    for m in &spec.mounts {
        if let ExtraMount::Cache { source, path } = m {
            let tree = sys::clone_tree(source).map_err(|e| SetupError::Extra(path.clone(), e))?;
            caches.push((path.clone(), tree));
        }
    }

    // 6. Switch root. pivot_root(".", ".") stacks the old root on top of the
    //    new one; detaching it leaves only the sandbox tree (runc does the same).
    nix::unistd::chdir(root).map_err(|e| SetupError::PivotRoot(root.into(), e))?;
    nix::unistd::pivot_root(".", ".").map_err(|e| SetupError::PivotRoot(root.into(), e))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(SetupError::DetachOldRoot)?;
    nix::unistd::chdir("/").map_err(|e| SetupError::PivotRoot(root.into(), e))?;

    // The image's working directory must exist for execs to start there.
    // Created after pivot_root, so no symlink in the image can lead outside.
    std::fs::create_dir_all(&spec.workdir).map_err(|e| SetupError::MountPoint(spec.workdir.clone().into(), e))?;

    // 6b. Scratch and cache mounts, never part of the upper. Their mount
    //     points are made inside the sandbox root, so an image symlink can
    //     only lead elsewhere in the sandbox.
    for m in &spec.mounts {
        let path = match m {
            ExtraMount::Scratch { path, .. } | ExtraMount::Cache { path, .. } => path,
        };
        std::fs::create_dir_all(path).map_err(|e| SetupError::MountPoint(path.into(), e))?;
        match m {
            ExtraMount::Scratch { size, .. } => {
                let opts = format!("size={size},mode=1777");
                mount(
                    Some("tmpfs"),
                    path.as_str(),
                    Some("tmpfs"),
                    MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                    Some(opts.as_str()),
                )
                .map_err(|e| SetupError::Extra(path.clone(), e))?;
            }
            ExtraMount::Cache { .. } => {
                let tree = caches.iter().position(|(p, _)| p == path).map(|i| caches.remove(i).1);
                if let Some(tree) = tree {
                    sys::attach_tree(std::os::fd::AsFd::as_fd(&tree), Path::new(path))
                        .map_err(|e| SetupError::Extra(path.clone(), e))?;
                }
            }
        }
    }

    // 6b'. With a network: the daemon's resolver as /etc/resolv.conf, bound
    //      over the image's (after pivot_root, so a symlink there resolves
    //      inside the sandbox).
    if let Some(text) = &spec.resolv_conf {
        bind_resolv_conf(text)?;
    }

    // 6c. Masked and read-only kernel interfaces (staged with them, or now,
    //     after pivot_root: these are the sandbox's own /proc and /sys, no
    //     image path is involved).
    if staged.is_none() {
        mask_kernel_paths(Path::new("/"))?;
    }

    // 7. Identity and network: own hostname, loopback only (up already).
    nix::unistd::sethostname(&spec.hostname).map_err(|e| SetupError::Hostname(spec.hostname.clone(), e))?;
    loopback.map_err(SetupError::Loopback)?;

    // 8. Privileges: Docker's default capability set, no_new_privs. The shim
    //    keeps only what it needs to spawn commands as other users.
    restrict_capabilities(&DEFAULT_CAPS).map_err(SetupError::Capabilities)?;
    nix::sys::prctl::set_no_new_privs().map_err(SetupError::NoNewPrivs)?;

    // 9. The seccomp filter, last: everything above needed calls it denies.
    if spec.seccomp {
        crate::seccomp::install()?;
    }
    Ok(())
}

/// Step 6b': write `text` to a file on the sandbox's own /dev tmpfs, bind
/// it over /etc/resolv.conf and unlink it again (the bind keeps it): the
/// upper never holds it, so checkpoints and diffs do not see it. An image
/// without the file gets an empty one to bind over (that one is in its
/// upper, as Docker's is); one whose file is a dangling symlink (a
/// systemd-resolved stub) keeps it, and its resolver is not configured.
fn bind_resolv_conf(text: &str) -> Result<(), SetupError> {
    let staged = Path::new("/dev/.strata-resolv.conf");
    std::fs::write(staged, text).map_err(SetupError::ResolvConf)?;
    let target = Path::new("/etc/resolv.conf");
    let bound = match std::fs::metadata(target) {
        Ok(m) if m.is_file() => Ok(true),
        Ok(_) => Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match std::fs::symlink_metadata(target) {
            // A dangling symlink: creating the file would follow it.
            Ok(_) => Ok(false),
            Err(_) => std::fs::create_dir_all("/etc")
                .and_then(|()| std::fs::OpenOptions::new().write(true).create_new(true).open(target))
                .map(|_| true),
        },
        Err(e) => Err(e),
    };
    let bound = bound.map_err(SetupError::ResolvConf)?;
    if bound {
        mount(Some(staged), target, None::<&str>, MsFlags::MS_BIND, None::<&str>)
            .map_err(|e| SetupError::ResolvConf(e.into()))?;
    } else {
        eprintln!("strata-shim: /etc/resolv.conf is not a regular file; the sandbox's resolver is not set");
    }
    std::fs::remove_file(staged).map_err(SetupError::ResolvConf)?;
    Ok(())
}

/// Steps 3-5 of [`run`] at `base`: /proc of our PID namespace, a minimal
/// /dev (device nodes made, or with `userns` bound from the host's), a
/// read-only /sys.
fn kernel_filesystems(base: &Path, userns: bool) -> Result<(), SetupError> {
    // 3. /proc of the new PID namespace (we are its PID 1).
    let nosuid_nodev_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount_fs(base, "proc", "proc", nosuid_nodev_noexec, None)?;

    // 4. A minimal /dev on tmpfs: a few character devices, devpts, shm.
    mount_fs(base, "dev", "tmpfs", MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC, Some("mode=755,size=65536k"))?;
    let dev = base.join("dev");
    let old_umask = nix::sys::stat::umask(Mode::empty());
    for (name, major, minor) in DEVICES {
        let p = dev.join(name);
        if userns {
            // mknod needs CAP_MKNOD in the host's namespace: bind the
            // host's node instead (as rootless runtimes do).
            std::fs::File::create(&p).map_err(|e| SetupError::MountPoint(p.clone(), e))?;
            let host = Path::new("/dev").join(name);
            mount(Some(&host), &p, None::<&str>, MsFlags::MS_BIND, None::<&str>)
                .map_err(|e| SetupError::DeviceNode(p.clone(), e))?;
        } else {
            mknod(&p, SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), nix::sys::stat::makedev(major, minor))
                .map_err(|e| SetupError::DeviceNode(p.clone(), e))?;
        }
    }
    nix::sys::stat::umask(old_umask);
    mount_fs(
        base,
        "dev/pts",
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )?;
    mount_fs(base, "dev/shm", "tmpfs", nosuid_nodev_noexec, Some("mode=1777,size=65536k"))?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let p = dev.join(link);
        symlink(target, &p).map_err(|e| SetupError::Symlink(p.clone(), e))?;
    }

    // 5. /sys, read-only (allowed because we own a fresh network namespace).
    mount_fs(base, "sys", "sysfs", nosuid_nodev_noexec | MsFlags::MS_RDONLY, None)?;
    Ok(())
}

/// Cover [`MASKED_PATHS`], make [`READONLY_PATHS`] read-only and give the
/// sandbox its own boot id ([`bind_boot_id`]), below
/// `base` (the paths are the sandbox's, `base` where its /proc, /dev and
/// /sys are now); a path this kernel does not have is skipped.
fn mask_kernel_paths(base: &Path) -> Result<(), SetupError> {
    let err = |p: &'static str| move |e| SetupError::Extra(p.to_string(), e);
    let at = |p: &str| base.join(p.trim_start_matches('/'));
    let null = at("/dev/null");
    let nosuid_nodev_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    for p in MASKED_PATHS {
        let path = at(p);
        let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
        if meta.is_dir() {
            let flags = nosuid_nodev_noexec | MsFlags::MS_RDONLY;
            mount(Some("tmpfs"), &path, Some("tmpfs"), flags, Some("size=0,mode=0555")).map_err(err(p))?;
        } else {
            mount(Some(&null), &path, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(err(p))?;
        }
    }
    for p in READONLY_PATHS {
        let path = at(p);
        if std::fs::symlink_metadata(&path).is_err() {
            continue;
        }
        mount(Some(&path), &path, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>).map_err(err(p))?;
        let ro = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | nosuid_nodev_noexec;
        mount(None::<&str>, &path, None::<&str>, ro, None::<&str>).map_err(err(p))?;
    }
    bind_boot_id(base)
}

/// The kernel's boot id as the sandbox reads it.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// A random (version 4) UUID, as the kernel writes a boot id.
fn new_boot_id() -> std::io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!("{}-{}-{}-{}-{}\n", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..]))
}

/// Give the sandbox a boot id of its own, new with each shim: each start,
/// resume, fork or rollback is a boot to the programs inside (E2B's
/// clients tell a filesystem-only resume by a new one), and the host's id
/// is not disclosed. Written to the sandbox's /dev tmpfs, bound read-only
/// over [`BOOT_ID`], and unlinked (the bind keeps it), as resolv.conf is.
fn bind_boot_id(base: &Path) -> Result<(), SetupError> {
    let err = SetupError::BootId;
    let target = base.join(BOOT_ID.trim_start_matches('/'));
    if std::fs::symlink_metadata(&target).is_err() {
        return Ok(());
    }
    let staged = base.join("dev/.strata-boot_id");
    std::fs::write(&staged, new_boot_id().map_err(err)?).map_err(err)?;
    let perr = |e: Errno| SetupError::BootId(e.into());
    mount(Some(&staged), &target, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(perr)?;
    let ro = MsFlags::MS_BIND
        | MsFlags::MS_REMOUNT
        | MsFlags::MS_RDONLY
        | MsFlags::MS_NOSUID
        | MsFlags::MS_NODEV
        | MsFlags::MS_NOEXEC;
    mount(None::<&str>, &target, None::<&str>, ro, None::<&str>).map_err(perr)?;
    std::fs::remove_file(&staged).map_err(err)?;
    Ok(())
}

/// The directory `root/rel`, created if the image lacks it, to mount on.
fn mount_point(root: &Path, rel: &str) -> Result<PathBuf, SetupError> {
    let target = root.join(rel);
    std::fs::create_dir_all(&target).map_err(|e| SetupError::MountPoint(target.clone(), e))?;
    // An image may ship /proc or /sys as a symlink; mounting through it would
    // land outside the sandbox root (runc CVE-2019-19921 class). Refuse.
    match std::fs::symlink_metadata(&target) {
        Ok(m) if m.is_dir() => Ok(target),
        Ok(_) => {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a directory (symlink?)");
            Err(SetupError::MountPoint(target, e))
        }
        Err(e) => Err(SetupError::MountPoint(target, e)),
    }
}

/// Mount a pseudo filesystem at `root/rel` ([`mount_point`]).
fn mount_fs(
    root: &Path,
    rel: &str,
    fstype: &'static str,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), SetupError> {
    let target = mount_point(root, rel)?;
    mount(Some(fstype), &target, Some(fstype), flags, data).map_err(|source| SetupError::Mount {
        what: fstype,
        target,
        source,
    })
}

/// Capabilities a sandbox keeps: Docker's default set without CAP_MKNOD.
/// Docker relies on the devices cgroup to make created nodes useless; until
/// Strata has one (v1 devices / v2 eBPF filter), a sandbox may not create
/// device nodes at all: with CAP_MKNOD, `mknod /dev/x b 8 0` in the sandbox's
/// /dev tmpfs would open the host's disk.
const DEFAULT_CAPS: [caps::Capability; 13] = {
    use caps::Capability::*;
    [
        CAP_CHOWN,
        CAP_DAC_OVERRIDE,
        CAP_FOWNER,
        CAP_FSETID,
        CAP_KILL,
        CAP_SETGID,
        CAP_SETUID,
        CAP_SETPCAP,
        CAP_NET_BIND_SERVICE,
        CAP_NET_RAW,
        CAP_SYS_CHROOT,
        CAP_AUDIT_WRITE,
        CAP_SETFCAP,
    ]
};

/// Restrict this process (and so everything it execs) to `keep`: drop every
/// other capability the kernel knows from the bounding set, then set
/// effective (first: it must stay within permitted), permitted and
/// inheritable to `keep`. Ambient stays empty.
fn restrict_capabilities(keep: &[caps::Capability]) -> Result<(), caps::errors::CapsError> {
    use caps::CapSet;
    let keep: caps::CapsHashSet = keep.iter().copied().collect();
    for cap in caps::runtime::thread_all_supported() {
        if !keep.contains(&cap) {
            caps::drop(None, CapSet::Bounding, cap)?;
        }
    }
    for set in [CapSet::Effective, CapSet::Permitted, CapSet::Inheritable] {
        caps::set(None, set, &keep)?;
    }
    Ok(())
}
