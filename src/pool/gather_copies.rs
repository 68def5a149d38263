//! The device side of a CP prefill batch's gather ([`GatherPlan`], pure CPU math in `shard`):
//! the copy plans that pack a rank's send list out of its pool and land an owner's send buffer
//! in a scratch slot.

use crate::copy::{BlockCopyPlan, BlockSpace, PageSelection, Staging};
use crate::error::{Error, Result};
use crate::index::{LocalPage, ModelLayer};
use crate::pool::DevicePool;
use crate::shard::GatherPlan;

impl GatherPlan {
    /// The pack of `pool`'s rank's send list into its send buffer `send` (staging of at least
    /// [`Self::block`] pages, entry `k` of the list to page `k`), for the model layers `layers`
    /// accepts (every one, or one layer during its forward), latent and indexer, pairs in layer
    /// order so that `BlockCopy::run_layer` packs one layer. A plan of the copy layer: prepare
    /// it once (`BlockCopy::prepare_sync`) and run it per layer or whole.
    pub fn pack_plan(
        &self,
        pool: &DevicePool,
        send: &Staging,
        layers: impl Fn(ModelLayer) -> bool,
    ) -> Result<BlockCopyPlan> {
        self.check_pool(pool)?;
        let list = self.send_list(pool.rank())?;
        if send.pages() < self.block() {
            return Err(Error::InvalidArgument(format!(
                "a send buffer of {} pages for a block of {} pages",
                send.pages(),
                self.block()
            )));
        }
        let entries = list.len();
        Ok(BlockCopyPlan::new(
            pool,
            PageSelection::Local(list),
            send,
            PageSelection::Positions,
            entries,
        )?
        .retain_layers(layers)
        .layer_major())
    }

    /// What an all-gather does with owner `owner`'s send buffer `send`: its [`Self::block`]
    /// pages land on pages `owner * block ..` of a scratch slot `scratch` (staging of at least
    /// [`Self::gathered_pages`] pages, shaped like the pools). Running it for every owner into
    /// every rank's scratch emulates the all-gather with device copies (one process, one GPU).
    pub fn landing_plan(
        &self,
        owner: u32,
        send: &Staging,
        scratch: &Staging,
    ) -> Result<BlockCopyPlan> {
        self.placement().check_rank(owner)?;
        if scratch.pages() < self.gathered_pages() || send.pages() < self.block() {
            return Err(Error::InvalidArgument(format!(
                "a scratch of {} pages and a send buffer of {} pages for {} gathered pages of blocks of {}",
                scratch.pages(),
                send.pages(),
                self.gathered_pages(),
                self.block()
            )));
        }
        let first = u64::from(owner) * self.block();
        let pages = (first..first + self.block()).map(LocalPage).collect();
        Ok(BlockCopyPlan::new(
            send,
            PageSelection::Positions,
            scratch,
            PageSelection::Local(pages),
            // Fits: the pages list above holds `block` entries.
            self.block() as usize,
        )?
        .layer_major())
    }

    fn check_pool(&self, pool: &DevicePool) -> Result<()> {
        if pool.placement() != self.placement() || pool.logical_pages() != self.logical_pages() {
            return Err(Error::InvalidArgument(format!(
                "a pool of {} ranks and {} logical pages for a gather plan of {} ranks and {} logical pages",
                pool.placement().shard(),
                pool.logical_pages(),
                self.placement().shard(),
                self.logical_pages()
            )));
        }
        Ok(())
    }
}
