//! envd's polled directory watchers (`CreateWatcher`, `GetWatcherEvents`,
//! `RemoveWatcher`), on inotify. The directory is resolved in the sandbox
//! like every other path (fs.rs) and watched through our descriptor of it
//! (`/proc/self/fd/N`), so a watch never follows a path the sandbox could
//! have changed under it. Recursive watches add the subdirectories found
//! at creation and those created later (up to [`MAX_WATCHES`]).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Mutex;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use serde_json::{json, Value};

use super::connect::{Code, RpcError};
use super::fs::Tree;
use crate::daemon::lock;

/// Directories one recursive watcher follows at most.
pub const MAX_WATCHES: usize = 1024;
/// Watchers per sandbox at most.
pub const MAX_WATCHERS: usize = 64;
/// Events kept between two polls at most (older ones are dropped).
const MAX_PENDING: usize = 10_000;

struct Watcher {
    inotify: Inotify,
    /// Each watch's directory, relative to the watched one ("" for it).
    dirs: HashMap<WatchDescriptor, String>,
    recursive: bool,
    /// The watched directory's path in the sandbox.
    base: String,
}

/// Every sandbox's watchers, by sandbox then id.
#[derive(Default)]
pub struct Watchers {
    all: Mutex<HashMap<String, HashMap<String, Watcher>>>,
}

fn flags() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_ONLYDIR
}

impl Watcher {
    fn add(&mut self, dir: &OwnedFd, rel: &str) -> Result<(), RpcError> {
        if self.dirs.len() >= MAX_WATCHES {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("more than {MAX_WATCHES} directories to watch"),
            ));
        }
        let wd = self
            .inotify
            .add_watch(format!("/proc/self/fd/{}", dir.as_raw_fd()).as_str(), flags())
            .map_err(|e| RpcError::internal(format!("watch {rel:?}: {e}")))?;
        self.dirs.insert(wd, rel.to_string());
        Ok(())
    }
}

impl Watchers {
    pub fn create(&self, sandbox: &str, tree: &Tree, path: &str, recursive: bool) -> Result<String, RpcError> {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| RpcError::internal(format!("inotify: {e}")))?;
        let mut w = Watcher { inotify, dirs: HashMap::new(), recursive, base: path.trim_end_matches('/').to_string() };
        w.add(&tree.watch_dir(path)?, "")?;
        if recursive {
            for e in tree.list(path, super::fs::MAX_LIST_DEPTH)? {
                if e["type"] == "FILE_TYPE_DIRECTORY" {
                    let full = e["path"].as_str().unwrap_or_default();
                    let rel = full.strip_prefix(path.trim_end_matches('/')).unwrap_or(full).trim_start_matches('/');
                    if let Ok(dir) = tree.watch_dir(full) {
                        w.add(&dir, rel)?;
                    }
                }
            }
        }
        let mut all = lock(&self.all);
        let mine = all.entry(sandbox.to_string()).or_default();
        if mine.len() >= MAX_WATCHERS {
            return Err(RpcError::new(Code::ResourceExhausted, format!("at most {MAX_WATCHERS} watchers per sandbox")));
        }
        let id = format!("w{}", hex::encode(rand::random::<[u8; 8]>()));
        mine.insert(id.clone(), w);
        Ok(id)
    }

    /// The events since the last poll.
    pub fn events(&self, sandbox: &str, tree: &Tree, id: &str) -> Result<Vec<Value>, RpcError> {
        let mut all = lock(&self.all);
        let w = all
            .get_mut(sandbox)
            .and_then(|m| m.get_mut(id))
            .ok_or_else(|| RpcError::not_found(format!("watcher {id:?} not found")))?;
        let mut out = Vec::new();
        let mut new_dirs: Vec<String> = Vec::new();
        loop {
            let batch = match w.inotify.read_events() {
                Ok(b) => b,
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => return Err(RpcError::internal(format!("read watch events: {e}"))),
            };
            for ev in batch {
                let Some(dir) = w.dirs.get(&ev.wd) else { continue };
                let Some(name) = ev.name.as_ref().map(|n| n.to_string_lossy().into_owned()) else { continue };
                let rel = if dir.is_empty() { name } else { format!("{dir}/{name}") };
                let m = ev.mask;
                let kind = if m.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO) {
                    if w.recursive && m.contains(AddWatchFlags::IN_ISDIR) {
                        new_dirs.push(rel.clone());
                    }
                    "EVENT_TYPE_CREATE"
                } else if m.intersects(AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_CLOSE_WRITE) {
                    "EVENT_TYPE_WRITE"
                } else if m.contains(AddWatchFlags::IN_DELETE) {
                    "EVENT_TYPE_REMOVE"
                } else if m.contains(AddWatchFlags::IN_MOVED_FROM) {
                    "EVENT_TYPE_RENAME"
                } else if m.contains(AddWatchFlags::IN_ATTRIB) {
                    "EVENT_TYPE_CHMOD"
                } else {
                    continue;
                };
                if out.len() < MAX_PENDING {
                    out.push(json!({"name": rel, "type": kind}));
                }
            }
        }
        // New subdirectories of a recursive watch: resolved in the sandbox
        // like any path, then watched through our descriptor. Their own
        // contents made before this poll are not reported (as inotify
        // cannot have seen them).
        for rel in new_dirs {
            if let Ok(dir) = tree.watch_dir(&format!("{}/{rel}", w.base)) {
                w.add(&dir, &rel)?;
            }
        }
        Ok(out)
    }

    pub fn remove(&self, sandbox: &str, id: &str) -> Result<(), RpcError> {
        lock(&self.all)
            .get_mut(sandbox)
            .and_then(|m| m.remove(id))
            .map(|_| ())
            .ok_or_else(|| RpcError::not_found(format!("watcher {id:?} not found")))
    }

    /// Drop a sandbox's watchers (it went).
    pub fn forget(&self, sandbox: &str) {
        lock(&self.all).remove(sandbox);
    }
}
