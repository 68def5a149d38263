//! A plan's tables as the kernel reads them, and its launch.

use std::sync::Arc;

use super::super::block_copy::TableStore;
use super::super::space::BlockSpace;
use super::{DecodeScatterPlan, Mode};
use crate::abi;
use crate::backend::{Event, Launch};
use crate::error::{Error, Result};

impl DecodeScatterPlan {
    /// Bytes of the tables the launch uploads.
    pub fn table_bytes(&self) -> usize {
        let ids: usize = self.ranks.iter().map(|r| r.0.len() + r.1.len()).sum();
        16 * self.pairs.len()
            + 8 * self.dst_bases.len()
            + 32 * self.ranks.len()
            + 8 * ids
            + 16 * (self.entries.len() + self.state_entries.len())
            + 8 * self.shifts.len()
    }

    /// The tables at device address `at`, and the launch parameters that point into them:
    /// pairs, destination bases, rank descriptors, each rank's page lists, entries, state
    /// entries, shifts, little-endian as the kernel reads them.
    fn tables(&self, at: u64) -> (Vec<u8>, abi::kvs_decode_scatter_params) {
        let mut out = Vec::with_capacity(self.table_bytes());
        let word = |out: &mut Vec<u8>, w: u64| out.extend_from_slice(&w.to_le_bytes());
        for p in &self.pairs {
            word(&mut out, p.src);
            out.extend_from_slice(&p.component.to_le_bytes());
            out.extend_from_slice(&p.reserved.to_le_bytes());
        }
        let bases_at = out.len() as u64;
        for &b in &self.dst_bases {
            word(&mut out, b);
        }
        let ranks_at = out.len() as u64;
        // The page lists follow the rank descriptors.
        let mut lists_at = ranks_at + 32 * self.ranks.len() as u64;
        for (pages, state_pages, limit) in &self.ranks {
            let state_at = lists_at + 8 * pages.len() as u64;
            word(&mut out, at + lists_at);
            word(
                &mut out,
                if state_pages.is_empty() {
                    0
                } else {
                    at + state_at
                },
            );
            // The two lists have the same length where both are given (checked); an empty one
            // is never read: no row of its section lands on the rank (checked).
            word(&mut out, pages.len().max(state_pages.len()) as u64);
            word(&mut out, *limit);
            lists_at = state_at + 8 * state_pages.len() as u64;
        }
        for (pages, state_pages, _) in &self.ranks {
            for p in pages.iter().chain(state_pages) {
                word(&mut out, p.0);
            }
        }
        let entries_at = out.len() as u64;
        for e in self.entries.iter().chain(&self.state_entries) {
            word(&mut out, e.page as u64);
            word(&mut out, e.position);
        }
        let state_at = entries_at + 16 * self.entries.len() as u64;
        let shifts_at = out.len() as u64;
        for &shift in &self.shifts {
            word(&mut out, shift);
        }
        let mut components = [abi::kvs_row_component::default(); abi::KVS_MAX_COMPONENTS as usize];
        components[..self.components.len()].copy_from_slice(&self.components);
        let params = abi::kvs_decode_scatter_params {
            components,
            pairs: at,
            dst_bases: at + bases_at,
            ranks: at + ranks_at,
            entries: at + entries_at,
            num_entries: self.entries.len() as u64,
            state_entries: at + state_at,
            num_state_entries: self.state_entries.len() as u64,
            shifts: match self.mode {
                Mode::Direct => 0,
                Mode::Pack | Mode::Unpack => at + shifts_at,
            },
            src_limit: self.src_limit,
            end_token: self.end_token,
            num_pairs: self.pairs.len() as u32,
            num_kv_pairs: self.kv_pairs as u32,
            num_ranks: self.layout.ranks(),
            interleave: self.layout.interleave(),
            num_components: self.components.len() as u32,
            mode: self.mode.abi(),
            one_rank: u32::from(self.one_rank.is_some()),
            rank: self.one_rank.unwrap_or(0),
            ..Default::default()
        };
        (out, params)
    }
}

impl TableStore {
    /// Launches `plan` once: its tables uploaded (stream-ordered), then `kvs_decode_scatter`
    /// with grid `launch`. `src` and `dsts` must be the plan's spaces, in the store's address
    /// space; they are kept until the launch has run. Returns the launch's event, as
    /// [`TableStore::launch`] does (`None` when the plan moves nothing).
    pub fn launch_scatter(
        &mut self,
        plan: &DecodeScatterPlan,
        src: &Arc<dyn BlockSpace>,
        dsts: &[Arc<dyn BlockSpace>],
        launch: Launch,
    ) -> Result<Option<Event>> {
        plan.check_spaces(self.backend().as_ref(), src.as_ref(), dsts)?;
        if plan.is_empty() {
            return Ok(None);
        }
        let writes: Vec<&Arc<dyn BlockSpace>> = dsts.iter().collect();
        // Built with the tables, once their address is known; read by the launch after.
        let params = std::cell::Cell::new(None);
        let event = self.launch_built(
            plan.table_bytes(),
            |at| {
                let (bytes, p) = plan.tables(at);
                params.set(Some(p));
                bytes
            },
            &[src],
            &writes,
            |backend, _| {
                let p = params.get().ok_or_else(|| {
                    Error::InvalidArgument("scatter tables were not built".into())
                })?;
                // SAFETY: the pairs' bases are layers of the plan's spaces (checked to be these
                // and in the backend's address space), kept alive until the launch has run by
                // the store and their usages, which also order it after other streams' work on
                // them; every source page, rank page and the rows the tokens below the end
                // land on were checked against those spaces when the plan was built, and the
                // kernel re-checks them against the same limits; the tables are the store's
                // own device memory, just written in stream order, holding every pair, base,
                // rank, page and entry the parameters name.
                unsafe { backend.decode_scatter(p, launch) }
            },
        )?;
        Ok(Some(event))
    }
}
