//! E2B's network options on Strata's egress networking: the create body's
//! `allow_internet_access` and `network`, and `PUT /sandboxes/{id}/network`.
//!
//! - `allow_internet_access` (E2B's default: on) is an `egress` sandbox;
//!   `false` adds `0.0.0.0/0` to its denied list, as E2B defines it, so
//!   `allowOut` still opens what it names.
//! - `network.allowOut` / `denyOut` are the policy's lists (allowed wins);
//!   `dnsServers` are addresses let in (the sandbox's resolver is the
//!   daemon's whatever it says: those servers are only reachable).
//! - `network.allowPublicTraffic: false` gives the sandbox a traffic access
//!   token its port URLs need (`e2b-traffic-access-token`).
//! - Not served, refused by name: `egressProxy` (SOCKS upstream), `rules`
//!   (per-domain request transforms), `maskRequestHost`, `httpsPorts`.

use serde_json::{Map, Value};

use super::control::{ApiError, Result};
use crate::net::NetworkMode;
use crate::types::NetworkRequest;

/// Everything outside a sandbox, as E2B's `allow_internet_access: false`
/// and its SDK's `ALL_TRAFFIC` spell it.
pub const ALL_TRAFFIC: &str = "0.0.0.0/0";

/// What a create asked of the network.
#[derive(Debug, Default, PartialEq)]
pub struct Options {
    /// The Strata network request (`None`: no network, on a daemon without
    /// networking).
    pub request: Option<NetworkRequest>,
    /// Port URLs need the traffic access token.
    pub private: bool,
}

fn list(net: &Map<String, Value>, key: &str) -> Result<Vec<String>> {
    match net.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| ApiError::bad(format!("network.{key}: strings only")))
            })
            .collect(),
        Some(_) => Err(ApiError::bad(format!("network.{key} must be a list of strings"))),
    }
}

fn bool_of(b: &Map<String, Value>, keys: &[&str]) -> Result<Option<bool>> {
    for key in keys {
        match b.get(*key) {
            None | Some(Value::Null) => continue,
            Some(Value::Bool(v)) => return Ok(Some(*v)),
            Some(_) => return Err(ApiError::bad(format!("{key} must be true or false"))),
        }
    }
    Ok(None)
}

/// The egress lists of a `network` object (create or update), with the
/// fields Strata does not serve refused by name.
fn egress(net: &Map<String, Value>, also: &[&str]) -> Result<(Vec<String>, Vec<String>)> {
    for (key, v) in net {
        let unserved = match key.as_str() {
            "allowOut" | "denyOut" | "dnsServers" => None,
            k if also.contains(&k) => None,
            "egressProxy" => Some("an egress SOCKS proxy is not supported by Strata"),
            "rules" => Some("per-domain request rules are not supported by Strata"),
            "maskRequestHost" => Some("a host mask is not supported by Strata"),
            "httpsPorts" => Some("HTTPS to a sandbox's port is not supported by Strata"),
            _ => Some("unknown field"),
        };
        if let Some(why) = unserved.filter(|_| !v.is_null()) {
            return Err(ApiError::bad(format!("network.{key}: {why}")));
        }
    }
    let mut allow = list(net, "allowOut")?;
    allow.extend(list(net, "dnsServers")?);
    Ok((allow, list(net, "denyOut")?))
}

fn object<'a>(b: &'a Map<String, Value>, key: &str) -> Result<Option<&'a Map<String, Value>>> {
    match b.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(m)) => Ok(Some(m)),
        Some(_) => Err(ApiError::bad(format!("{key} must be an object"))),
    }
}

/// A create's network: `networked` says whether the daemon networks
/// sandboxes at all (`strata daemon --network on`).
pub fn create_options(b: &Map<String, Value>, networked: bool) -> Result<Options> {
    let internet = bool_of(b, &["allow_internet_access", "allowInternetAccess"])?;
    let empty = Map::new();
    let net = object(b, "network")?.unwrap_or(&empty);
    let (allow, mut deny) = egress(net, &["allowPublicTraffic"])?;
    let private = bool_of(net, &["allowPublicTraffic"])? == Some(false);
    if !networked {
        if internet == Some(true) || !allow.is_empty() || !deny.is_empty() {
            return Err(ApiError::bad(
                "allow_internet_access: this daemon gives sandboxes no network (start it with --network on)",
            ));
        }
        return Ok(Options { request: None, private });
    }
    if internet == Some(false) && !deny.iter().any(|d| d == ALL_TRAFFIC) {
        deny.push(ALL_TRAFFIC.to_string());
    }
    let request = NetworkRequest { mode: Some(NetworkMode::Egress), allow_out: allow, deny_out: deny };
    Ok(Options { request: Some(request), private })
}

/// `PUT /sandboxes/{id}/network`: the whole egress configuration,
/// replaced (what it leaves out is cleared, as E2B does).
pub fn update_request(b: &Map<String, Value>) -> Result<NetworkRequest> {
    let internet = bool_of(b, &["allow_internet_access", "allowInternetAccess"])?;
    let (allow, mut deny) = egress(b, &["allow_internet_access", "allowInternetAccess"])?;
    if internet == Some(false) && !deny.iter().any(|d| d == ALL_TRAFFIC) {
        deny.push(ALL_TRAFFIC.to_string());
    }
    Ok(NetworkRequest { mode: None, allow_out: allow, deny_out: deny })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn internet_access_is_on_by_default_and_off_denies_all_but_what_is_allowed() {
        let o = create_options(&map(json!({})), true).unwrap();
        assert_eq!(o.request.unwrap(), NetworkRequest { mode: Some(NetworkMode::Egress), ..Default::default() });
        let o = create_options(
            &map(json!({"allow_internet_access": false, "network": {"allowOut": ["1.2.3.4"], "allowPublicTraffic": false}})),
            true,
        )
        .unwrap();
        let r = o.request.unwrap();
        assert_eq!((r.allow_out, r.deny_out), (vec!["1.2.3.4".to_string()], vec![ALL_TRAFFIC.to_string()]));
        assert!(o.private);
        // Without networking: the default is no network, an explicit ask an error.
        assert_eq!(create_options(&map(json!({})), false).unwrap().request, None);
        assert!(create_options(&map(json!({"allow_internet_access": true})), false).is_err());
    }

    #[test]
    fn unserved_fields_are_refused_by_name() {
        for (field, body) in [
            ("network.egressProxy", json!({"network": {"egressProxy": {"address": "p:1080"}}})),
            ("network.rules", json!({"network": {"rules": {"a.test": []}}})),
            ("network.maskRequestHost", json!({"network": {"maskRequestHost": "${PORT}-x.test"}})),
            ("network.bogus", json!({"network": {"bogus": 1}})),
        ] {
            let e = create_options(&map(body), true).unwrap_err();
            assert!(e.message.starts_with(field), "{}", e.message);
        }
        let e = update_request(&map(json!({"allowPublicTraffic": false}))).unwrap_err();
        assert!(e.message.contains("allowPublicTraffic"), "{}", e.message);
        let r = update_request(&map(json!({"allowInternetAccess": false, "dnsServers": ["9.9.9.9"]}))).unwrap();
        assert_eq!((r.allow_out, r.deny_out), (vec!["9.9.9.9".to_string()], vec![ALL_TRAFFIC.to_string()]));
    }
}
