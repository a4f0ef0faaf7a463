//! Messages between the daemon and a sandbox's shim.
//!
//! Transport: a `SOCK_SEQPACKET` Unix socket, so every `send` is one message and
//! file descriptors travel with the message they belong to (`SCM_RIGHTS`).
//! Payloads are JSON. The shim listens on `sandboxes/<id>/shim.sock` (a listener
//! the daemon bound and handed over as fd 3), so a restarted daemon reconnects
//! to a live shim instead of killing it.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

/// The fd number at which the shim finds its listening socket.
pub const LISTEN_FD: RawFd = 3;

/// Largest message either side accepts. Argv and env of one exec must fit.
pub const MAX_MESSAGE: usize = 256 * 1024;

/// Largest encoded `ExecSpec` the daemon sends: below [`MAX_MESSAGE`] and
/// below the default socket send buffer (`net.core.wmem_default`, 208 KiB),
/// past which `sendmsg` fails with EMSGSIZE.
pub const MAX_EXEC_SPEC: usize = 128 * 1024;

/// Largest env a sandbox is created with (its entries as the shim gets
/// them, JSON-encoded): every exec carries it, and leaves the rest of
/// [`MAX_EXEC_SPEC`] for the command's own argv and env.
pub const MAX_SANDBOX_ENV: usize = 64 * 1024;

/// How to build the sandbox's root filesystem and identity; sent once, first.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SetupSpec {
    /// Host path of the empty directory the overlay is mounted on.
    pub rootfs: PathBuf,
    /// Directory the lower paths are relative to (keeps the legacy option string short).
    pub layers_dir: PathBuf,
    /// Lower directories, topmost first, relative to `layers_dir`.
    pub lowers: Vec<PathBuf>,
    pub upper: PathBuf,
    pub work: PathBuf,
    pub hostname: String,
    /// The image's working directory, created (like Docker does) if missing.
    pub workdir: String,
    /// Mounts that are never captured in a snapshot.
    #[serde(default)]
    pub mounts: Vec<ExtraMount>,
    /// Install the default seccomp filter (false: `--seccomp unconfined`).
    #[serde(default = "yes")]
    pub seccomp: bool,
    /// The shim runs in its own user namespace (`--userns`): the root
    /// overlay arrives ready-made as a mount fd with this request (the
    /// daemon builds it over idmapped layers; see the executor's
    /// `userns.rs`) instead of being mounted from `lowers`/`upper`/`work`,
    /// and device nodes are bound from the host's /dev (no mknod there).
    #[serde(default)]
    pub userns: bool,
    /// With a network (`egress`): the `/etc/resolv.conf` the sandbox sees,
    /// naming the daemon's resolver. Bound over the image's file (never
    /// written into the upper, so no checkpoint captures it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolv_conf: Option<String>,
    /// A host directory to run on as it is (containerd's mounted rootfs),
    /// bound at `rootfs` instead of the overlay of `lowers` and `upper`:
    /// what the sandbox writes goes there, and no snapshot captures it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_dir: Option<PathBuf>,
}

fn yes() -> bool {
    true
}

/// A mount on top of the sandbox's root that is not part of its upper.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum ExtraMount {
    /// A size-limited tmpfs at `path` (absolute, inside the sandbox).
    Scratch { path: String, size: u64 },
    /// The host directory `source` (a named cache) bound at `path`.
    Cache { source: PathBuf, path: String },
}

/// One command to start inside the sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ExecSpec {
    /// Daemon-chosen id, echoed in every event about this command.
    pub id: u64,
    pub argv: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    /// Give the command a pseudo-terminal allocated in the sandbox's devpts.
    /// Then no fds travel with the request and the master comes back with
    /// [`ShimEvent::Started`]. Otherwise exactly three fds (stdin, stdout,
    /// stderr) travel with the request.
    pub tty: bool,
    /// With `tty`: the initial window size, set before the command starts.
    #[serde(default)]
    pub rows: u16,
    #[serde(default)]
    pub cols: u16,
    /// Without `tty`: a fourth fd travels after the three stdio fds, the
    /// write end of a status pipe. The shim sends nothing about this
    /// command on the connection: it writes the one event that ends it
    /// ([`ShimEvent::Exited`] or [`ShimEvent::StartFailed`]) to that fd,
    /// JSON, and closes it. The daemon then polls one fd for output and
    /// exit alike (no hop through its connection's reader thread).
    /// Only sent to a shim that listed [`FEATURE_STATUS_FD`] (in
    /// [`ShimEvent::ReadyWith`] or [`ShimEvent::Hello`]).
    #[serde(default)]
    pub status_fd: bool,
    /// The shim keeps copies of the daemon's ends of this command's stdio
    /// (with `tty`, of the pty master it allocates) while the command
    /// runs, and hands them to a daemon that asks with
    /// [`ShimRequest::Reattach`]: the command outlives a daemon restart
    /// without its output pipes closing under it (no EPIPE) and is
    /// attached to again. Without `tty`, after the three stdio fds come
    /// the daemon's ends: stdout's and stderr's read ends, then, if the
    /// daemon keeps the command's stdin open, stdin's write end (5 or 6
    /// fds in all; no status fd). Only sent to a shim that listed
    /// [`FEATURE_KEEP`].
    #[serde(default)]
    pub keep: bool,
}

/// What this shim build understands beyond the first protocol; reported
/// in [`ShimEvent::ReadyWith`] and [`ShimEvent::Hello`], so a daemon newer
/// than its shim (an older `--shim` file, or a shim kept running across a
/// daemon upgrade) asks it only what it can do.
pub const FEATURES: &[&str] = &[FEATURE_STATUS_FD, FEATURE_KEEP];

/// [`ExecSpec::status_fd`].
pub const FEATURE_STATUS_FD: &str = "status-fd";

/// [`ExecSpec::keep`], [`ShimRequest::Reattach`] and
/// [`ShimRequest::CloseStdin`].
pub const FEATURE_KEEP: &str = "keep";

/// [`FEATURES`] as a message carries them.
pub fn features() -> Vec<String> {
    FEATURES.iter().map(|f| f.to_string()).collect()
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum ShimRequest {
    Setup(SetupSpec),
    Exec(ExecSpec),
    /// Signal a command; with `group`, its whole process group (it leads one).
    Signal {
        id: u64,
        signal: i32,
        group: bool,
    },
    /// Sent by a daemon after it (re)connects; answered with [`ShimEvent::Hello`].
    Hello,
    /// The daemon's ends of a command started with [`ExecSpec::keep`]:
    /// answered with [`ShimEvent::Reattached`] (and from then on the
    /// command's events come on this connection), or with
    /// [`ShimEvent::NotRunning`].
    Reattach {
        id: u64,
    },
    /// Close the shim's copy of a kept command's stdin (the daemon closed
    /// its own): the command reads EOF once no copy is left.
    CloseStdin {
        id: u64,
    },
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum ExitStatus {
    Code(i32),
    Signal(i32),
}

impl ExitStatus {
    /// Shell convention: the code, or 128 + signal number.
    pub fn shell_code(self) -> i32 {
        match self {
            ExitStatus::Code(c) => c,
            ExitStatus::Signal(s) => 128 + s,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum ShimEvent {
    /// Setup finished; the sandbox is ready for commands (a shim from
    /// before [`FEATURES`]).
    Ready,
    /// Setup finished, and the shim can do these [`FEATURES`].
    ReadyWith {
        features: Vec<String>,
    },
    /// Setup failed; the error chain, outermost first. The shim exits next.
    SetupFailed {
        chain: Vec<String>,
    },
    /// The command was started (`pid` in the sandbox's PID namespace). With a
    /// tty, the pty master travels with this message.
    Started {
        id: u64,
        pid: i32,
    },
    /// The command could not be started at all (bad request).
    StartFailed {
        id: u64,
        message: String,
    },
    Exited {
        id: u64,
        status: ExitStatus,
    },
    /// A kept command, still running: the fds are its stdout's and
    /// stderr's read ends then, with `stdin`, stdin's write end; with
    /// `tty`, the pty master alone.
    Reattached {
        id: u64,
        pid: i32,
        tty: bool,
        stdin: bool,
    },
    /// No command of that id runs (it ended, or was never kept).
    NotRunning {
        id: u64,
    },
    Hello {
        running: Vec<u64>,
        /// [`FEATURES`] of the shim that answers (none before there were any).
        #[serde(default)]
        features: Vec<String>,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("send message")]
    Send(#[source] nix::Error),
    #[error("receive message")]
    Recv(#[source] nix::Error),
    #[error("peer closed the connection")]
    Closed,
    #[error("message truncated (over {MAX_MESSAGE} bytes)")]
    Truncated,
    #[error("encode message")]
    Encode(#[source] serde_json::Error),
    #[error("decode message")]
    Decode(#[source] serde_json::Error),
}

/// Send one message with `fds` attached.
pub fn send<T: Serialize>(sock: impl AsFd, msg: &T, fds: &[RawFd]) -> Result<(), ProtoError> {
    send_flags(sock, msg, fds, MsgFlags::MSG_NOSIGNAL)
}

/// [`send`], but never waiting for room in the peer's queue: a full queue
/// is `ProtoError::Send(EAGAIN)`, and nothing was sent.
pub fn send_nowait<T: Serialize>(sock: impl AsFd, msg: &T, fds: &[RawFd]) -> Result<(), ProtoError> {
    send_flags(sock, msg, fds, MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT)
}

fn send_flags<T: Serialize>(sock: impl AsFd, msg: &T, fds: &[RawFd], flags: MsgFlags) -> Result<(), ProtoError> {
    let buf = serde_json::to_vec(msg).map_err(ProtoError::Encode)?;
    let iov = [IoSlice::new(&buf)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
    loop {
        match sendmsg::<()>(sock.as_fd().as_raw_fd(), &iov, cmsgs, flags, None) {
            Ok(_) => return Ok(()),
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(ProtoError::Send(e)),
        }
    }
}

/// Receive one message and the fds that came with it (close-on-exec).
///
/// The message's length is read first (`MSG_PEEK | MSG_TRUNC` gives a
/// datagram's whole length without taking it), so the buffer is as large
/// as the message, not [`MAX_MESSAGE`]: zeroing 256 KiB per message, or
/// per receiving thread (one per sandbox in the daemon), cost more than
/// the extra system call.
pub fn recv<T: DeserializeOwned>(sock: impl AsFd) -> Result<(T, Vec<OwnedFd>), ProtoError> {
    let len = loop {
        match nix::sys::socket::recv(sock.as_fd().as_raw_fd(), &mut [], MsgFlags::MSG_PEEK | MsgFlags::MSG_TRUNC) {
            Ok(n) => break n,
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(ProtoError::Recv(e)),
        }
    };
    if len == 0 {
        return Err(ProtoError::Closed);
    }
    // A larger message than that is taken whole and reported truncated.
    let mut buf = vec![0u8; len.min(MAX_MESSAGE)];
    recv_into(sock, &mut buf)
}

fn recv_into<T: DeserializeOwned>(sock: impl AsFd, buf: &mut [u8]) -> Result<(T, Vec<OwnedFd>), ProtoError> {
    let mut cmsg_space = nix::cmsg_space!([RawFd; 8]);
    let (len, fds) = loop {
        let mut iov = [IoSliceMut::new(buf)];
        match recvmsg::<()>(sock.as_fd().as_raw_fd(), &mut iov, Some(&mut cmsg_space), MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(msg) => {
                let mut fds = Vec::new();
                for c in msg.cmsgs().map_err(ProtoError::Recv)? {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        for fd in raw {
                            // SAFETY: SCM_RIGHTS just installed `fd` in our table;
                            // nothing else owns it.
                            fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                        }
                    }
                }
                if msg.flags.contains(MsgFlags::MSG_TRUNC) {
                    return Err(ProtoError::Truncated);
                }
                break (msg.bytes, fds);
            }
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(ProtoError::Recv(e)),
        }
    };
    if len == 0 {
        return Err(ProtoError::Closed);
    }
    let msg = serde_json::from_slice(&buf[..len]).map_err(ProtoError::Decode)?;
    Ok((msg, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    use std::io::{Read, Write};

    #[test]
    fn message_and_fds_round_trip() {
        let (a, b) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap();
        let (r, w) = nix::unistd::pipe().unwrap();
        let req = ShimRequest::Signal { id: 7, signal: 9, group: true };
        send(&a, &req, &[w.as_raw_fd()]).unwrap();
        drop(w);
        let (got, mut fds): (ShimRequest, _) = recv(&b).unwrap();
        assert_eq!(got, req);
        assert_eq!(fds.len(), 1);
        let mut w2 = std::fs::File::from(fds.pop().unwrap());
        w2.write_all(b"hi").unwrap();
        drop(w2);
        let mut s = String::new();
        std::fs::File::from(r).read_to_string(&mut s).unwrap();
        assert_eq!(s, "hi");
        drop(a);
        assert!(matches!(recv::<ShimEvent>(&b), Err(ProtoError::Closed)));
    }

    #[test]
    fn messages_up_to_the_largest_arrive_and_a_larger_one_is_refused_alone() {
        let (a, b) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap();
        // The socket must take a message past MAX_MESSAGE (the kernel caps
        // this at twice net.core.wmem_max); the sender blocks until the
        // receiver below has taken the earlier ones.
        nix::sys::socket::setsockopt(&a, nix::sys::socket::sockopt::SndBuf, &(4 * MAX_MESSAGE)).unwrap();
        let sender = std::thread::spawn(move || {
            for n in [MAX_MESSAGE, MAX_MESSAGE + 1, 3] {
                // A JSON string of exactly n bytes.
                let msg = format!("\"{}\"", "x".repeat(n - 2));
                nix::sys::socket::send(a.as_raw_fd(), msg.as_bytes(), MsgFlags::empty()).unwrap();
            }
        });
        let (got, _): (String, _) = recv(&b).unwrap();
        assert_eq!(got.len(), MAX_MESSAGE - 2);
        assert!(matches!(recv::<String>(&b), Err(ProtoError::Truncated)));
        let (got, _): (String, _) = recv(&b).unwrap();
        assert_eq!(got, "x");
        sender.join().unwrap();
    }

    #[test]
    fn exit_status_shell_code() {
        assert_eq!(ExitStatus::Code(3).shell_code(), 3);
        assert_eq!(ExitStatus::Signal(9).shell_code(), 137);
    }
}
