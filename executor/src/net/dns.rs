//! The daemon's resolver for sandboxes: one UDP socket per sandbox on its
//! gateway address, port 53 (what its /etc/resolv.conf names), forwarding
//! to the host's upstream resolver.
//!
//! It is where domain rules are enforced (mitos's pattern): an answer for
//! a name the sandbox's policy allows puts the answer's IPv4 addresses into
//! that sandbox's nft set `d<n>` before the answer reaches it, so the
//! connection that follows the lookup passes. A TLS or HTTP flow is thus
//! matched by the address the sandbox resolved, not by SNI or `Host`: a
//! name that shares an address with another (a CDN) lets that address in.
//! Addresses stay allowed for the sandbox's life or until its policy
//! changes. With a policy that denies everything but what it allows, names
//! it does not allow are answered REFUSED, so DNS is no channel out.
//! The socket identifies the sandbox (it is bound to that sandbox's own
//! gateway, which only that sandbox's veth may send to: nft `i<n>`).

use std::net::{Ipv4Addr, SocketAddr, UdpSocket as StdUdpSocket};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::RData;
use hickory_proto::serialize::binary::BinEncodable;
use tokio::net::UdpSocket;

use super::policy::Policy;

/// Queries of one sandbox in flight at once; more are dropped (a client
/// retries).
const IN_FLIGHT: usize = 64;
/// How long the upstream has to answer.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(5);

/// What one sandbox's resolver task needs.
pub struct Context {
    pub slot: u32,
    pub table: String,
    pub upstream: SocketAddr,
    pub policy: Arc<RwLock<Policy>>,
}

/// The first `nameserver` of a resolv.conf, port 53.
pub fn upstream_from(resolv_conf: &str) -> Option<SocketAddr> {
    resolv_conf
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            (f.next() == Some("nameserver")).then(|| f.next()?.parse::<std::net::IpAddr>().ok()).flatten()
        })
        .map(|ip| SocketAddr::new(ip, 53))
}

/// Serve `socket` until the returned task is aborted.
pub fn serve(rt: &tokio::runtime::Handle, socket: StdUdpSocket, cx: Context) -> tokio::task::AbortHandle {
    let cx = Arc::new(cx);
    rt.spawn(async move {
        let Ok(socket) = UdpSocket::from_std(socket) else { return };
        let socket = Arc::new(socket);
        let slots = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
        let mut buf = vec![0u8; 4096];
        loop {
            let Ok((n, from)) = socket.recv_from(&mut buf).await else { continue };
            let Ok(permit) = slots.clone().try_acquire_owned() else { continue };
            let (socket, cx, query) = (socket.clone(), cx.clone(), buf[..n].to_vec());
            tokio::spawn(async move {
                if let Some(reply) = answer(&cx, &query).await {
                    let _ = socket.send_to(&reply, from).await;
                }
                drop(permit);
            });
        }
    })
    .abort_handle()
}

/// A REFUSED answer to `query`.
fn refused(query: &Message) -> Option<Vec<u8>> {
    let mut m = Message::new();
    m.set_id(query.id())
        .set_message_type(MessageType::Response)
        .set_op_code(query.op_code())
        .set_recursion_desired(query.recursion_desired())
        .set_recursion_available(true)
        .set_response_code(ResponseCode::Refused)
        .add_queries(query.queries().to_vec());
    m.to_bytes().ok()
}

/// The IPv4 addresses of an answer's A records.
pub fn addresses(answer: &Message) -> Vec<Ipv4Addr> {
    answer
        .answers()
        .iter()
        .filter_map(|r| match r.data() {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}

async fn answer(cx: &Context, query: &[u8]) -> Option<Vec<u8>> {
    let parsed = Message::from_vec(query).ok()?;
    if parsed.message_type() != MessageType::Query {
        return None;
    }
    let name = parsed.queries().first().map(|q| q.name().to_ascii()).unwrap_or_default();
    let (allowed, closed) = {
        let p = cx.policy.read().unwrap_or_else(|p| p.into_inner());
        (p.allows_name(&name), p.denies_all())
    };
    if closed && !allowed {
        return refused(&parsed);
    }
    let upstream = UdpSocket::bind(if cx.upstream.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }).await.ok()?;
    upstream.connect(cx.upstream).await.ok()?;
    upstream.send(query).await.ok()?;
    let mut buf = vec![0u8; 4096];
    let reply = loop {
        let n = tokio::time::timeout(UPSTREAM_TIMEOUT, upstream.recv(&mut buf)).await.ok()?.ok()?;
        if n >= 2 && buf[..2] == query[..2] {
            break buf[..n].to_vec();
        }
    };
    if allowed {
        let ips = Message::from_vec(&reply).map(|m| addresses(&m)).unwrap_or_default();
        if !ips.is_empty() {
            let script = super::nft::add_resolved(&cx.table, cx.slot, &ips);
            let added = tokio::task::spawn_blocking(move || super::nft::apply(&script)).await;
            match added {
                Ok(Ok(())) => tracing::debug!("network: {name} let in {ips:?} for slot {}", cx.slot),
                Ok(Err(e)) => tracing::warn!("network: let in {name} {ips:?}: {}", crate::error::chain(&e)),
                Err(_) => {}
            }
        }
    }
    Some(reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_is_the_first_nameserver() {
        let conf = "# x\nsearch a.test\nnameserver 198.18.0.2\nnameserver 1.1.1.1\n";
        assert_eq!(upstream_from(conf), Some("198.18.0.2:53".parse().unwrap()));
        assert_eq!(upstream_from("options ndots:1\n"), None);
    }
}
