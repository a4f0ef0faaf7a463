//! `strata cp`: files between the host and a sandbox.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use super::{client, Cli};

/// `ID:PATH` with a 16-hex-digit sandbox id, else a host path.
fn sandbox_side(arg: &str) -> Option<(&str, &str)> {
    let (id, path) = arg.split_once(':')?;
    (id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some((id, path))
}

pub(super) fn run_cp(cli: &Cli, src: &str, dst: &str, no_symlinks: bool) -> Result<i32> {
    use crate::sandbox::copy::{Copied, CopyRequest, Direction};
    let staging = || -> Result<PathBuf> {
        let dir = std::env::temp_dir().join(format!("strata-cp-{:016x}", rand::random::<u64>()));
        std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
            .create(&dir)
            .with_context(|| format!("create {}", dir.display()))?;
        Ok(dir)
    };
    let absolute = |p: &str| -> Result<String> {
        let p = std::path::Path::new(p);
        let abs = if p.is_absolute() { p.to_path_buf() } else { std::env::current_dir()?.join(p) };
        Ok(abs.to_string_lossy().into_owned())
    };
    let mut c = client(cli)?;
    let mut call = |id: &str, req: CopyRequest| -> Result<Copied> {
        Ok(c.call("POST", &format!("/v1/sandboxes/{id}/copy"), Some(&req))?)
    };
    if no_symlinks && sandbox_side(src).is_none() {
        bail!("--no-symlinks is for copies out of a sandbox (ID:SRC)");
    }
    let total = match (sandbox_side(src), sandbox_side(dst)) {
        (None, Some((id, path))) if src == "-" => {
            // A tar stream on stdin: unpacked into a private staging
            // directory (the tar crate keeps entries inside it), then each
            // top-level entry copied into the sandbox directory `path`.
            let stage = staging()?;
            let r = (|| -> Result<Copied> {
                tar::Archive::new(std::io::stdin().lock()).unpack(&stage).context("unpack the tar from stdin")?;
                let mut sum = Copied::default();
                for e in std::fs::read_dir(&stage)? {
                    let e = e?;
                    let req = CopyRequest {
                        direction: Direction::In,
                        path: path.to_string(),
                        host_path: e.path().to_string_lossy().into_owned(),
                        no_symlinks: false,
                    };
                    let one = call(id, req)?;
                    (sum.files, sum.dirs, sum.symlinks, sum.bytes) = (
                        sum.files + one.files,
                        sum.dirs + one.dirs,
                        sum.symlinks + one.symlinks,
                        sum.bytes + one.bytes,
                    );
                }
                Ok(sum)
            })();
            let _ = std::fs::remove_dir_all(&stage);
            r?
        }
        (None, Some((id, path))) => {
            let host_path = absolute(src)?;
            call(id, CopyRequest { direction: Direction::In, path: path.to_string(), host_path, no_symlinks: false })?
        }
        (Some((id, path)), None) if dst == "-" => {
            let stage = staging()?;
            let r = (|| -> Result<Copied> {
                let name = std::path::Path::new(path).file_name().context("the sandbox path names no file")?.to_owned();
                let host = stage.join(&name);
                let req = CopyRequest {
                    direction: Direction::Out,
                    path: path.to_string(),
                    host_path: host.to_string_lossy().into_owned(),
                    no_symlinks,
                };
                let copied = call(id, req)?;
                let mut b = tar::Builder::new(std::io::stdout().lock());
                b.follow_symlinks(false);
                if host.is_dir() {
                    b.append_dir_all(&name, &host)?;
                } else {
                    b.append_path_with_name(&host, &name)?;
                }
                b.finish()?;
                Ok(copied)
            })();
            let _ = std::fs::remove_dir_all(&stage);
            r?
        }
        (Some((id, path)), None) => {
            let host_path = absolute(dst)?;
            call(id, CopyRequest { direction: Direction::Out, path: path.to_string(), host_path, no_symlinks })?
        }
        _ => bail!("exactly one of SRC and DST must be ID:PATH (a sandbox id, 16 hex digits)"),
    };
    eprintln!("copied {} files, {} dirs, {} symlinks, {} bytes", total.files, total.dirs, total.symlinks, total.bytes);
    if total.skipped_symlinks > 0 {
        eprintln!("left out {} symlinks (--no-symlinks)", total.skipped_symlinks);
    }
    Ok(0)
}
