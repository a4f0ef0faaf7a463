//! A sandbox's network as its spec keeps it: the mode, the egress policy
//! and the address it was given. Parsed and checked here, without I/O, so
//! a bad rule is refused (400) before anything is made.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// Entries one list may hold: every entry is an nft set element or a
/// pattern the resolver compares each answer with.
pub const MAX_RULES: usize = 256;

/// `none`: loopback only (the native API's default). `egress`: a veth to
/// the host, an address, a default route, the daemon's resolver, NAT out,
/// under [`Policy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    #[default]
    None,
    Egress,
}

impl std::str::FromStr for NetworkMode {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Self, PolicyError> {
        match s {
            "none" => Ok(NetworkMode::None),
            "egress" => Ok(NetworkMode::Egress),
            other => Err(PolicyError::Mode(other.to_string())),
        }
    }
}

/// The network part of a sandbox's spec.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct NetworkSpec {
    #[serde(default)]
    pub mode: NetworkMode,
    #[serde(default)]
    pub policy: Policy,
    /// Its address (`egress`), given at launch: the host end of its veth
    /// is the one below it (a routed /31).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<Ipv4Addr>,
}

/// What a sandbox may reach beyond what is always denied. As E2B defines
/// it: an allowed destination wins over a denied one; no lists, everything
/// (but the always-denied) is allowed.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// CIDRs, addresses and domain names (`*.` wildcards: any name below).
    #[serde(default)]
    pub allow_out: Vec<Target>,
    /// CIDRs and addresses.
    #[serde(default)]
    pub deny_out: Vec<Cidr>,
}

/// An IPv4 network: its address with the host bits cleared, and its prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

/// An `allow_out` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Cidr(Cidr),
    Domain(Domain),
}

/// A domain rule: `example.com` (that name) or `*.example.com` (any name
/// below it, not the name itself). Lowercase, no trailing dot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Domain {
    pub wildcard: bool,
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("network {0:?}: use none or egress")]
    Mode(String),
    #[error("{0:?} is not an IPv4 address, CIDR or domain name")]
    Target(String),
    #[error("{0:?} is not an IPv4 address or CIDR (deny_out takes no domain names)")]
    Cidr(String),
    #[error("{0:?} is IPv6: sandboxes have IPv4 only (IPv6 is always denied)")]
    Ipv6(String),
    #[error("{list} has {len} entries; at most {MAX_RULES}")]
    TooMany { list: &'static str, len: usize },
    #[error("a network policy needs network egress")]
    PolicyWithoutEgress,
}

impl Cidr {
    pub const ALL: Cidr = Cidr { addr: Ipv4Addr::UNSPECIFIED, prefix: 0 };

    pub fn new(addr: Ipv4Addr, prefix: u8) -> Cidr {
        let prefix = prefix.min(32);
        Cidr { addr: Ipv4Addr::from(u32::from(addr) & Self::mask(prefix)), prefix }
    }

    fn mask(prefix: u8) -> u32 {
        match prefix {
            0 => 0,
            p => u32::MAX << (32 - u32::from(p.min(32))),
        }
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & Self::mask(self.prefix) == u32::from(self.addr)
    }

    /// How many addresses it holds.
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.prefix))
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl std::str::FromStr for Cidr {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Cidr, PolicyError> {
        let (ip, prefix) = match s.split_once('/') {
            Some((ip, p)) => (ip, Some(p)),
            None => (s, None),
        };
        if ip.parse::<std::net::Ipv6Addr>().is_ok() {
            return Err(PolicyError::Ipv6(s.to_string()));
        }
        let addr: Ipv4Addr = ip.parse().map_err(|_| PolicyError::Cidr(s.to_string()))?;
        let prefix = match prefix {
            None => 32,
            Some(p) if (1..=2).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()) => match p.parse::<u8>() {
                Ok(p) if p <= 32 => p,
                _ => return Err(PolicyError::Cidr(s.to_string())),
            },
            Some(_) => return Err(PolicyError::Cidr(s.to_string())),
        };
        Ok(Cidr::new(addr, prefix))
    }
}

impl Domain {
    /// Whether `name` (as asked, any case, trailing dot or not) is covered.
    pub fn matches(&self, name: &str) -> bool {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        if self.wildcard {
            name.len() > self.name.len() + 1
                && name.ends_with(self.name.as_str())
                && name.as_bytes()[name.len() - self.name.len() - 1] == b'.'
        } else {
            name == self.name
        }
    }
}

impl std::fmt::Display for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.wildcard {
            f.write_str("*.")?;
        }
        f.write_str(&self.name)
    }
}

/// A host name of letters, digits and hyphens in dot-separated labels of
/// 1-63, 253 in all.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
        // A name that parses as a number is an address someone mistyped.
        && !name.split('.').all(|l| l.bytes().all(|b| b.is_ascii_digit()))
}

impl std::str::FromStr for Target {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Target, PolicyError> {
        match s.parse::<Cidr>() {
            Ok(c) => return Ok(Target::Cidr(c)),
            Err(e @ PolicyError::Ipv6(_)) => return Err(e),
            Err(_) => {}
        }
        let lower = s.trim_end_matches('.').to_ascii_lowercase();
        let (wildcard, name) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest.to_string()),
            None => (false, lower.clone()),
        };
        if !valid_name(&name) {
            return Err(PolicyError::Target(s.to_string()));
        }
        Ok(Target::Domain(Domain { wildcard, name }))
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Cidr(c) => c.fmt(f),
            Target::Domain(d) => d.fmt(f),
        }
    }
}

macro_rules! string_serde {
    ($t:ty) => {
        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
string_serde!(Cidr);
string_serde!(Target);

impl Policy {
    /// Parse the lists as the API and the CLI give them.
    pub fn parse(allow_out: &[String], deny_out: &[String]) -> Result<Policy, PolicyError> {
        for (list, len) in [("allow_out", allow_out.len()), ("deny_out", deny_out.len())] {
            if len > MAX_RULES {
                return Err(PolicyError::TooMany { list, len });
            }
        }
        Ok(Policy {
            allow_out: allow_out.iter().map(|s| s.parse()).collect::<Result<_, _>>()?,
            deny_out: deny_out.iter().map(|s| s.parse()).collect::<Result<_, _>>()?,
        })
    }

    /// Bounds a deserialized policy (the API's body) the way [`Policy::parse`] does.
    pub fn check(&self) -> Result<(), PolicyError> {
        for (list, len) in [("allow_out", self.allow_out.len()), ("deny_out", self.deny_out.len())] {
            if len > MAX_RULES {
                return Err(PolicyError::TooMany { list, len });
            }
        }
        Ok(())
    }

    /// Whether it restricts nothing (E2B's default).
    pub fn is_open(&self) -> bool {
        self.deny_out.is_empty()
    }

    pub fn allowed_cidrs(&self) -> impl Iterator<Item = &Cidr> {
        self.allow_out.iter().filter_map(|t| match t {
            Target::Cidr(c) => Some(c),
            Target::Domain(_) => None,
        })
    }

    pub fn domains(&self) -> impl Iterator<Item = &Domain> {
        self.allow_out.iter().filter_map(|t| match t {
            Target::Domain(d) => Some(d),
            Target::Cidr(_) => None,
        })
    }

    /// Whether a DNS answer for `name` lets its addresses in.
    pub fn allows_name(&self, name: &str) -> bool {
        self.domains().any(|d| d.matches(name))
    }

    /// Whether every destination is denied but those allowed: then the
    /// resolver answers only names the policy allows (no DNS channel out).
    pub fn denies_all(&self) -> bool {
        self.deny_out.iter().any(|c| c.prefix == 0)
    }

    /// The verdict for a destination (the always-denied aside), as the
    /// nft chain decides it: allowed CIDRs, then denied ones, else allowed.
    /// Domain rules are decided by what was resolved, not here.
    pub fn allows(&self, ip: Ipv4Addr) -> bool {
        self.allowed_cidrs().any(|c| c.contains(ip)) || !self.deny_out.iter().any(|c| c.contains(ip))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_parse_normalised_and_refuse_ipv6_and_garbage() {
        assert_eq!("10.1.2.3/8".parse::<Cidr>().unwrap().to_string(), "10.0.0.0/8");
        assert_eq!("10.1.2.3".parse::<Cidr>().unwrap().to_string(), "10.1.2.3/32");
        assert_eq!("0.0.0.0/0".parse::<Cidr>().unwrap(), Cidr::ALL);
        for bad in ["10.0.0.0/33", "10.0.0/8", "10.0.0.0/", "10.0.0.0/+8", "example.com", ""] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
        assert!(matches!("::/0".parse::<Cidr>(), Err(PolicyError::Ipv6(_))));
        assert!(matches!("fd00:ec2::254".parse::<Target>(), Err(PolicyError::Ipv6(_))));
    }

    #[test]
    fn domains_match_themselves_or_what_is_below_a_wildcard() {
        let Ok(Target::Domain(d)) = "Example.COM.".parse::<Target>() else { panic!() };
        assert!(d.matches("example.com") && d.matches("EXAMPLE.com.") && !d.matches("a.example.com"));
        let Ok(Target::Domain(w)) = "*.example.com".parse::<Target>() else { panic!() };
        assert!(w.matches("a.example.com") && w.matches("a.b.example.com."));
        assert!(!w.matches("example.com") && !w.matches("badexample.com") && !w.matches("a.example.org"));
        for bad in ["*", "*.", "a..b", "-a.com", "a b.com", "1.2.3", "*.*.a.com", "http://a.com"] {
            assert!(bad.parse::<Target>().is_err(), "{bad}");
        }
    }

    #[test]
    fn allowed_wins_over_denied() {
        let p = Policy::parse(&["198.18.1.0/24".into(), "pypi.org".into()], &["0.0.0.0/0".into()]).unwrap();
        assert!(p.allows("198.18.1.7".parse().unwrap()));
        assert!(!p.allows("198.18.2.7".parse().unwrap()));
        assert!(p.denies_all() && !p.is_open());
        assert!(p.allows_name("PyPI.org") && !p.allows_name("evil.org"));
        let open = Policy::default();
        assert!(open.is_open() && open.allows("1.2.3.4".parse().unwrap()));
    }

    #[test]
    fn lists_are_bounded_and_round_trip_as_strings() {
        let many: Vec<String> = (0..=MAX_RULES).map(|i| format!("10.0.{}.{}", i / 256, i % 256)).collect();
        assert!(matches!(Policy::parse(&many, &[]), Err(PolicyError::TooMany { list: "allow_out", .. })));
        let p = Policy::parse(&["*.a.org".into(), "1.2.3.4".into()], &["10.0.0.0/8".into()]).unwrap();
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(json, serde_json::json!({"allow_out": ["*.a.org", "1.2.3.4/32"], "deny_out": ["10.0.0.0/8"]}));
        assert_eq!(serde_json::from_value::<Policy>(json).unwrap(), p);
        assert!(serde_json::from_value::<Policy>(serde_json::json!({"deny_out": ["a.org"]})).is_err());
    }
}
