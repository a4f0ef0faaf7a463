//! envd's polled directory watchers (`CreateWatcher`, `GetWatcherEvents`,
//! `RemoveWatcher`), on one inotify instance for the whole listener (an
//! instance per watcher would spend root's `max_user_instances`, 128 by
//! default, which the host's own services need). A directory is resolved
//! in the sandbox like every other path (fs.rs) and watched through our
//! descriptor of it (`/proc/self/fd/N`), so a watch never follows a path
//! the sandbox changed afterwards. Recursive watchers add the
//! subdirectories found at creation and those created later. Bounds:
//! [`MAX_WATCHERS`] per sandbox, [`MAX_WATCHES`] directories in all.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Mutex;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use serde_json::{json, Value};

use super::connect::{Code, RpcError};
use super::fs::Tree;
use crate::daemon::lock;

/// Directories watched at once, by every watcher of every sandbox.
pub const MAX_WATCHES: usize = 8192;
/// Watchers per sandbox at most.
pub const MAX_WATCHERS: usize = 64;
/// Events kept for one watcher between two polls (later ones are dropped).
const MAX_PENDING: usize = 10_000;

struct Watcher {
    sandbox: String,
    recursive: bool,
    /// Whether its events carry the entry they are about (`include_entry`).
    include_entry: bool,
    /// The watched directory's path in the sandbox.
    base: String,
    /// Its watches, each with its directory relative to `base`.
    dirs: HashMap<WatchDescriptor, String>,
    pending: Vec<Value>,
}

struct State {
    /// Made at the first watcher.
    inotify: Option<Inotify>,
    watchers: HashMap<String, Watcher>,
    /// Which watchers use each watch (inotify gives one descriptor per
    /// inode: two watchers of one directory share it).
    users: HashMap<WatchDescriptor, HashSet<String>>,
}

pub struct Watchers {
    state: Mutex<State>,
}

impl Default for Watchers {
    fn default() -> Self {
        Watchers { state: Mutex::new(State { inotify: None, watchers: HashMap::new(), users: HashMap::new() }) }
    }
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

impl State {
    fn add(&mut self, watcher: &str, dir: &OwnedFd, rel: &str) -> Result<(), RpcError> {
        if self.users.len() >= MAX_WATCHES {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("{MAX_WATCHES} directories are watched already"),
            ));
        }
        let inotify = self.inotify.as_ref().ok_or_else(|| RpcError::internal("no inotify instance"))?;
        let wd = inotify
            .add_watch(format!("/proc/self/fd/{}", dir.as_raw_fd()).as_str(), flags())
            .map_err(|e| RpcError::internal(format!("watch {rel:?}: {e}")))?;
        self.users.entry(wd).or_default().insert(watcher.to_string());
        if let Some(w) = self.watchers.get_mut(watcher) {
            w.dirs.insert(wd, rel.to_string());
        }
        Ok(())
    }

    /// Drop a watcher and the watches no other watcher uses.
    fn drop_watcher(&mut self, id: &str) -> Option<Watcher> {
        let w = self.watchers.remove(id)?;
        for wd in w.dirs.keys() {
            let unused = self.users.get_mut(wd).is_some_and(|u| {
                u.remove(id);
                u.is_empty()
            });
            if unused {
                self.users.remove(wd);
                if let Some(i) = &self.inotify {
                    let _ = i.rm_watch(*wd);
                }
            }
        }
        Some(w)
    }

    /// Move what inotify has into the watchers' pending lists; add the
    /// directories recursive watchers see created (after the read, through
    /// `tree` when it is their sandbox's).
    fn drain(&mut self, sandbox: &str, tree: &Tree) -> Result<(), RpcError> {
        let Some(inotify) = &self.inotify else { return Ok(()) };
        let mut new_dirs: Vec<(String, String)> = Vec::new();
        loop {
            let batch = match inotify.read_events() {
                Ok(b) => b,
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => return Err(RpcError::internal(format!("read watch events: {e}"))),
            };
            for ev in batch {
                let Some(users) = self.users.get(&ev.wd) else { continue };
                let Some(name) = ev.name.as_ref().map(|n| n.to_string_lossy().into_owned()) else { continue };
                let m = ev.mask;
                let kind = if m.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO) {
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
                for id in users {
                    let Some(w) = self.watchers.get_mut(id) else { continue };
                    let Some(dir) = w.dirs.get(&ev.wd) else { continue };
                    let rel = if dir.is_empty() { name.clone() } else { format!("{dir}/{name}") };
                    if w.recursive && kind == "EVENT_TYPE_CREATE" && m.contains(AddWatchFlags::IN_ISDIR) {
                        new_dirs.push((id.clone(), rel.clone()));
                    }
                    if w.pending.len() < MAX_PENDING {
                        w.pending.push(json!({"name": rel, "type": kind}));
                    }
                }
            }
        }
        for (id, rel) in new_dirs {
            let Some(w) = self.watchers.get(&id) else { continue };
            // Only this sandbox's tree is open here; other sandboxes'
            // new directories are added at their own next poll.
            if w.sandbox != sandbox {
                continue;
            }
            if let Ok(dir) = tree.watch_dir(&format!("{}/{rel}", w.base)) {
                self.add(&id, &dir, &rel)?;
            }
        }
        Ok(())
    }
}

impl Watchers {
    pub fn create(
        &self,
        sandbox: &str,
        tree: &Tree,
        path: &str,
        recursive: bool,
        include_entry: bool,
    ) -> Result<String, RpcError> {
        let top = tree.watch_dir(path)?;
        let mut st = lock(&self.state);
        if st.watchers.values().filter(|w| w.sandbox == sandbox).count() >= MAX_WATCHERS {
            return Err(RpcError::new(Code::ResourceExhausted, format!("at most {MAX_WATCHERS} watchers per sandbox")));
        }
        if st.inotify.is_none() {
            st.inotify = Some(
                Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
                    .map_err(|e| RpcError::internal(format!("inotify: {e}")))?,
            );
        }
        // Events so far belong to the watchers there were.
        st.drain(sandbox, tree)?;
        let id = format!("w{}", hex::encode(rand::random::<[u8; 8]>()));
        let base = path.trim_end_matches('/').to_string();
        st.watchers.insert(
            id.clone(),
            Watcher {
                sandbox: sandbox.to_string(),
                recursive,
                include_entry,
                base: base.clone(),
                dirs: HashMap::new(),
                pending: Vec::new(),
            },
        );
        let added = (|| {
            st.add(&id, &top, "")?;
            if recursive {
                for e in tree.list(path, super::fs::MAX_LIST_DEPTH)? {
                    if e["type"] != "FILE_TYPE_DIRECTORY" {
                        continue;
                    }
                    let full = e["path"].as_str().unwrap_or_default();
                    let rel = full.strip_prefix(base.as_str()).unwrap_or(full).trim_start_matches('/');
                    if let Ok(dir) = tree.watch_dir(full) {
                        st.add(&id, &dir, rel)?;
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = added {
            st.drop_watcher(&id);
            return Err(e);
        }
        Ok(id)
    }

    /// The events since the last poll; with `include_entry`, each event
    /// of a path that is there now carries its entry (looked up at the
    /// poll: a path removed or renamed away has none).
    pub fn events(&self, sandbox: &str, tree: &Tree, id: &str) -> Result<Vec<Value>, RpcError> {
        let mut st = lock(&self.state);
        if st.watchers.get(id).is_none_or(|w| w.sandbox != sandbox) {
            return Err(RpcError::not_found(format!("watcher {id:?} not found")));
        }
        st.drain(sandbox, tree)?;
        let Some(w) = st.watchers.get_mut(id) else { return Ok(Vec::new()) };
        let mut events = std::mem::take(&mut w.pending);
        if w.include_entry {
            for ev in &mut events {
                if matches!(ev["type"].as_str(), Some("EVENT_TYPE_REMOVE" | "EVENT_TYPE_RENAME")) {
                    continue;
                }
                let path = format!("{}/{}", w.base, ev["name"].as_str().unwrap_or_default());
                if let Ok(entry) = tree.stat(&path) {
                    ev["entry"] = entry;
                }
            }
        }
        Ok(events)
    }

    pub fn remove(&self, sandbox: &str, id: &str) -> Result<(), RpcError> {
        let mut st = lock(&self.state);
        if st.watchers.get(id).is_none_or(|w| w.sandbox != sandbox) {
            return Err(RpcError::not_found(format!("watcher {id:?} not found")));
        }
        st.drop_watcher(id);
        Ok(())
    }

    /// Drop a sandbox's watchers (it went).
    pub fn forget(&self, sandbox: &str) {
        let mut st = lock(&self.state);
        let ids: Vec<String> =
            st.watchers.iter().filter(|(_, w)| w.sandbox == sandbox).map(|(k, _)| k.clone()).collect();
        for id in ids {
            st.drop_watcher(&id);
        }
    }

    /// The sandboxes that have watchers.
    pub fn sandboxes(&self) -> HashSet<String> {
        lock(&self.state).watchers.values().map(|w| w.sandbox.clone()).collect()
    }
}
