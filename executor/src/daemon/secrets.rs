//! Secret env (`secret_env`): values a sandbox's commands get that the
//! daemon never writes to the catalog, an exec record or an artifact.
//! They live in the sandbox's defaults in memory and in one file per
//! lineage, `ROOT/secrets/<work context>` (the directory 0700, the file
//! 0600, both root's), so a daemon restart re-adopting the sandbox and a
//! later resume of the lineage on this host find them. A resume naming
//! `secret_env` replaces them; a fork starts a lineage of its own without
//! them. The file is written once a launch naming them is recorded, and
//! goes when the lineage ends here (retire, close, gc), or at the next gc
//! once the catalog has it ended (another host of the fleet ended it).

use crate::daemon::Daemon;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::PathBuf;

/// The secrets directory of one daemon root.
pub struct Secrets {
    dir: PathBuf,
}

impl Secrets {
    pub fn new(root: &std::path::Path) -> Secrets {
        Secrets { dir: root.join("secrets") }
    }

    /// A lineage's file: its id is a file name, never a path (checked here
    /// again, whatever made the lineage: a pull names ids too).
    fn path(&self, work_context: &str) -> std::io::Result<PathBuf> {
        if !crate::ids::valid_work_context(work_context) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("work context {work_context:?} is not a valid id"),
            ));
        }
        Ok(self.dir.join(work_context))
    }

    /// A lineage's secrets, if this host keeps any.
    pub fn read(&self, work_context: &str) -> std::io::Result<Option<Vec<String>>> {
        match std::fs::read(self.path(work_context)?) {
            Ok(b) => serde_json::from_slice(&b).map(Some).map_err(std::io::Error::other),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Keep `env` as the lineage's secrets (written whole, then renamed
    /// over the old file).
    pub fn write(&self, work_context: &str, env: &[String]) -> std::io::Result<()> {
        let path = self.path(work_context)?;
        std::fs::DirBuilder::new().mode(0o700).recursive(true).create(&self.dir)?;
        let tmp = self.dir.join(format!(".{work_context}.tmp"));
        let written = (|| {
            let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
            f.write_all(&serde_json::to_vec(env).map_err(std::io::Error::other)?)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }

    /// The lineages this host keeps secrets of.
    pub fn lineages(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return Vec::new() };
        entries
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| crate::ids::valid_work_context(n))
            .collect()
    }

    /// Forget a lineage's secrets (it ended).
    pub fn remove(&self, work_context: &str) -> std::io::Result<()> {
        match std::fs::remove_file(self.path(work_context)?) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// The names of `KEY=VALUE` entries.
pub fn names(env: &[String]) -> Vec<String> {
    env.iter().map(|e| e.split('=').next().unwrap_or("").to_string()).collect()
}

impl Daemon {
    /// A launch that named secret env was recorded: they are its lineage's
    /// now (a launch that failed changed nothing). A write that fails
    /// leaves the sandbox running with them, but a restart or a later
    /// resume would not find them: said in the log.
    pub(crate) fn keep_secrets(&self, work_context: &str, given: &[String]) {
        if given.is_empty() {
            return;
        }
        if let Err(e) = self.secrets.write(work_context, given) {
            tracing::error!("lineage {work_context}: keep its secret env: {e} (a restart or resume will lack it)");
        }
    }

    /// A lineage ended: this host's copy of its secrets goes.
    pub(crate) fn forget_secrets(&self, work_context: &str) {
        if let Err(e) = self.secrets.remove(work_context) {
            tracing::warn!("lineage {work_context}: remove its secret env: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn secrets_round_trip_in_a_root_only_file_and_go() {
        let dir = tempfile::tempdir().unwrap();
        let s = Secrets::new(dir.path());
        assert_eq!(s.read("w").unwrap(), None);
        s.write("w", &["A=1".into(), "B=x=y".into()]).unwrap();
        assert_eq!(s.read("w").unwrap(), Some(vec!["A=1".to_string(), "B=x=y".to_string()]));
        let mode = |p: PathBuf| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(dir.path().join("secrets")), mode(dir.path().join("secrets/w"))), (0o700, 0o600));
        s.write("w", &["A=2".into()]).unwrap();
        assert_eq!(s.lineages(), vec!["w".to_string()]);
        assert_eq!(s.read("w").unwrap(), Some(vec!["A=2".to_string()]));
        s.remove("w").unwrap();
        s.remove("w").unwrap();
        assert_eq!(s.read("w").unwrap(), None);
        assert_eq!(names(&["A=1".into(), "B=x=y".into()]), vec!["A", "B"]);
        // An id is never a path, whoever named it.
        std::fs::write(dir.path().join("victim"), "x").unwrap();
        for bad in ["../victim", "/etc/passwd", ".hidden", ""] {
            assert!(s.remove(bad).is_err() && s.read(bad).is_err() && s.write(bad, &[]).is_err(), "{bad}");
        }
        assert!(dir.path().join("victim").exists());
    }
}
