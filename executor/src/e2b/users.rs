//! The accounts a sandbox's own `/etc/passwd` and `/etc/group` name: E2B
//! clients run commands and file operations as a user by name (`user`,
//! `root`). Both files are read through the sandbox's root with the same
//! safe resolution as every other sandbox path, and bounded.
#![forbid(unsafe_code)]

use std::ffi::CString;
use std::io::Read;
use std::os::fd::BorrowedFd;

use strata_shim::sys::{openat2, RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_XDEV};

/// The user E2B's SDK means when it names none.
pub const DEFAULT_USER: &str = "user";

const MAX_FILE: u64 = 4 << 20;

fn root() -> User {
    User { name: "root".into(), uid: 0, gid: 0, home: "/root".into() }
}

#[derive(Debug, Clone, PartialEq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

#[derive(Debug, Clone, Default)]
pub struct Accounts {
    users: Vec<User>,
    groups: Vec<(String, u32)>,
}

fn read(root: BorrowedFd<'_>, path: &str) -> String {
    let Ok(name) = CString::new(path) else { return String::new() };
    let flags = libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOFOLLOW;
    let Ok(fd) = openat2(root, &name, flags, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV) else {
        return String::new();
    };
    let f = std::fs::File::from(fd);
    if !f.metadata().is_ok_and(|m| m.is_file()) {
        return String::new();
    }
    let mut data = Vec::new();
    let _ = f.take(MAX_FILE).read_to_end(&mut data);
    String::from_utf8_lossy(&data).into_owned()
}

impl Accounts {
    pub fn read(root: BorrowedFd<'_>) -> Accounts {
        Accounts::parse(&read(root, "/etc/passwd"), &read(root, "/etc/group"))
    }

    pub fn parse(passwd: &str, group: &str) -> Accounts {
        let users = passwd
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                (f.len() >= 6).then_some(())?;
                Some(User { name: f[0].into(), uid: f[2].parse().ok()?, gid: f[3].parse().ok()?, home: f[5].into() })
            })
            .collect();
        let groups = group
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                Some((f.first()?.to_string(), f.get(2)?.parse().ok()?))
            })
            .collect();
        Accounts { users, groups }
    }

    /// A user by name; `root` exists even without a passwd.
    pub fn user(&self, name: &str) -> Option<User> {
        self.users.iter().find(|u| u.name == name).cloned().or_else(|| (name == "root").then(root))
    }

    /// Who a request that names no user runs as: the image's configured
    /// `User` (`image`: its uid and gid, named as the passwd names that
    /// uid, else by the number, with `/` as home), else [`DEFAULT_USER`]
    /// where the passwd has it (E2B's templates), else root.
    pub fn default_user(&self, image: Option<(u32, u32)>) -> User {
        if let Some((uid, gid)) = image {
            return match self.users.iter().find(|u| u.uid == uid) {
                Some(u) => User { gid, ..u.clone() },
                None => User { name: uid.to_string(), uid, gid, home: "/".into() },
            };
        }
        self.user(DEFAULT_USER).or_else(|| self.user("root")).unwrap_or_else(root)
    }

    pub fn user_name(&self, uid: u32) -> String {
        self.users.iter().find(|u| u.uid == uid).map_or_else(|| uid.to_string(), |u| u.name.clone())
    }

    pub fn group_name(&self, gid: u32) -> String {
        self.groups.iter().find(|g| g.1 == gid).map_or_else(|| gid.to_string(), |g| g.0.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_and_groups_by_name_and_id() {
        let a = Accounts::parse(
            "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\nbroken\n",
            "root:x:0:\nuser:x:1000:\n",
        );
        assert_eq!(a.user("user").unwrap().home, "/home/user");
        // No user named: the image's, else `user`, else root.
        assert_eq!(a.default_user(None).name, "user");
        assert_eq!(a.default_user(Some((0, 0))).name, "root");
        assert_eq!(a.default_user(Some((1000, 5))).gid, 5);
        let odd = a.default_user(Some((4242, 4242)));
        assert_eq!((odd.name.as_str(), odd.home.as_str()), ("4242", "/"));
        let plain = Accounts::parse("root:x:0:0:root:/root:/bin/sh\n", "");
        assert_eq!(plain.default_user(None), User { name: "root".into(), uid: 0, gid: 0, home: "/root".into() });
        assert_eq!(Accounts::default().default_user(None).name, "root");
        assert!(plain.user("user").is_none(), "a user named but absent stays an error");
        assert_eq!(a.user("user").unwrap().uid, 1000);
        assert!(a.user("ghost").is_none());
        assert_eq!(a.user_name(1000), "user");
        assert_eq!(a.group_name(7), "7");
        assert_eq!(Accounts::default().user("root").unwrap().uid, 0);
    }
}
