//! The wire form of the protocol's messages: serde for [`DestPage`] (a transport
//! type without serde) inside them.

use crate::transport::DestPage;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tessera_kernels::PageTag;

#[derive(Serialize, Deserialize)]
#[serde(remote = "PageTag")]
struct PageTagWire {
    tenant: u64,
    seq: u64,
    epoch: u32,
    logical_block: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(remote = "DestPage")]
pub(super) struct DestPageWire {
    page: u32,
    #[serde(with = "PageTagWire")]
    tag: PageTag,
}

pub(super) mod dest_pages {
    use super::*;

    #[derive(Serialize, Deserialize)]
    struct Item(#[serde(with = "DestPageWire")] DestPage);

    pub(crate) fn serialize<S: Serializer>(v: &[DestPage], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(v.iter().map(|d| Item(*d)))
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<DestPage>, D::Error> {
        Ok(Vec::<Item>::deserialize(d)?
            .into_iter()
            .map(|i| i.0)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use crate::protocol::testkit::{dests, good, R};
    use crate::protocol::{CommitError, Msg, Refusal, RefusalKind, Role};

    #[test]
    fn messages_round_trip_through_json() {
        let msgs = [
            Msg::Descriptor {
                req: R,
                pages: dests(2),
            },
            Msg::Commit {
                req: R,
                tokens: 20,
                pages: good(&dests(2)),
                first_token: 42,
            },
            Msg::Rejected {
                req: R,
                by: Role::Prefill,
                reason: Refusal {
                    kind: RefusalKind::TooLarge,
                    message: "x".into(),
                },
            },
            Msg::CommitFailed {
                req: R,
                reason: CommitError::ChecksumMismatch {
                    page: 1,
                    expected: 2,
                    got: 3,
                },
            },
        ];
        for m in msgs {
            let json = serde_json::to_string(&m).unwrap();
            let back: Msg = serde_json::from_str(&json).unwrap();
            assert_eq!(back, m, "{json}");
        }
    }
}
