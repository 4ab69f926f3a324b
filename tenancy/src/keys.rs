//! API keys: `tsk_<key_id>_<secret>`.
//!
//! `key_id` is 16 lowercase hex chars (public, used to find the key's row);
//! `secret` is 64 lowercase hex chars (256 bits). The store keeps only
//! `sha256("tessera-key-v1:" + key_id + ":" + secret)`, and the check compares
//! digests in constant time ([`subtle`]).

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Prefix of every key.
pub const PREFIX: &str = "tsk_";
const KEY_ID_HEX: usize = 16;
const SECRET_HEX: usize = 64;

/// Why a presented key string is not a well-formed key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// Not of the form `tsk_<key_id>_<secret>`.
    #[error("API key is malformed (expected tsk_<key_id>_<secret>)")]
    Malformed,
}

/// A parsed (not yet verified) key.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey {
    key_id: String,
    secret: String,
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKey")
            .field("key_id", &self.key_id)
            .field("secret", &"<redacted>")
            .finish()
    }
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl ApiKey {
    /// A fresh random key.
    pub fn generate() -> Self {
        Self {
            key_id: crate::random_hex(KEY_ID_HEX / 2),
            secret: crate::random_hex(SECRET_HEX / 2),
        }
    }

    /// Parses `tsk_<key_id>_<secret>`.
    pub fn parse(s: &str) -> Result<Self, KeyError> {
        let rest = s.strip_prefix(PREFIX).ok_or(KeyError::Malformed)?;
        let (key_id, secret) = rest.split_once('_').ok_or(KeyError::Malformed)?;
        if !is_hex(key_id, KEY_ID_HEX) || !is_hex(secret, SECRET_HEX) {
            return Err(KeyError::Malformed);
        }
        Ok(Self {
            key_id: key_id.into(),
            secret: secret.into(),
        })
    }

    /// The public key id.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The full key string (show it once, to its owner).
    pub fn expose(&self) -> String {
        format!("{PREFIX}{}_{}", self.key_id, self.secret)
    }

    /// Hex SHA-256 digest stored for this key.
    pub fn digest_hex(&self) -> String {
        digest_hex(&self.key_id, &self.secret)
    }

    /// Whether this key's digest equals `stored_hex`, compared in constant time.
    pub fn verify(&self, stored_hex: &str) -> bool {
        let mine = self.digest_hex();
        mine.as_bytes().ct_eq(stored_hex.as_bytes()).into()
    }
}

/// One permission a key can carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Generation and model listing (`ai/run`, chat/completions, completions, models).
    Inference,
    /// The tenant's own usage report (`ai/usage`) and the dashboard (`/dash/`).
    UsageRead,
    /// Creating and revoking the tenant's keys on the dashboard (only keys within
    /// the key's own scopes and expiry). Never given by default: a key gets it
    /// only when it is named.
    KeysWrite,
    /// Uploading and deleting the tenant's LoRA fine-tunes (`ai/finetunes`). Never
    /// given by default.
    FinetunesWrite,
}

impl Scope {
    /// Every scope, in display order.
    pub const ALL: [Scope; 4] = [
        Scope::Inference,
        Scope::UsageRead,
        Scope::KeysWrite,
        Scope::FinetunesWrite,
    ];

    /// Stable spelling (`inference`, `usage:read`, `keys:write`, `finetunes:write`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Inference => "inference",
            Self::UsageRead => "usage:read",
            Self::KeysWrite => "keys:write",
            Self::FinetunesWrite => "finetunes:write",
        }
    }

    fn bit(self) -> u8 {
        match self {
            Self::Inference => 1,
            Self::UsageRead => 2,
            Self::KeysWrite => 4,
            Self::FinetunesWrite => 8,
        }
    }
}

fn known() -> String {
    Scope::ALL.map(Scope::as_str).join(", ")
}

/// A key's set of scopes (never empty when made by [`Scopes::parse`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Scopes(u8);

impl Scopes {
    /// `inference` and `usage:read`: what a key gets when none are named.
    pub const DEFAULT: Scopes = Scopes(3);
    /// Every scope (the first-start key's: the account owner's).
    pub const ALL: Scopes = Scopes(15);

    /// Parses scope names separated by spaces or commas (`"inference usage:read"`).
    /// Errors name the unknown scope; an empty list is an error.
    pub fn parse(s: &str) -> Result<Self, String> {
        Self::from_names(s.split([' ', ',']).filter(|p| !p.is_empty()))
    }

    /// Scopes from their names (see [`Scope::as_str`]).
    pub fn from_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Self, String> {
        let mut bits = 0;
        for n in names {
            let sc = Scope::ALL
                .into_iter()
                .find(|s| s.as_str() == n)
                .ok_or_else(|| format!("unknown scope `{n}` (known: {})", known()))?;
            bits |= sc.bit();
        }
        if bits == 0 {
            return Err(format!("a key needs at least one scope ({})", known()));
        }
        Ok(Self(bits))
    }

    /// Whether `s` is in the set.
    pub fn contains(self, s: Scope) -> bool {
        self.0 & s.bit() != 0
    }

    /// The names, in [`Scope::ALL`] order.
    pub fn names(self) -> Vec<&'static str> {
        Scope::ALL
            .into_iter()
            .filter(|s| self.contains(*s))
            .map(Scope::as_str)
            .collect()
    }
}

impl std::fmt::Display for Scopes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.names().join(" "))
    }
}

impl std::fmt::Debug for Scopes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Scopes({self})")
    }
}

impl serde::Serialize for Scopes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let names = self.names();
        let mut seq = s.serialize_seq(Some(names.len()))?;
        for n in names {
            seq.serialize_element(n)?;
        }
        seq.end()
    }
}

fn digest_hex(key_id: &str, secret: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"tessera-key-v1:");
    h.update(key_id.as_bytes());
    h.update(b":");
    h.update(secret.as_bytes());
    crate::hex(&h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generate_parse_roundtrip_and_verify() {
        let k = ApiKey::generate();
        let s = k.expose();
        assert!(s.starts_with("tsk_"));
        assert_eq!(s.len(), 4 + 16 + 1 + 64);
        let p = ApiKey::parse(&s).unwrap();
        assert_eq!(p, k);
        assert!(p.verify(&k.digest_hex()));
        let other = ApiKey::generate();
        assert!(!p.verify(&other.digest_hex()));
        assert!(!format!("{p:?}").contains(&s[21..]));
    }

    #[test]
    fn scopes_parse_and_print() {
        let all = Scopes::parse("inference usage:read").unwrap();
        assert_eq!(all, Scopes::DEFAULT);
        assert_eq!(Scopes::parse("usage:read,inference").unwrap(), all);
        let owner = Scopes::parse("keys:write inference finetunes:write usage:read").unwrap();
        assert_eq!(owner, Scopes::ALL);
        assert_eq!(
            owner.to_string(),
            "inference usage:read keys:write finetunes:write"
        );
        assert!(!all.contains(Scope::KeysWrite) && owner.contains(Scope::KeysWrite));
        let u = Scopes::parse("usage:read").unwrap();
        assert!(u.contains(Scope::UsageRead) && !u.contains(Scope::Inference));
        assert_eq!(u.to_string(), "usage:read");
        assert_eq!(all.to_string(), "inference usage:read");
        assert_eq!(serde_json::to_string(&u).unwrap(), r#"["usage:read"]"#);
        assert!(Scopes::parse("")
            .unwrap_err()
            .contains("at least one scope"));
        let unknown = Scopes::parse("inference admin").unwrap_err();
        assert!(
            unknown.contains("`admin`") && unknown.contains("keys:write"),
            "{unknown}"
        );
    }

    #[test]
    fn malformed_keys() {
        for s in [
            "",
            "tsk_",
            "sk-abc",
            "tsk_0123456789abcdef",
            "tsk_0123456789abcdeg_00000000000000000000000000000000000000000000000000000000000000aa",
            "tsk_0123456789ABCDEF_00000000000000000000000000000000000000000000000000000000000000aa",
            "tsk_0123456789abcdef_00",
        ] {
            assert_eq!(ApiKey::parse(s), Err(KeyError::Malformed), "{s}");
        }
    }
}
