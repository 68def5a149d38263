//! The prefill side's connection to its decode peer, behind the [`NixlTransport`]'s mutex:
//! the agent and the registered pool, the peer's prepared descriptor lists and the bounce slots
//! both sides keep, notifications both ways, and the requests given up on that NIXL may still
//! be moving. How a chunk goes through it is `chunks`.
//!
//! [`NixlTransport`]: super::NixlTransport

use std::collections::HashSet;
use std::sync::Arc;

use nixl_sys::{RegistrationHandle, XferRequest};

use super::agent::{Agent, Memory, Prepared, Progress};
use super::lists::ListLayout;
use super::notice::Notice;
use super::registration::{BounceSpace, NixlBackend};
use super::NixlConfig;
use crate::backend::Buffer;
use crate::copy::{BlockSpace, RemoteSpace, TableStore};
use crate::error::{Error, Result};
use crate::geometry::CacheGeometry;
use crate::ipc::wire::NixlPeer;
use crate::pool::DevicePool;
use crate::transfer::stats::TransferStats;

/// One bounce slot of the connection.
pub(super) struct Slot {
    pub(super) space: Arc<BounceSpace>,
    /// A chunk of this side is packing into it or moving out of it.
    pub(super) sending: bool,
    /// The decode side has not freed it yet.
    pub(super) remote_busy: bool,
}

/// The decode side this rank sends to.
pub(super) struct Peer {
    pub(super) agent: String,
    pub(super) remote: Arc<RemoteSpace>,
    /// Prepared lists (released before the registrations below).
    pub(super) local: Prepared,
    pub(super) remote_list: Prepared,
    pub(super) local_layout: ListLayout,
    pub(super) remote_layout: ListLayout,
    pub(super) slots: Vec<Slot>,
    /// Why the peer is gone, once it is.
    pub(super) gone: Option<String>,
    /// (request, chunk) of the notice-only chunks the peer has said it took ([`Notice::Taken`]).
    pub(super) taken: HashSet<(u64, u32)>,
    /// Deregistered before the buffer below is freed (fields drop in order).
    pub(super) _slot_registration: Option<RegistrationHandle>,
    pub(super) _slot_buffer: Option<Buffer>,
}

/// Everything behind the transport's mutex. Field order is drop order: requests and prepared
/// lists go before the registrations, and those before the agent.
pub(super) struct State {
    /// Requests given up on (failed while moving) that NIXL may still be moving, with their
    /// slots: released once NIXL is done with them, never while it may touch their memory.
    pub(super) zombies: Vec<(XferRequest, Option<usize>)>,
    pub(super) peer: Option<Peer>,
    pub(super) store: TableStore,
    pub(super) _pool_registrations: Vec<RegistrationHandle>,
    pub(super) agent: Agent,
    pub(super) device: NixlBackend,
    pub(super) pool: Arc<DevicePool>,
    pub(super) config: NixlConfig,
    pub(super) stats: TransferStats,
}

impl State {
    /// Closes the connection (if any): releases its lists and slots, then forgets the peer's
    /// agent. In that order: a prepared list of a peer refers to what NIXL holds of it, and
    /// releasing it after the peer was forgotten corrupts NIXL's heap.
    pub(super) fn disconnect(&mut self) {
        if let Some(p) = self.peer.take() {
            let agent = p.agent.clone();
            drop(p);
            self.agent.forget(&agent);
        }
    }

    pub(super) fn prepare(
        &mut self,
        name: &str,
        geometry: &CacheGeometry,
        peer: &NixlPeer,
        remote: Arc<RemoteSpace>,
        slot_pages: u64,
        nslots: usize,
    ) -> Result<Peer> {
        let components = geometry.components();
        let memory = self.device.memory();
        let backend = self.device.backend();
        let (slot_buffer, spaces, registration) = if nslots > 0 {
            let (buffer, spaces) =
                BounceSpace::allocate(backend.as_ref(), geometry, slot_pages, nslots)?;
            // SAFETY: the buffer is this side's allocation, kept by the peer (`_slot_buffer`)
            // for as long as the registration, which drops first.
            let reg = unsafe {
                self.device
                    .register(&self.agent, buffer.addr(), buffer.len())?
            };
            (Some(buffer), spaces, Some(reg))
        } else {
            (None, Vec::new(), None)
        };
        let (offsets, slot_bytes) = BounceSpace::layout(geometry, slot_pages.max(1))?;
        let slot_bytes = slot_bytes as u64;
        let local_layout = ListLayout::new(
            &components,
            self.pool.pages(),
            slot_pages,
            nslots as u64,
            slot_bytes,
        )?;
        let remote_layout = ListLayout::new(
            &components,
            peer.pages,
            slot_pages,
            nslots as u64,
            slot_bytes,
        )?;
        let pool = &self.pool;
        let device = &self.device;
        let mut bases = Vec::new();
        for comp in &components {
            let bytes = (pool.pages() * comp.block_bytes as u64) as usize;
            let mut layers = Vec::new();
            for &b in pool.layer_bases(comp.component)? {
                layers.push(device.nixl_address(b, bytes)?);
            }
            bases.push(layers);
        }
        let mut slot_bases = Vec::new();
        let mut slot_starts = Vec::new();
        for space in &spaces {
            let mut per = Vec::new();
            for c in 0..components.len() {
                let (addr, len) = space.prefix(c, slot_pages);
                per.push(device.nixl_address(addr, len as usize)?);
            }
            slot_bases.push(per);
            slot_starts.push(device.nixl_address(space.addr(), slot_bytes as usize)?);
        }
        let local = self.agent.prepare(
            None,
            memory,
            local_layout
                .descriptors(
                    &components,
                    |c, l| bases[c][l],
                    |s, c| slot_bases[s][c],
                    |s| slot_starts[s],
                )
                .into_iter(),
        )?;
        let remote_memory = Memory {
            vram: peer.vram,
            device: u64::from(peer.device),
        };
        let remote_list = self.agent.prepare(
            Some(name),
            remote_memory,
            remote_layout
                .descriptors(
                    &components,
                    |c, l| peer.layers[c][l],
                    |s, c| peer.slots[s] + offsets[c] as u64,
                    |s| peer.slots[s],
                )
                .into_iter(),
        )?;
        Ok(Peer {
            agent: name.to_string(),
            remote,
            local,
            remote_list,
            local_layout,
            remote_layout,
            slots: spaces
                .into_iter()
                .map(|space| Slot {
                    space,
                    sending: false,
                    remote_busy: false,
                })
                .collect(),
            gone: None,
            taken: HashSet::new(),
            _slot_registration: registration,
            _slot_buffer: slot_buffer,
        })
    }

    /// Sends a notice to the peer, counting a failure to.
    pub(super) fn notify(&self, notice: &Notice) -> Result<()> {
        let Some(peer) = &self.peer else {
            self.stats.failed_notification();
            return Err(Error::Nixl {
                call: "genNotif",
                reason: "not connected to a decode side".into(),
            });
        };
        let sent = notice
            .encode()
            .and_then(|bytes| self.agent.notify(&peer.agent, &bytes));
        if sent.is_err() {
            self.stats.failed_notification();
        }
        sent
    }

    /// Takes the peer's notifications (slot releases) and releases the requests given up on
    /// that NIXL is done with.
    pub(super) fn progress(&mut self) {
        if let Ok(notes) = self.agent.notifications() {
            for (from, bytes) in notes {
                let Some(peer) = self.peer.as_mut() else {
                    break;
                };
                if from != peer.agent {
                    continue;
                }
                match Notice::decode(&bytes) {
                    Ok(Notice::SlotFree { slot }) => {
                        if let Some(s) = peer.slots.get_mut(slot as usize) {
                            s.remote_busy = false;
                        }
                    }
                    Ok(Notice::Taken { request, chunk }) => {
                        peer.taken.insert((request, chunk));
                    }
                    _ => {}
                }
            }
        }
        let zombies = std::mem::take(&mut self.zombies);
        for (request, slot) in zombies {
            match self.agent.progress(&request) {
                Ok(Progress::Moving) => self.zombies.push((request, slot)),
                // Landed after all: its notice reached the decode, which frees the slot.
                Ok(Progress::Done) => self.release_slot(slot, false),
                Err(_) => self.release_slot(slot, true),
            }
        }
    }

    /// Frees a chunk's slot on this side; `remote` too when the decode will never see it.
    pub(super) fn release_slot(&mut self, slot: Option<usize>, remote: bool) {
        if let (Some(slot), Some(peer)) = (slot, self.peer.as_mut()) {
            if let Some(s) = peer.slots.get_mut(slot) {
                s.sending = false;
                if remote {
                    s.remote_busy = false;
                }
            }
        }
    }
}
