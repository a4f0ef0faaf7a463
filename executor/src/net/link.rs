//! Links, addresses and routes over rtnetlink (the rust-netlink crates).
//!
//! A sandbox's link is a veth pair: the host end `stv<n>` stays in the
//! daemon's network namespace, the other end is made directly inside the
//! sandbox's (its shim's) as `eth0`. Both ends get one address of a routed
//! /31 (RFC 3021): no bridge, so no layer 2 between sandboxes; every packet
//! a sandbox sends is routed by the host, through Strata's nft table.
//!
//! rtnetlink is async; each call here runs on a short-lived thread with a
//! current-thread tokio runtime of its own. That thread is also the one
//! that enters the sandbox's namespace (`setns` changes only the calling
//! thread), so no thread of the daemon's runtimes ever leaves the host's.

use std::net::Ipv4Addr;
use std::os::fd::{AsFd, OwnedFd};

use futures_util::TryStreamExt;
use nix::sched::CloneFlags;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::link::{InfoData, InfoVeth, LinkAttribute};
use rtnetlink::{Handle, LinkUnspec, LinkVeth, RouteMessageBuilder};

/// The sandbox end's name, inside its own namespace.
pub const SANDBOX_IF: &str = "eth0";

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("{step}")]
    Io {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{step}")]
    Netns {
        step: &'static str,
        #[source]
        source: nix::Error,
    },
    #[error("{step}")]
    Netlink {
        step: &'static str,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("link {0} not found")]
    NotFound(String),
    #[error("the netlink thread panicked")]
    Panicked,
}

/// A veth to make: the host end's name and the /31's two addresses.
#[derive(Debug, Clone)]
pub struct Veth {
    pub host: String,
    pub gateway: Ipv4Addr,
    pub address: Ipv4Addr,
}

fn netlink(step: &'static str) -> impl FnOnce(rtnetlink::Error) -> LinkError {
    move |source| LinkError::Netlink { step, source }
}

fn io(step: &'static str) -> impl FnOnce(std::io::Error) -> LinkError {
    move |source| LinkError::Io { step, source }
}

fn netns(step: &'static str) -> impl FnOnce(nix::Error) -> LinkError {
    move |source| LinkError::Netns { step, source }
}

/// Run `f` on a thread of its own with a current-thread runtime.
fn on_thread<T: Send + 'static>(
    f: impl FnOnce(&tokio::runtime::Runtime) -> Result<T, LinkError> + Send + 'static,
) -> Result<T, LinkError> {
    spawn_thread(f)?.wait()
}

/// Work on a netlink thread of its own, going on while the caller does
/// something else; [`Pending::wait`] for its result.
pub struct Pending<T>(std::thread::JoinHandle<Result<T, LinkError>>);

impl<T> Pending<T> {
    pub fn wait(self) -> Result<T, LinkError> {
        self.0.join().map_err(|_| LinkError::Panicked)?
    }
}

fn spawn_thread<T: Send + 'static>(
    f: impl FnOnce(&tokio::runtime::Runtime) -> Result<T, LinkError> + Send + 'static,
) -> Result<Pending<T>, LinkError> {
    let worker = std::thread::Builder::new()
        .name("netlink".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_io().build().map_err(io("start runtime"))?;
            f(&rt)
        })
        .map_err(io("spawn netlink thread"))?;
    Ok(Pending(worker))
}

/// A connection in the calling thread's network namespace.
fn connect() -> Result<Handle, LinkError> {
    let (conn, handle, _) = rtnetlink::new_connection().map_err(io("open netlink socket"))?;
    tokio::spawn(conn);
    Ok(handle)
}

async fn index_of(handle: &Handle, name: &str) -> Result<u32, LinkError> {
    let mut links = handle.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(l)) => Ok(l.header.index),
        Ok(None) => Err(LinkError::NotFound(name.to_string())),
        // The kernel answers a name it does not know with ENODEV.
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => {
            Err(LinkError::NotFound(name.to_string()))
        }
        Err(e) => Err(netlink("look up link")(e)),
    }
}

/// Give a link its /31 address and bring it up.
async fn address_and_up(handle: &Handle, name: &str, ip: Ipv4Addr) -> Result<u32, LinkError> {
    let index = index_of(handle, name).await?;
    let mut add = handle.address().add(index, ip.into(), 31);
    // rtnetlink gives an IPv4 address the broadcast of its prefix, which
    // in a /31 is the peer's address: the peer would be local here.
    add.message_mut().attributes.retain(|a| !matches!(a, AddressAttribute::Broadcast(_)));
    add.execute().await.map_err(netlink("add address"))?;
    handle
        .link()
        .set(LinkUnspec::new_with_index(index).up().build())
        .execute()
        .await
        .map_err(netlink("set link up"))?;
    Ok(index)
}

/// Make the veth of the sandbox whose shim `pidfd` names: host end
/// addressed and up here, `eth0` addressed and up there, with a default
/// route through the host end. A host end left by an earlier daemon under
/// the same name is replaced. Made on a thread of its own: the caller
/// waits for it when it needs it.
pub fn create(pidfd: &OwnedFd, veth: &Veth) -> Result<Pending<()>, LinkError> {
    let pidfd = pidfd.try_clone().map_err(io("duplicate pidfd"))?;
    let veth = veth.clone();
    spawn_thread(move |rt| {
        // The sandbox's namespace as a file descriptor (what the peer's
        // IFLA_NET_NS_FD takes), got by entering it through the pidfd.
        let host_ns: OwnedFd = std::fs::File::open("/proc/thread-self/ns/net").map_err(io("open own netns"))?.into();
        nix::sched::setns(pidfd.as_fd(), CloneFlags::CLONE_NEWNET).map_err(netns("enter the sandbox's netns"))?;
        let sandbox_ns = std::fs::File::open("/proc/thread-self/ns/net").map(OwnedFd::from);
        nix::sched::setns(host_ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(netns("return to the host's netns"))?;
        let sandbox_ns = sandbox_ns.map_err(io("open the sandbox's netns"))?;

        rt.block_on(async {
            let handle = connect()?;
            let make = || {
                let peer = LinkUnspec::new_with_name(SANDBOX_IF).setns_by_fd(sandbox_ns_raw(&sandbox_ns)).build();
                LinkVeth::new(&veth.host, SANDBOX_IF).set_info_data(InfoData::Veth(InfoVeth::Peer(peer))).build()
            };
            match handle.link().add(make()).execute().await {
                Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::EEXIST => {
                    delete_in(&handle, &veth.host).await?;
                    handle.link().add(make()).execute().await.map_err(netlink("create veth"))?;
                }
                r => r.map_err(netlink("create veth"))?,
            }
            address_and_up(&handle, &veth.host, veth.gateway).await
        })?;

        nix::sched::setns(sandbox_ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(netns("enter the sandbox's netns"))?;
        rt.block_on(async {
            let handle = connect()?;
            let index = address_and_up(&handle, SANDBOX_IF, veth.address).await?;
            let route = RouteMessageBuilder::<Ipv4Addr>::new().gateway(veth.gateway).output_interface(index).build();
            handle.route().add(route).execute().await.map_err(netlink("add default route"))
        })
    })
}

fn sandbox_ns_raw(fd: &OwnedFd) -> std::os::fd::RawFd {
    use std::os::fd::AsRawFd;
    fd.as_raw_fd()
}

async fn delete_in(handle: &Handle, name: &str) -> Result<bool, LinkError> {
    match index_of(handle, name).await {
        Ok(index) => match handle.link().del(index).execute().await {
            Ok(()) => Ok(true),
            // Gone meanwhile (its sandbox's namespace went).
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => Ok(false),
            Err(e) => Err(netlink("delete link")(e)),
        },
        Err(LinkError::NotFound(_)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Delete a host end (its peer goes with it); whether it was there.
pub fn delete(name: &str) -> Result<bool, LinkError> {
    let name = name.to_string();
    on_thread(move |rt| rt.block_on(async { delete_in(&connect()?, &name).await }))
}

/// Delete every link of this namespace named `prefix` and a number; the
/// names deleted.
pub fn sweep(prefix: &str) -> Result<Vec<String>, LinkError> {
    let prefix = prefix.to_string();
    on_thread(move |rt| {
        rt.block_on(async {
            let handle = connect()?;
            let mut names = Vec::new();
            let mut links = handle.link().get().execute();
            while let Some(l) = links.try_next().await.map_err(netlink("list links"))? {
                for a in &l.attributes {
                    if let LinkAttribute::IfName(n) = a {
                        let ours =
                            n.strip_prefix(prefix.as_str()).is_some_and(|r| r.bytes().all(|b| b.is_ascii_digit()));
                        if ours {
                            names.push(n.clone());
                        }
                    }
                }
            }
            let mut deleted = Vec::new();
            for n in names {
                if delete_in(&handle, &n).await? {
                    deleted.push(n);
                }
            }
            Ok(deleted)
        })
    })
}
