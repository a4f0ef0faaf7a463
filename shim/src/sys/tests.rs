//! Unit tests of `sys`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;

/// Opens for writing that race with the lease (the kernel then signals
/// the holder) do not end this process, which blocks no signal.
#[test]
fn a_racing_open_for_writing_is_harmless() {
    use std::os::fd::AsFd;
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::atomic::{AtomicBool, Ordering};
    // Removed even if an assertion below fails.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f");
    std::fs::write(&path, b"x").unwrap();
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let writer = {
        let (path, stop) = (path.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut opened = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let f = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&path);
                opened += u64::from(f.is_ok());
            }
            opened
        })
    };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let mut free = 0u64;
    while std::time::Instant::now() < until {
        let f = std::fs::File::open(&path).unwrap();
        free += u64::from(no_writers(f.as_fd()).is_ok());
    }
    stop.store(true, Ordering::Relaxed);
    let opened = writer.join().unwrap();
    assert!(free > 0 && opened > 0, "{free} leases, {opened} opens");
}

/// A child started with a cgroup v2 directory is in that cgroup from
/// its first instruction (here, still there as it sleeps), and one
/// started without is in ours.
#[test]
fn a_shared_memory_child_is_born_in_the_cgroup_given() {
    if !nix::unistd::geteuid().is_root() {
        return eprintln!("skipped: needs root");
    }
    // A cgroup2 mount: the whole tree (v2) or the hybrid one's.
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let Some(mnt) = mountinfo.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        right.starts_with("cgroup2 ").then(|| left.split(' ').nth(4).map(PathBuf::from)).flatten()
    }) else {
        return eprintln!("skipped: no cgroup2 mount");
    };
    assert!(can_clone_into_cgroup(), "clone3 with CLONE_INTO_CGROUP (x86_64, Linux 5.7)");
    let name = format!("strata-unit-{}", std::process::id());
    // Removed however the test ends.
    struct Dir(PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let dir = Dir(mnt.join(&name));
    std::fs::create_dir(&dir.0).unwrap();
    let cgroup_of = |pid: i32| -> String {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        text.lines().find_map(|l| l.strip_prefix("0::")).unwrap_or_default().to_string()
    };
    let args = ExecArgs::new(vec![c"sleep".into(), c"5".into()], vec![]);
    let start = |cgroup: Option<RawFd>| -> i32 {
        let mut stack = vec![0u8; 64 * 1024];
        let mut child = || -> i32 {
            args.execve(c"/bin/sleep");
            127
        };
        let (pid, killed) = clone_shared(&mut stack, &mut child, 0, None, cgroup, Duration::from_secs(5)).unwrap();
        assert!(!killed);
        pid
    };
    let d = std::fs::File::open(&dir.0).unwrap();
    let (inside, outside) = (start(Some(d.as_raw_fd())), start(None));
    let seen = (cgroup_of(inside), cgroup_of(outside));
    for pid in [inside, outside] {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
    }
    // The cgroup's path as this cgroup namespace shows it: `/NAME`
    // below the mount's root, which may itself be a subtree.
    assert!(seen.0.ends_with(&format!("/{name}")), "{seen:?}");
    assert_eq!(seen.1, cgroup_of(std::process::id() as i32));
}

#[test]
fn loop_structs_match_the_kernel_abi() {
    assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
    assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    assert_eq!(std::mem::size_of::<MountAttr>(), 32);
}

#[test]
fn legacy_options_are_relative_and_complete() {
    let lowers = vec![PathBuf::from("b/fs"), PathBuf::from("a/fs")];
    let m = OverlayMount {
        layers_dir: Path::new("/var/lib/strata/layers"),
        lowers: &lowers,
        upper: Path::new("/u"),
        work: Path::new("/w"),
        target: Path::new("/t"),
    };
    assert_eq!(
        legacy_overlay_options(&m).unwrap(),
        "lowerdir=b/fs:a/fs,upperdir=/u,workdir=/w,index=off,metacopy=off,redirect_dir=off,xino=off"
    );
}

#[test]
fn legacy_options_refuse_past_one_page() {
    let lowers: Vec<PathBuf> = (0..80).map(|i| PathBuf::from(format!("{:064x}/fs", i))).collect();
    let m = OverlayMount {
        layers_dir: Path::new("/l"),
        lowers: &lowers,
        upper: Path::new("/u"),
        work: Path::new("/w"),
        target: Path::new("/t"),
    };
    assert!(matches!(legacy_overlay_options(&m), Err(MountError::OptionsTooLong { lowers: 80, .. })));
}

#[test]
fn legacy_options_refuse_separators() {
    let lowers = vec![PathBuf::from("a:b")];
    let m = OverlayMount {
        layers_dir: Path::new("/l"),
        lowers: &lowers,
        upper: Path::new("/u"),
        work: Path::new("/w"),
        target: Path::new("/t"),
    };
    assert!(matches!(legacy_overlay_options(&m), Err(MountError::BadPath(_))));
}
