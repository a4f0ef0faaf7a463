//! Runtime core, end to end on the real kernel (root only): image import,
//! sandboxes with overlay + namespaces + cgroups, exec, removal, restart,
//! the API's error cases and hostile layers.

use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};
use strata_tests::*;

mod crashes;
mod distribution;
mod images;
mod isolation;
mod lifecycle;
mod lineages;
mod sandboxes;
mod snapshots;

/// A repository at /src/app cloned from a bare "remote" at /remote.git,
/// with `main` pushed and checked out, and an ignored build cache.
const CLEAN_REPO: &str = "set -e; export HOME=/root; git config --global user.email t@example.com; \
    git config --global user.name t; git config --global init.defaultBranch main; \
    git init -q --bare /remote.git; git init -q /src/app; cd /src/app; \
    echo build/ > .gitignore; echo v1 > a; git add -A; git commit -qm one; \
    git remote add origin /remote.git; git push -q origin main; git fetch -q origin; \
    git branch -q --set-upstream-to=origin/main; mkdir build; echo cache > build/o";

/// A live (not zombie) process. After a daemon restart the shim is not our
/// child; a zombie waits for whatever reaper the host has.
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rsplit_once(") ").map(|(_, r)| !r.starts_with('Z')).unwrap_or(false))
        .unwrap_or(false)
}

fn status_of(r: Result<Vec<u8>, ClientError>) -> u16 {
    match r {
        Err(e) => e.status().unwrap_or_else(|| panic!("transport error {e}")),
        Ok(_) => 200,
    }
}

/// Read one file of a sandbox's cgroup in the first hierarchy that has it.
fn cgroup_file(env: &TestEnv, id: &str, file: &str) -> String {
    for dir in env.cgroup_dirs() {
        let p = dir.join(id).join(file);
        if let Ok(s) = std::fs::read_to_string(&p) {
            return s.trim().to_string();
        }
    }
    panic!("no cgroup file {file} for {id}");
}

/// A listing of the files a sandbox sees outside /proc, /sys, /dev: path,
/// type and mode, owner, size, mtime, link count, link target, content hash.
/// Blob names of the test images' layouts (imports keep layer blobs).
fn image_blobs() -> std::collections::BTreeSet<String> {
    let out = image("busybox").parent().unwrap().to_path_buf();
    std::fs::read_dir(out)
        .unwrap()
        .flatten()
        .flat_map(|d| std::fs::read_dir(d.path().join("blobs/sha256")).into_iter().flatten().flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Blobs in the store that are not an image's (snapshots' blobs).
fn snapshot_blobs(env: &TestEnv) -> usize {
    let images = image_blobs();
    std::fs::read_dir(env.root.join("blobs/sha256"))
        .unwrap()
        .flatten()
        .filter(|e| !images.contains(&*e.file_name().to_string_lossy()))
        .count()
}

fn tree(env: &TestEnv, id: &str) -> String {
    let v = sh(env, id, TREE_SCRIPT);
    assert_eq!(v["exit_code"], 0, "{v}");
    stdout(&v)
}

/// The listing script of [`tree`] (busybox sh), also run in a chroot of an
/// unpacked export. The root itself is left out (a layer has no entry for
/// it), and so are a directory's size and link count (filesystem artefacts:
/// overlay reports one link for a merged directory).
const TREE_SCRIPT: &str = "cd / && find . -xdev \\( -path ./proc -o -path ./sys -o -path ./dev \\) -prune -o -print | sort | \
                  grep -v '^\\.$' | \
                  while IFS= read -r p; do f='%f %u %g %s %Y %h'; \
                  if [ -d \"$p\" ] && [ ! -L \"$p\" ]; then f='%f %u %g %Y'; fi; \
                  printf '%s|%s|' \"$p\" \"$(stat -c \"$f\" \"$p\")\"; \
                  if [ -L \"$p\" ]; then readlink \"$p\"; elif [ -f \"$p\" ]; then md5sum < \"$p\"; else echo; fi; done";

/// Unpack the OCI image `image` (`LAYOUT:TAG`) with umoci into `bundle`
/// and list its root file system with [`TREE_SCRIPT`].
fn umoci_tree(image: &str, bundle: &Path) -> String {
    let st = std::process::Command::new("umoci")
        .args(["unpack", "--image", image, bundle.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(st.status.success(), "umoci unpack: {}", String::from_utf8_lossy(&st.stderr));
    let got = std::process::Command::new("chroot")
        .arg(bundle.join("rootfs"))
        .args(["/bin/sh", "-c", TREE_SCRIPT])
        .output()
        .unwrap();
    assert!(got.status.success(), "{}", String::from_utf8_lossy(&got.stderr));
    String::from_utf8_lossy(&got.stdout).into_owned()
}

/// Now, in unix milliseconds.
fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

/// Whether sandbox `id` is listed.
fn live(env: &TestEnv, id: &str) -> bool {
    let list: Vec<Value> = env.client().call("GET", "/v1/sandboxes", None::<&()>).unwrap();
    list.iter().any(|s| s["id"] == id)
}

/// Wait until `id` is gone (at most `limit`); when it went (unix ms).
fn gone_at(env: &TestEnv, id: &str, limit: Duration) -> i64 {
    let start = Instant::now();
    while live(env, id) {
        assert!(start.elapsed() < limit, "sandbox {id} outlived its time");
        std::thread::sleep(Duration::from_millis(25));
    }
    now_ms()
}

/// The file system of the daemon's store (`stat -f`), and whether it is
/// one where a checkpoint pre-copies and writes ahead (ext4, XFS, btrfs).
fn store_fs(env: &TestEnv) -> (String, bool) {
    let out = std::process::Command::new("stat").args(["-f", "-c", "%T"]).arg(&env.root).output().unwrap();
    let fs = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let copies = ["ext2/ext3", "xfs", "btrfs"].contains(&fs.as_str());
    (fs, copies)
}

#[test]
fn zz_suite_leaves_nothing_behind() {
    require_root();
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mounts: Vec<&str> = info.lines().filter(|l| l.contains(PREFIX)).collect();
    assert!(mounts.is_empty(), "leftover mounts: {mounts:?}");
    // v2: /sys/fs/cgroup/<parent>; v1: /sys/fs/cgroup/<controller>/<parent>.
    let ours = |name: &std::ffi::OsStr| name.to_string_lossy().starts_with(&format!("{PREFIX}-{}", std::process::id()));
    let mut cgroups = Vec::new();
    for e in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
        if ours(&e.file_name()) {
            cgroups.push(e.path());
        }
        for sub in std::fs::read_dir(e.path()).into_iter().flatten().flatten() {
            if ours(&sub.file_name()) {
                cgroups.push(sub.path());
            }
        }
    }
    assert!(cgroups.is_empty(), "leftover cgroups: {cgroups:?}");
    let procs: Vec<_> = processes_matching("strata-shim")
        .into_iter()
        .filter(|(pid, _)| {
            std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
                .unwrap_or_default()
                .contains(&format!("{PREFIX}-{}", std::process::id()))
        })
        .collect();
    assert!(procs.is_empty(), "leftover shims: {procs:?}");
}

// ---- registries (docker-registry on loopback) ----

fn pull_snapshot(env: &TestEnv, reg: &registry::Registry, reference: &str) -> Result<Value, ClientError> {
    env.client().call::<Value>(
        "POST",
        "/v1/snapshots/pull",
        Some(&json!({"reference": format!("{}/{reference}", reg.addr()), "insecure": true})),
    )
}

fn push_snapshot(env: &TestEnv, reg: &registry::Registry, snap: &str, reference: &str) -> Result<Value, ClientError> {
    env.client().call::<Value>(
        "POST",
        &format!("/v1/snapshots/{snap}/push"),
        Some(&json!({"reference": format!("{}/{reference}", reg.addr()), "insecure": true})),
    )
}

/// Names under a store directory (layers/ or blobs/sha256/).
fn store_entries(env: &TestEnv, sub: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(env.root.join(sub))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}
