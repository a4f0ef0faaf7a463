//! The shim binary a sandbox runs as PID 1 cannot be changed from inside
//! (`/proc/self/exe`, a preloaded library), and an upgraded shim leaves
//! the running sandboxes alone.

use super::*;

/// Mode, owner and extended attributes of a file, to compare before and after.
fn file_identity(path: &std::path::Path) -> String {
    use std::os::unix::fs::MetadataExt;
    use strata_shim::sys;
    let m = std::fs::symlink_metadata(path).unwrap();
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let xattrs: Vec<String> = sys::llistxattr(&c)
        .unwrap()
        .iter()
        .map(|name| {
            let n = std::ffi::CString::new(name.clone()).unwrap();
            format!("{}={:?}", String::from_utf8_lossy(name), sys::lgetxattr(&c, &n))
        })
        .collect();
    format!("mode {:o} owner {}:{} size {} xattrs {xattrs:?}", m.mode(), m.uid(), m.gid(), m.size())
}

/// A library that, preloaded into a program whose executable is not on the
/// sandbox's root file system (that is: the shim run inside), tries to
/// change that executable through /proc/self/exe and logs each result.
const PRELOAD_ATTACK: &str = r#"
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>
__attribute__((constructor)) static void attack(void) {
    struct stat exe, root;
    int fd = open("/proc/self/exe", O_RDONLY);
    if (fd < 0 || fstat(fd, &exe) != 0 || stat("/", &root) != 0 || exe.st_dev == root.st_dev) return;
    unsigned char cap[20] = {0x00, 0x00, 0x00, 0x02, 0xff, 0xff, 0xff, 0xff};
    int chmod_r = fchmod(fd, 04755);
    int chown_r = fchown(fd, 65534, 65534);
    int cap_r = fsetxattr(fd, "security.capability", cap, sizeof cap, 0);
    int user_r = fsetxattr(fd, "user.strata-attack", "x", 1, 0);
    int w = open("/proc/self/exe", O_WRONLY);
    int trunc_r = w >= 0 ? ftruncate(w, 0) : -1;
    FILE *log = fopen("/tmp/attack.log", "a");
    if (log) {
        fprintf(log, "chmod=%d chown=%d cap=%d user=%d open_w=%d trunc=%d\n", chmod_r, chown_r, cap_r, user_r, w >= 0, trunc_r);
        fclose(log);
    }
}
"#;

/// Whether an ELF executable names a dynamic loader (a PT_INTERP header).
fn dynamically_linked(path: &Path) -> bool {
    let b = std::fs::read(path).unwrap();
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap()) as usize;
    assert_eq!(&b[..5], b"\x7fELF\x02", "{} is no 64-bit ELF file", path.display());
    let (phoff, phentsize, phnum) = (u64_at(0x20), u16_at(0x36), u16_at(0x38));
    (0..phnum).any(|i| u32::from_le_bytes(b[phoff + i * phentsize..][..4].try_into().unwrap()) == 3)
}

/// A glibc build of strata-shim (what scripts/build-shim.sh falls back
/// to without the musl target), in a target directory of its own.
fn glibc_shim() -> PathBuf {
    let target = bin_dir().parent().unwrap().join("glibc-shim");
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let st = std::process::Command::new(option_env!("CARGO").unwrap_or("cargo"))
        .current_dir(workspace)
        .args(["build", "-p", "strata-shim", "--features", "binary", "--target-dir"])
        .arg(&target)
        .status()
        .unwrap();
    assert!(st.success(), "cargo build of the glibc shim failed");
    let shim = target.join("debug/strata-shim");
    assert!(dynamically_linked(&shim), "{} is not a glibc build", shim.display());
    shim
}

#[test]
fn a_sandbox_cannot_change_the_shim_binary_through_proc_self_exe() {
    let work = tempfile::Builder::new().prefix("strata-test-exe-").tempdir().unwrap();
    let lib = compile_c(work.path(), "attack.so", PRELOAD_ATTACK, &["-shared", "-fPIC", "-O1"]);
    // The installed shim (static when scripts/build-shim.sh had the musl
    // target: no dynamic loader, so no preload ever runs in it), then a
    // glibc build, where the preloaded code runs as the shim's binary and
    // only the read-only overlay stops it.
    let installed = bin_dir().join("strata-shim");
    let mut shims = vec![(installed.clone(), dynamically_linked(&installed))];
    if !shims[0].1 {
        shims.push((glibc_shim(), true));
    }
    for (shim, loader) in shims {
        let env = TestEnv::start_with(&["--shim", shim.to_str().unwrap()]);
        shim_survives_its_sandboxes(&env, &shim, &lib, loader);
        env.finish();
    }
}

/// Arm the preload attack (attack.so) in a sandbox and run both
/// triggers; with a `loader` it must run in the shim's binary twice and
/// fail at every change, without one it cannot run. Either way the shim
/// file and the daemon's copy stay as they were.
fn shim_survives_its_sandboxes(env: &TestEnv, installed: &Path, lib: &Path, loader: bool) {
    env.import_image("debian-git");
    let copies: Vec<std::path::PathBuf> =
        std::fs::read_dir(env.root.join("shim")).unwrap().map(|e| e.unwrap().path().join("bin/strata-shim")).collect();
    assert_eq!(copies.len(), 1, "{copies:?}");
    let watched: Vec<std::path::PathBuf> = std::iter::once(installed.to_path_buf()).chain(copies).collect();
    let before: Vec<String> = watched.iter().map(|p| file_identity(p)).collect();

    for userns in [false, true] {
        let id = create(env, json!({"image": "debian-git", "userns": userns}));
        let (ok, err) = cp(env, lib.to_str().unwrap(), &format!("{id}:/usr/local/lib/attack.so"));
        assert!(ok, "{err}");
        let v = sh(
            env,
            &id,
            "set -e; echo /usr/local/lib/attack.so > /etc/ld.so.preload; \
             printf '#!/proc/self/exe\\n' > /usr/local/bin/selfexe; chmod 755 /usr/local/bin/selfexe; \
             ln -sf /proc/self/exe /usr/local/bin/sh; echo armed",
        );
        assert_eq!(stdout(&v), "armed\n", "{v}");
        // Both triggers: a command resolving to /proc/self/exe through PATH
        // (`sh` is now /usr/local/bin/sh), and an interpreter line naming it.
        for argv in [json!(["sh", "-c", "echo hello"]), json!(["/usr/local/bin/selfexe"])] {
            let v = exec(env, &id, json!({ "argv": argv }));
            assert_ne!(v["exit_code"], 0, "the shim was run as {argv}: {v}");
        }
        let v = exec(env, &id, json!({"argv": ["/bin/cat", "/tmp/attack.log"]}));
        let log = stdout(&v);
        if loader {
            // The attack ran, twice, inside the shim's binary, and every change failed.
            assert_eq!(log.lines().count(), 2, "the preloaded attack did not run as expected (userns {userns}): {v}");
            for line in log.lines() {
                assert_eq!(line, "chmod=-1 chown=-1 cap=-1 user=-1 open_w=0 trunc=-1", "userns {userns}: {log}");
            }
        } else {
            assert_eq!(log, "", "a preload ran in the static shim (userns {userns}): {v}");
        }
    }
    let after: Vec<String> = watched.iter().map(|p| file_identity(p)).collect();
    assert_eq!(before, after, "the shim binary changed: {watched:?}");
    // Later sandboxes still start.
    let id = create(env, json!({"image": "debian-git"}));
    assert_eq!(stdout(&sh(env, &id, "echo fine")), "fine\n");
}
