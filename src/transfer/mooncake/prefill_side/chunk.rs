//! One chunk handed to the engine ([`MooncakeChunk`]): its descriptors, its packing's
//! readiness, the engine's report of it, its status (one per decode rank of a decode
//! context-parallel request) and the side channel's frames reporting it.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::{Outcome, Settle};
use crate::backend::{Backend, Event};
use crate::error::{Error, Result};
use crate::lock::lock;
use crate::shard::DecodeLayout;
use crate::transfer::mooncake::frames::{component_code, Bounced, Frame, WireDense, WireSection};
use crate::transfer::{
    ChunkResult, ChunkStatus, DenseChunk, PackedSection, PendingChunk, Posted, TransferStats,
};

/// A chunk as the engine moves it.
#[derive(Debug)]
pub(super) struct Export {
    pub(super) src: Vec<u64>,
    pub(super) dst: Vec<u64>,
    pub(super) lengths: Vec<u64>,
    pub(super) sections: Vec<PackedSection>,
    pub(super) packing: Option<Event>,
    pub(super) slot: Option<usize>,
    /// The decode rank each descriptor goes to (all 0 for an unsharded decode).
    pub(super) targets: Vec<u32>,
    /// Per decode rank of a decode context-parallel request, in rank order (empty otherwise).
    pub(super) parts: Vec<DecodePart>,
    /// The decode layout of a decode context-parallel request.
    pub(super) layout: Option<DecodeLayout>,
    pub(super) settle: Arc<Settle>,
    pub(super) prepared: Duration,
    pub(super) bytes: u64,
}

impl Export {
    /// A chunk of `bytes`, moving, with nothing handed out yet.
    pub(super) fn new(bytes: u64) -> Self {
        let settle = Arc::new(Settle {
            outcome: Mutex::new(Outcome::Moving),
            changed: Condvar::new(),
        });
        Self {
            src: Vec::new(),
            dst: Vec::new(),
            lengths: Vec::new(),
            sections: Vec::new(),
            packing: None,
            slot: None,
            targets: Vec::new(),
            parts: Vec::new(),
            layout: None,
            settle,
            prepared: Duration::ZERO,
            bytes,
        }
    }
}

/// One decode rank's part of a chunk into a decode context-parallel server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodePart {
    /// The sender's destination the rank is ([`MooncakeSender::add_destination`](super::MooncakeSender::add_destination)).
    pub destination: usize,
    /// The bounce slot (of the destination's) its region went through; `None` when the chunk
    /// moves no row to the rank.
    pub slot: Option<usize>,
    /// Bytes of its region (0 without a slot).
    pub bytes: u64,
    /// What the rank needs to unpack the region.
    pub dense: DenseChunk,
}

/// One chunk handed to the engine: post [`Self::src_addrs`] / [`Self::dst_addrs`] /
/// [`Self::lengths`] (a bounced one once [`Self::ready`]), count it [`Self::posted`], report it
/// [`Self::landed`] or [`Self::failed`], then [`Self::poll`] it (or wait) for the status to
/// deliver to the decode side, as every [`PendingChunk`]'s.
pub struct MooncakeChunk {
    pub(super) pending: Mutex<Option<PendingChunk>>,
    pub(super) export: Export,
    pub(super) request: u64,
    pub(super) rank: u32,
    pub(super) chunk: u32,
    pub(super) last: bool,
    pub(super) posted_once: Mutex<bool>,
    pub(super) stats: TransferStats,
    pub(super) backend: Arc<dyn Backend>,
}

impl std::fmt::Debug for MooncakeChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeChunk")
            .field("request", &self.request)
            .field("rank", &self.rank)
            .field("chunk", &self.chunk)
            .field("descriptors", &self.export.lengths.len())
            .field("slot", &self.export.slot)
            .finish_non_exhaustive()
    }
}

impl MooncakeChunk {
    /// Request id.
    pub fn request(&self) -> u64 {
        self.request
    }

    /// The sending rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Index of the chunk in the request's send order.
    pub fn chunk(&self) -> u32 {
        self.chunk
    }

    /// Whether it is the request's final chunk.
    pub fn is_last(&self) -> bool {
        self.last
    }

    /// Source addresses (this rank's memory, as the engine addresses it).
    pub fn src_addrs(&self) -> &[u64] {
        &self.export.src
    }

    /// Destination addresses (the decode's, as it published them).
    pub fn dst_addrs(&self) -> &[u64] {
        &self.export.dst
    }

    /// Lengths.
    pub fn lengths(&self) -> &[u64] {
        &self.export.lengths
    }

    /// The decode rank each descriptor goes to (its engine is the one to target): all 0 for
    /// an unsharded decode.
    pub fn targets(&self) -> &[u32] {
        &self.export.targets
    }

    /// Per decode rank of a decode context-parallel request, in rank order, its part of the
    /// chunk (empty for an unsharded decode). Each slot is freed as a bounced chunk's is
    /// ([`MooncakeSender::bounce_free_at`](super::MooncakeSender::bounce_free_at) of the part's destination): by its decode rank's free
    /// once unpacked, or by the caller once a failed chunk's transfer is over.
    pub fn decode_parts(&self) -> &[DecodePart] {
        &self.export.parts
    }

    /// Payload bytes (a bounced range adds at most 255 bytes of padding per component).
    pub fn bytes(&self) -> u64 {
        self.export.bytes
    }

    /// The bounce slot it was packed into (`None` unless bounced): its one descriptor targets
    /// the decode's buffer of that slot.
    pub fn slot(&self) -> Option<usize> {
        self.export.slot
    }

    /// The packed sections (empty unless bounced): what the decode scatters.
    pub fn sections(&self) -> &[PackedSection] {
        &self.export.sections
    }

    /// Whether the descriptors may be posted: the bounce packing has run (always, unbounced).
    /// Never blocks.
    pub fn ready(&self) -> Result<bool> {
        match &self.export.packing {
            Some(e) => self.backend.is_done(e),
            None => Ok(true),
        }
    }

    /// Counts the chunk as posted, once: `engine` is the time the engine's post took, added to
    /// kvshard's planning (and packing launch) time.
    pub fn posted(&self, engine: Duration) -> Result<()> {
        let mut once = lock(&self.posted_once);
        if *once {
            return Err(Error::InvalidArgument(
                "the chunk was already counted as posted".into(),
            ));
        }
        self.stats.posted(&Posted {
            bytes: self.export.bytes,
            descriptors: self.export.lengths.len() as u64,
            post_time: self.export.prepared.saturating_add(engine),
            bounced: self.export.packing.is_some(),
        });
        *once = true;
        Ok(())
    }

    fn settle(&self, outcome: Outcome) -> Result<()> {
        let mut o = lock(&self.export.settle.outcome);
        if !matches!(*o, Outcome::Moving) {
            return Err(Error::InvalidArgument(
                "the chunk's transfer was already reported".into(),
            ));
        }
        *o = outcome;
        self.export.settle.changed.notify_all();
        Ok(())
    }

    /// Reports the chunk's bytes landed, `took` after it was handed out. Once per chunk (a
    /// second report of either kind is refused).
    pub fn landed(&self, took: Duration) -> Result<()> {
        self.settle(Outcome::Landed(took))
    }

    /// Reports the chunk's transfer failed: [`Self::poll`] then fails with it.
    pub fn failed(&self, reason: impl Into<String>) -> Result<()> {
        self.settle(Outcome::Failed(reason.into()))
    }

    /// Whether the engine has reported the chunk (landed or failed).
    pub fn is_reported(&self) -> bool {
        !self.export.settle.is_moving()
    }

    /// The chunk's status once the engine reported it landed (`None` while it is moving); a
    /// failure (reported, or the transfer timeout passing first) is [`Error::ChunkFailed`].
    /// Never blocks.
    pub fn poll(&self) -> Result<Option<ChunkStatus>> {
        match lock(&self.pending).as_mut() {
            Some(p) => p.poll(),
            None => Err(Error::InvalidArgument(
                "the chunk was already waited for".into(),
            )),
        }
    }

    /// [`Self::poll`], with the status each decode rank receives, in rank order
    /// ([`PendingChunk::poll_each`]; one for an unsharded decode).
    pub fn poll_each(&self) -> Result<Option<Vec<ChunkStatus>>> {
        match lock(&self.pending).as_mut() {
            Some(p) => p.poll_each(),
            None => Err(Error::InvalidArgument(
                "the chunk was already waited for".into(),
            )),
        }
    }

    /// Blocks the host until the engine reports the chunk (at most the transfer timeout) and
    /// returns its status, once.
    pub fn wait_sync(&self) -> Result<ChunkStatus> {
        let pending = lock(&self.pending)
            .take()
            .ok_or_else(|| Error::InvalidArgument("the chunk was already waited for".into()))?;
        pending.wait_sync()
    }

    /// The side channel's report of `status` (this chunk's), naming the bounce slot and its
    /// sections when the chunk went bounced and landed.
    pub fn status_frame(&self, status: ChunkStatus) -> Frame {
        let bounced = match (self.export.slot, &status.result) {
            (Some(slot), crate::transfer::ChunkResult::Sent { .. }) => Some(Bounced {
                slot: slot as u32,
                sections: self
                    .export
                    .sections
                    .iter()
                    .map(|s| WireSection {
                        components: s.components.iter().map(|&c| component_code(c)).collect(),
                        pages: s.pages.iter().map(|p| p.0).collect(),
                    })
                    .collect(),
            }),
            _ => None,
        };
        Frame::Status { status, bounced }
    }

    /// The side channel's report to decode rank `decode_rank` of a decode context-parallel
    /// request of `status` (this chunk's, as [`Self::poll_each`] gave it for the rank): a
    /// [`Frame::DenseStatus`] naming the slot and how to unpack the region when the chunk
    /// moved rows to the rank and landed, a plain status otherwise.
    pub fn decode_status_frame(&self, decode_rank: u32, status: ChunkStatus) -> Result<Frame> {
        let part = self
            .export
            .parts
            .get(decode_rank as usize)
            .ok_or(Error::OutOfRange {
                what: "decode rank of the chunk",
                index: i64::from(decode_rank),
                limit: self.export.parts.len() as u64,
            })?;
        Ok(match (part.slot, &status.result) {
            (Some(slot), ChunkResult::Sent { .. }) => {
                let layout = self.export.layout.ok_or_else(|| {
                    Error::InvalidArgument("the chunk has no decode layout".into())
                })?;
                Frame::DenseStatus {
                    status,
                    dense: WireDense {
                        slot: slot as u32,
                        ranks: layout.ranks(),
                        interleave: layout.interleave(),
                        rank: decode_rank,
                        end_token: part.dense.end_token,
                        sections: part
                            .dense
                            .sections
                            .iter()
                            .map(|s| {
                                let codes = s.components.iter().map(|&c| component_code(c));
                                (codes.collect(), s.positions.clone())
                            })
                            .collect(),
                    },
                }
            }
            _ => Frame::Status {
                status,
                bounced: None,
            },
        })
    }
}
