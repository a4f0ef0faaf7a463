//! Per-client bounds of the E2B listener: connections open and requests in
//! flight, by the client's source address. Without them one client (a
//! runaway loop, a leaked pool) could take every connection the listener
//! keeps ([`super::MAX_CONNECTIONS`]) and every worker, and lock the others
//! out. Past its connection cap a client's new connection is closed at once
//! (the SDK retries a refused connection); past its request cap a request
//! is answered 429.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Connections one client may keep open at once (`--e2b-client-connections`).
pub const DEFAULT_CONNECTIONS: usize = 256;
/// Requests one client may have in flight at once (`--e2b-client-requests`).
pub const DEFAULT_REQUESTS: usize = 64;

#[derive(Debug, Clone, Copy)]
pub struct ClientLimits {
    pub connections: usize,
    pub requests: usize,
}

impl Default for ClientLimits {
    fn default() -> Self {
        ClientLimits { connections: DEFAULT_CONNECTIONS, requests: DEFAULT_REQUESTS }
    }
}

#[derive(Default)]
struct Use {
    connections: usize,
    requests: usize,
    /// Whether a refusal was logged since its use last went to zero (one
    /// line per episode, not one per refused connection).
    warned: bool,
}

/// What each client has open, by address; an address with nothing open is
/// forgotten.
pub struct Clients {
    limits: ClientLimits,
    by_addr: Mutex<HashMap<IpAddr, Use>>,
}

/// Which of a client's bounds a held slot counts against.
#[derive(Clone, Copy, PartialEq)]
enum Slot {
    Connection,
    Request,
}

/// A connection or request of one client, counted until dropped.
pub struct Held {
    clients: Arc<Clients>,
    addr: IpAddr,
    slot: Slot,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut m = self.clients.by_addr.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(u) = m.get_mut(&self.addr) {
            match self.slot {
                Slot::Connection => u.connections = u.connections.saturating_sub(1),
                Slot::Request => u.requests = u.requests.saturating_sub(1),
            }
            if u.connections == 0 && u.requests == 0 {
                m.remove(&self.addr);
            }
        }
    }
}

impl Clients {
    pub fn new(limits: ClientLimits) -> Arc<Clients> {
        Arc::new(Clients { limits, by_addr: Mutex::new(HashMap::new()) })
    }

    /// A connection of `addr`, if it is under its cap.
    pub fn connection(self: &Arc<Self>, addr: IpAddr) -> Option<Held> {
        self.take(addr, Slot::Connection)
    }

    /// A request of `addr`, if it is under its cap.
    pub fn request(self: &Arc<Self>, addr: IpAddr) -> Option<Held> {
        self.take(addr, Slot::Request)
    }

    fn take(self: &Arc<Self>, addr: IpAddr, slot: Slot) -> Option<Held> {
        let mut m = self.by_addr.lock().unwrap_or_else(|p| p.into_inner());
        let u = m.entry(addr).or_default();
        let (count, cap, what) = match slot {
            Slot::Connection => (&mut u.connections, self.limits.connections, "connections open"),
            Slot::Request => (&mut u.requests, self.limits.requests, "requests in flight"),
        };
        if *count >= cap {
            if !u.warned {
                u.warned = true;
                tracing::warn!("e2b: client {addr} has {cap} {what}; refusing more (logged once while it stays there)");
            }
            return None;
        }
        *count += 1;
        Some(Held { clients: self.clone(), addr, slot })
    }

    /// Connections and requests `addr` holds now.
    pub fn holds(&self, addr: IpAddr) -> (usize, usize) {
        let m = self.by_addr.lock().unwrap_or_else(|p| p.into_inner());
        m.get(&addr).map_or((0, 0), |u| (u.connections, u.requests))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_client_has_its_own_caps_and_a_drop_gives_back() {
        let c = Clients::new(ClientLimits { connections: 2, requests: 1 });
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap());
        let a1 = c.connection(a).unwrap();
        let _a2 = c.connection(a).unwrap();
        assert!(c.connection(a).is_none(), "a third connection of a");
        let _b1 = c.connection(b).expect("b is not held back by a");
        let r = c.request(a).unwrap();
        assert!(c.request(a).is_none());
        assert!(c.request(b).is_some());
        drop(a1);
        assert!(c.connection(a).is_some());
        drop(r);
        assert_eq!(c.holds(a), (1, 0));
    }

    #[test]
    fn an_address_with_nothing_open_is_forgotten() {
        let c = Clients::new(ClientLimits::default());
        let a: IpAddr = "::1".parse().unwrap();
        drop(c.connection(a).unwrap());
        assert!(c.by_addr.lock().unwrap().is_empty());
    }
}
