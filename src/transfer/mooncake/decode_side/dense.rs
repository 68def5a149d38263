//! A decode context-parallel rank's side of the Mooncake route (docs/dcp.md, "Mooncake"): its
//! share of each request ([`MooncakeReceiver::register_decode`]), and the checked unpacking of
//! each dense region a prefill rank bounced to it.

use std::time::Duration;

use super::MooncakeReceiver;
use crate::backend::Event;
use crate::copy::ScatterRank;
use crate::error::{Error, Result};
use crate::shard::DecodeLayout;
use crate::transfer::mooncake::frames::{component_of, WireDense};
use crate::transfer::{ChunkResult, ChunkStatus, DecodeRegistration, DenseChunk, DenseSection};

/// Whether `status` says the chunk moved rows (a decode context-parallel rank's rows travel
/// only in a dense region, so such a status must carry one).
pub(super) fn moved_rows(status: &ChunkStatus) -> bool {
    matches!(&status.result, ChunkResult::Sent { bytes, .. } if bytes.total() > 0)
}

/// This decode rank's share of a decode context-parallel request: where its rows may land.
#[derive(Debug)]
pub(super) struct DenseShare {
    layout: DecodeLayout,
    rank: u32,
    pages: ScatterRank,
}

impl MooncakeReceiver {
    /// Starts receiving this decode rank's share (`rank`) of a decode context-parallel request
    /// from every prefill rank, due `deadline` from now (the receiver's otherwise): its chunks
    /// arrive densely packed (module docs). The prefill ranks get the registration from the
    /// engine (`MooncakeSender::open_decode`): nothing is sent. Refused, changing nothing, when
    /// the registration does not validate, `rank` is not one of its layout, or a prefill rank has
    /// not joined yet.
    pub fn register_decode(
        &mut self,
        registration: &DecodeRegistration,
        rank: u32,
        deadline: Option<Duration>,
    ) -> Result<()> {
        let request = registration.request;
        self.check_joined(request)?;
        registration.validate()?;
        let share = registration.rank(rank)?;
        let pages = ScatterRank {
            pages: share.pages.clone(),
            state_pages: share.state_pages.clone(),
        };
        self.receive(share, deadline)?;
        self.shares.insert(
            request,
            DenseShare {
                layout: registration.layout,
                rank,
                pages,
            },
        );
        Ok(())
    }

    /// Enqueues the unpacking of a dense region `rank` bounced for `request` into this decode
    /// rank's pages of it, after checking the layout and the rank against its share and the
    /// region against the slot and the pages ([`DenseBounce::unpack`]).
    pub(super) fn unpack(&mut self, rank: u32, request: u64, d: &WireDense) -> Result<Event> {
        let share = self.shares.get(&request).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "a dense region for request {request}, which this side receives unsharded"
            ))
        })?;
        if (d.ranks, d.interleave, d.rank)
            != (share.layout.ranks(), share.layout.interleave(), share.rank)
        {
            return Err(Error::InvalidArgument(format!(
                "a region packed for decode rank {} of {} ranks interleaved by {}; this is rank {} of {}",
                d.rank, d.ranks, d.interleave, share.rank, share.layout
            )));
        }
        let sections = d
            .sections
            .iter()
            .map(|(codes, positions)| {
                let components = codes
                    .iter()
                    .map(|&c| {
                        component_of(c)
                            .ok_or_else(|| Error::InvalidArgument(format!("component code {c}")))
                    })
                    .collect::<Result<_>>()?;
                Ok(DenseSection {
                    components,
                    positions: positions.clone(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let chunk = DenseChunk {
            end_token: d.end_token,
            sections,
        };
        let region = self.ranks[rank as usize].buffers[d.slot as usize].buffer();
        self.dense.unpack(
            &chunk,
            share.layout,
            share.rank,
            region,
            &self.pool,
            &share.pages,
        )
    }
}
