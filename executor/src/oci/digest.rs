//! `Digest`: a validated `sha256:<64 lower-case hex>` content address.
//!
//! Validation happens once, in `FromStr` (and so in `Deserialize`); every
//! other module can then join `hex()` onto a path without re-checking, because
//! the hex part can hold nothing but `[0-9a-f]`. Other algorithms (sha512,
//! blake3) are refused rather than half-supported.
#![forbid(unsafe_code)]

use std::str::FromStr;

use sha2::{Digest as _, Sha256};

const PREFIX: &str = "sha256:";
const HEX_LEN: usize = 64;
/// Longest digest text quoted back in an error; hostile input can be huge.
const SHOWN: usize = 100;

/// A sha256 content digest, always `sha256:` followed by 64 lower-case hex
/// characters.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Digest(String);

/// Why a string is not a `Digest`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DigestError {
    /// The algorithm part is missing or is not `sha256`.
    #[error("digest {digest:?} does not use the sha256 algorithm")]
    Algorithm { digest: String },
    /// The part after `sha256:` is not 64 lower-case hex characters.
    #[error("digest {digest:?} is not sha256: followed by 64 lower-case hex characters")]
    Hex { digest: String },
}

impl Digest {
    /// The digest of `data`.
    pub fn sha256(data: &[u8]) -> Self {
        Self::from_hasher(Sha256::new_with_prefix(data))
    }

    /// The digest of everything fed to `hasher`.
    pub fn from_hasher(hasher: Sha256) -> Self {
        Digest(format!("{PREFIX}{}", hex::encode(hasher.finalize())))
    }

    /// The 64 hex characters, safe to use as a file name.
    pub fn hex(&self) -> &str {
        &self.0[PREFIX.len()..]
    }

    /// The full `sha256:<hex>` form.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for Digest {
    type Err = DigestError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let shown = || s.chars().take(SHOWN).collect::<String>();
        let Some(hex) = s.strip_prefix(PREFIX) else {
            return Err(DigestError::Algorithm { digest: shown() });
        };
        let valid = hex.len() == HEX_LEN && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !valid {
            return Err(DigestError::Hex { digest: shown() });
        }
        Ok(Digest(s.to_owned()))
    }
}

impl From<&Digest> for oci_spec::image::Digest {
    fn from(d: &Digest) -> Self {
        // A `Digest` is a validated `sha256:<64 hex>`, which oci-spec accepts.
        d.as_str().parse().expect("a validated sha256 digest")
    }
}

// Display, serde and SQLite as its text; reading a malformed one fails.
crate::model::text_conversions!(Digest);

#[cfg(test)]
mod tests {
    use super::*;

    const EMPTY: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn computes_and_parses_sha256() {
        let d = Digest::sha256(b"");
        assert_eq!(d.as_str(), EMPTY);
        assert_eq!(d.hex(), &EMPTY[7..]);
        assert_eq!(EMPTY.parse::<Digest>(), Ok(d.clone()));
        assert_eq!(d.to_string(), EMPTY);
    }

    #[test]
    fn refuses_other_algorithms_and_bad_hex() {
        let bad_alg = ["sha512:abc", "e3b0c442", "", "SHA256:e3b0"];
        for s in bad_alg {
            assert!(matches!(s.parse::<Digest>(), Err(DigestError::Algorithm { .. })), "{s}");
        }
        let upper = EMPTY.to_uppercase().replace("SHA256", "sha256");
        let short = &EMPTY[..EMPTY.len() - 1];
        let long = format!("{EMPTY}0");
        let traversal = format!("sha256:../../../../etc/passwd{}", "0".repeat(36));
        for s in [upper.as_str(), short, long.as_str(), traversal.as_str(), "sha256:"] {
            assert!(matches!(s.parse::<Digest>(), Err(DigestError::Hex { .. })), "{s}");
        }
    }

    #[test]
    fn error_quotes_at_most_a_prefix() {
        let huge = format!("sha256:{}", "z".repeat(10_000));
        let msg = huge.parse::<Digest>().unwrap_err().to_string();
        assert!(msg.len() < 200, "{msg}");
    }

    #[test]
    fn serde_round_trips_as_a_string() {
        let d: Digest = EMPTY.parse().unwrap();
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(json, format!("\"{EMPTY}\""));
        assert_eq!(serde_json::from_str::<Digest>(&json).unwrap(), d);
        assert!(serde_json::from_str::<Digest>("\"sha256:00\"").is_err());
    }
}
