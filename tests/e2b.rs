//! The E2B-compatible listener, driven by the real E2B Python SDK (pinned,
//! from PyPI, in the venv scripts/e2b-venv.sh makes): tests/e2b/sdk_test.py
//! runs every acceptance check against a daemon started here.

use std::process::Command;

use strata_tests::{repo_root, TestEnv};

/// A loopback port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The venv's python: `STRATA_E2B_PYTHON`, else made by scripts/e2b-venv.sh.
fn sdk_python() -> String {
    if let Ok(p) = std::env::var("STRATA_E2B_PYTHON") {
        return p;
    }
    let out = Command::new(repo_root().join("scripts/e2b-venv.sh")).output().expect("run scripts/e2b-venv.sh");
    assert!(out.status.success(), "scripts/e2b-venv.sh failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn the_e2b_sdk_drives_strata_unmodified() {
    let python = sdk_python();
    let keys_dir = tempfile::tempdir().unwrap();
    let keys = keys_dir.path().join("keys");
    std::fs::write(&keys, "# test keys\nkey-one\n\nkey-two\n").unwrap();
    // A host file the sandbox must never read or write through the API.
    let canary = keys_dir.path().join("canary");
    std::fs::write(&canary, "host secret").unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let env = TestEnv::start_with(&[
        "--e2b-listen",
        &addr,
        "--e2b-api-keys",
        keys.to_str().unwrap(),
        "--e2b-domain",
        "strata.test",
    ]);
    let dir = strata_tests::image("e2b");
    env.cli_ok(&["image", "import", dir.to_str().unwrap(), "--name", "base"]);
    let url = format!("http://{addr}");
    let out = Command::new(&python)
        .arg(repo_root().join("tests/e2b/sdk_test.py"))
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", "key-one")
        .env("STRATA_OTHER_KEY", "key-two")
        .env("STRATA_HOST_CANARY", &canary)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        .output()
        .expect("run the SDK test script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("ALL E2B SDK CHECKS PASSED"),
        "the SDK checks failed ({}):\n{stdout}\n{}\ndaemon log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        env.daemon_log()
    );
    assert_eq!(std::fs::read_to_string(&canary).unwrap(), "host secret");
    assert!(!canary.with_extension("written").exists(), "a write escaped to the host");
    // Every sandbox the script made is gone (killed, expired or its own).
    let listed = env.cli_ok(&["ps"]);
    assert!(listed.lines().count() <= 1, "sandboxes left: {listed}");
    env.finish();
}
