//! Escape tests (root only): code in a sandbox tries to reach the host, the
//! daemon or the shim, and each attempt must fail safely and leave the host
//! unchanged. See docs/security.md for the defence each one exercises;
//! one file per topic.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use strata_tests::*;

mod connections;
mod copy;
mod disk;
mod escape;
mod layers;
mod shim_binary;
mod trees;
mod userns;

/// Run `script` in the sandbox; returns (exit code, stdout + stderr).
fn attempt(env: &TestEnv, id: &str, script: &str) -> (i64, String) {
    let v = sh(env, id, script);
    (v["exit_code"].as_i64().unwrap(), format!("{}{}", stdout(&v), v["stderr"].as_str().unwrap_or("")))
}

/// `strata cp` with the CLI; returns (success, stderr).
fn cp(env: &TestEnv, src: &str, dst: &str) -> (bool, String) {
    let out = env.cli(&["cp", src, dst]);
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// `tmp/` entries of the store, waiting up to `secs` for it to hold only `keep`.
fn tmp_entries_settle(env: &TestEnv, keep: &[&str], secs: u64) -> Vec<String> {
    let start = std::time::Instant::now();
    loop {
        let names: Vec<String> = std::fs::read_dir(env.root.join("tmp"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !keep.contains(&n.as_str()))
            .collect();
        if names.is_empty() || start.elapsed().as_secs() >= secs {
            return names;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Names under a store directory.
fn entries(env: &TestEnv, sub: &str) -> usize {
    std::fs::read_dir(env.root.join(sub)).map(|d| d.count()).unwrap_or(0)
}
