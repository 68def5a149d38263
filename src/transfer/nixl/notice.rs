//! The notifications the two sides exchange through NIXL: a prefill rank's report on one chunk
//! (sent with the chunk's transfer, so it arrives only once the bytes have landed; alone for a
//! chunk that moved nothing, or that failed), and the decode side's release of a bounce slot
//! and its receipt of a notice that went alone for a chunk that moved nothing (NIXL does not
//! confirm a lone notification, so the prefill's chunk completes on that receipt).
//!
//! A chunk into a decode context-parallel rank that went through a bounce slot as one dense
//! region carries, with its status, what the rank needs to unpack it ([`Dense`]).
//!
//! Each is a 5-byte header (magic `KVSN`, version) and a postcard-encoded [`Notice`]; anything
//! else in an agent's notification stream is refused, not guessed at. A chunk's notice carries
//! the rank's [`ChunkStatus`] as it is: the decode side hands it to its receiver untranslated.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::geometry::Component;
use crate::transfer::{ChunkResult, ChunkStatus};

const MAGIC: [u8; 4] = *b"KVSN";
/// Version 3: a chunk's notice carries its [`ChunkStatus`] as it is (a failure is a
/// [`Notice::Chunk`] too); version 4 adds [`Notice::Dense`].
const VERSION: u8 = 4;

/// A section of a chunk that went through a bounce slot: the decode side scatters entry `j` of
/// the slot's `components` into pool page `pages[j]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Bounced {
    /// The slot (of those the decode keeps for this rank).
    pub slot: u32,
    /// Components of the section ([`Component::ALL`] indices).
    pub components: Vec<u8>,
    /// Destination page of each packed entry, in entry order.
    pub pages: Vec<u64>,
}

/// A chunk's rows for one decode context-parallel rank, packed densely at the start of bounce
/// slot `slot` (docs/dcp.md, "Over NIXL"): the decode layout and the rank, the end of the
/// tokens moved, and per section its components and the sequence pages whose rows of the rank
/// it carries (in packing order). The rows land in the pages the request registered on the
/// decode side; it checks all of this against them and the slot before it unpacks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Dense {
    pub slot: u32,
    pub ranks: u32,
    pub interleave: u32,
    pub rank: u32,
    pub end_token: u64,
    /// Per section: its components ([`Component::ALL`] indices) and sequence pages.
    pub sections: Vec<(Vec<u8>, Vec<u64>)>,
}

/// One notification.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Notice {
    /// Prefill → decode: a rank's status of a chunk, as it is. Sent: its bytes have landed
    /// (sections not listed in `bounced` went straight into the pool's pages). Failed: the
    /// rank's last status for the request, with nothing bounced.
    Chunk {
        status: ChunkStatus,
        bounced: Vec<Bounced>,
    },
    /// Prefill → decode context-parallel rank: a rank's status of a chunk whose rows for the
    /// decode rank landed as one dense region in a bounce slot ([`Dense`]); always `Sent`.
    Dense { status: ChunkStatus, dense: Dense },
    /// Decode → prefill: the decode has scattered bounce slot `slot`; it may be written again.
    SlotFree { slot: u32 },
    /// Decode → prefill: the decode has taken the status of chunk `chunk` of `request`, a
    /// chunk that moved no bytes. Such a chunk travels as a notification alone, which NIXL
    /// does not confirm; the prefill's chunk completes on this (a rank that says goodbye right
    /// after its empty final chunk would otherwise lose it in flight).
    Taken { request: u64, chunk: u32 },
}

/// The index of `c` in [`Component::ALL`].
pub(crate) fn component_code(c: Component) -> u8 {
    Component::ALL.iter().position(|&x| x == c).unwrap_or(0) as u8
}

/// The component of a [`component_code`].
pub(crate) fn component_of(code: u8) -> Result<Component> {
    Component::ALL
        .get(code as usize)
        .copied()
        .ok_or_else(|| Error::InvalidArgument(format!("component code {code} in a notice")))
}

impl Notice {
    /// The notification's bytes.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut head = MAGIC.to_vec();
        head.push(VERSION);
        postcard::to_extend(self, head)
            .map_err(|e| Error::InvalidArgument(format!("cannot encode a NIXL notice: {e}")))
    }

    /// Parses one notification: exactly one notice of this version, no trailing bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = |why: String| Error::Nixl {
            call: "notification",
            reason: why,
        };
        let (head, body) = bytes
            .split_at_checked(5)
            .ok_or_else(|| bad(format!("{} bytes: too short", bytes.len())))?;
        if head[..4] != MAGIC || head[4] != VERSION {
            return Err(bad(format!("header {head:02x?} is not a kvshard notice")));
        }
        let (notice, rest) =
            postcard::take_from_bytes::<Notice>(body).map_err(|e| bad(e.to_string()))?;
        if !rest.is_empty() {
            return Err(bad(format!("{} trailing bytes", rest.len())));
        }
        if let Notice::Chunk {
            status:
                ChunkStatus {
                    result: ChunkResult::Failed { .. },
                    ..
                },
            bounced,
        } = &notice
        {
            if !bounced.is_empty() {
                return Err(bad("a failed chunk with bounced sections".into()));
            }
        }
        if let Notice::Dense {
            status:
                ChunkStatus {
                    result: ChunkResult::Failed { .. },
                    ..
                },
            ..
        } = &notice
        {
            return Err(bad("a failed chunk with a dense region".into()));
        }
        Ok(notice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip_and_garbage_is_refused() {
        let mut bytes = crate::transfer::ComponentBytes::default();
        bytes.add(Component::DraftLatent, 7);
        let status = ChunkStatus {
            request: 3,
            rank: 1,
            chunk: 2,
            result: ChunkResult::Sent { bytes, last: true },
        };
        let bounced = vec![Bounced {
            slot: 1,
            components: vec![component_code(Component::TargetLatent)],
            pages: vec![5, 9, 1 << 40],
        }];
        let n = Notice::Chunk {
            status: status.clone(),
            bounced: bounced.clone(),
        };
        assert_eq!(Notice::decode(&n.encode().unwrap()).unwrap(), n);
        let free = Notice::SlotFree { slot: 3 };
        assert_eq!(Notice::decode(&free.encode().unwrap()).unwrap(), free);
        let taken = Notice::Taken {
            request: 3,
            chunk: 2,
        };
        assert_eq!(Notice::decode(&taken.encode().unwrap()).unwrap(), taken);
        let failed = ChunkStatus {
            result: ChunkResult::Failed {
                reason: "no".into(),
            },
            ..status
        };
        let n = Notice::Chunk {
            status: failed.clone(),
            bounced: Vec::new(),
        };
        assert_eq!(Notice::decode(&n.encode().unwrap()).unwrap(), n);
        let n = Notice::Chunk {
            status: failed,
            bounced,
        };
        assert!(Notice::decode(&n.encode().unwrap()).is_err());

        let dense = Notice::Dense {
            status: status.clone(),
            dense: Dense {
                slot: 1,
                ranks: 4,
                interleave: 64,
                rank: 3,
                end_token: 900,
                sections: vec![(vec![0, 1], vec![3, 7])],
            },
        };
        assert_eq!(Notice::decode(&dense.encode().unwrap()).unwrap(), dense);
        if let Notice::Dense { dense, .. } = dense {
            let failed = Notice::Dense {
                status: ChunkStatus {
                    result: ChunkResult::Failed {
                        reason: "no".into(),
                    },
                    ..status.clone()
                },
                dense,
            };
            assert!(Notice::decode(&failed.encode().unwrap()).is_err());
        }
        assert!(Notice::decode(b"KVS").is_err());
        assert!(Notice::decode(b"HELLO WORLD").is_err());
        let mut trailing = free.encode().unwrap();
        trailing.push(0);
        assert!(Notice::decode(&trailing).is_err());
        assert_eq!(
            component_of(component_code(Component::DraftIndexer)).unwrap(),
            Component::DraftIndexer
        );
        assert!(component_of(9).is_err());
    }
}
