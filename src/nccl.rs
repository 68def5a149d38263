//! The CP all-gather of prefix pages over NCCL (feature `nccl`): each rank packs its send list
//! (the gather plan's owned local pages, padded with page 0 to `block`) into a contiguous send
//! buffer, and one `ncclAllGather` per (component, stored layer) lands every rank's block in
//! every rank's attention scratch, owner-major, exactly where the plan's page table says.
//!
//! NCCL is loaded at run time (cudarc's dynamic loading): a missing `libnccl.so.2` is
//! [`Error::NoNccl`], never a link error. One communicator per rank, one thread or process per
//! GPU, as NCCL requires; the unique id travels through whatever bootstrap the engine has.

use std::sync::Arc;

use cudarc::nccl::{result, sys};

use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, KernelFamily, Launch};
use crate::copy::{BlockCopy, BlockSpace, Staging};
use crate::error::{Error, Result};
use crate::index::ModelLayer;
use crate::pool::DevicePool;
use crate::shard::GatherPlan;

/// Whether the NCCL library can be loaded.
pub fn nccl_present() -> bool {
    // SAFETY: only probes for the shared library.
    unsafe { sys::is_culib_present() }
}

fn nccl_error(call: &'static str) -> impl Fn(result::NcclError) -> Error {
    move |e| Error::Nccl {
        call,
        reason: format!("{e:?}"),
    }
}

/// The identity of a communicator: rank 0 makes it, every rank joins with it.
#[derive(Clone, Copy)]
pub struct NcclId(sys::ncclUniqueId);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclId(..)")
    }
}

impl NcclId {
    /// A new communicator identity.
    pub fn new() -> Result<Self> {
        if !nccl_present() {
            return Err(Error::NoNccl);
        }
        result::get_uniqueid()
            .map(NcclId)
            .map_err(nccl_error("ncclGetUniqueId"))
    }

    /// Its 128 bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal.map(|b| b as u8)
    }

    /// The identity another rank sent.
    pub fn from_bytes(bytes: [u8; 128]) -> Self {
        NcclId(sys::ncclUniqueId {
            internal: bytes.map(|b| b as ::core::ffi::c_char),
        })
    }
}

/// One rank's NCCL communicator on one GPU.
pub struct NcclGroup {
    comm: sys::ncclComm_t,
    rank: u32,
    size: u32,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; every use here takes `&self` from one owner at a time (no interior sharing).
unsafe impl Send for NcclGroup {}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl NcclGroup {
    /// Joins communicator `id` as `rank` of `size` on `backend`'s GPU (blocks until every rank
    /// has joined).
    pub fn join(backend: &CudaBackend, id: NcclId, rank: u32, size: u32) -> Result<Self> {
        if !nccl_present() {
            return Err(Error::NoNccl);
        }
        if rank >= size {
            return Err(Error::InvalidArgument(format!(
                "NCCL rank {rank} of {size}"
            )));
        }
        let nranks = i32::try_from(size)
            .map_err(|_| Error::InvalidArgument(format!("{size} NCCL ranks")))?;
        backend.gpu().bind()?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the communicator; the id came from ncclGetUniqueId; the
        // context of the rank's GPU is current.
        unsafe { result::comm_init_rank(&mut comm, nranks, id.0, rank as i32) }
            .map_err(nccl_error("ncclCommInitRank"))?;
        Ok(Self { comm, rank, size })
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// Gathers `bytes` bytes from `send` of every rank into `recv` (rank `r`'s at `r * bytes`) on
    /// `backend`'s stream.
    ///
    /// # Safety
    /// `send` must hold `bytes` bytes and `recv` `size * bytes` bytes of `backend`'s device
    /// memory, valid until the collective completes on its stream.
    pub unsafe fn all_gather_raw(
        &self,
        backend: &CudaBackend,
        send: u64,
        recv: u64,
        bytes: usize,
    ) -> Result<()> {
        // SAFETY: the caller's contract; the stream belongs to the communicator's GPU.
        unsafe {
            result::all_gather(
                send as *const _,
                recv as *mut _,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                self.comm,
                backend.stream().raw() as _,
            )
        }
        .map(|_| ())
        .map_err(nccl_error("ncclAllGather"))
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        // SAFETY: the communicator was made by `join` and is destroyed once.
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}

/// One rank's CP gather: the pack of its send list and the all-gather into its scratch.
pub struct CpGather {
    pack: BlockCopy,
    send: Arc<Staging>,
    scratch: Arc<Staging>,
    block: u64,
    gathered: u64,
}

impl std::fmt::Debug for CpGather {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpGather")
            .field("block", &self.block)
            .finish_non_exhaustive()
    }
}

impl CpGather {
    /// Prepares `pool`'s rank's part of `plan`: a send buffer of `block` pages and the pack into
    /// it (uploads tables, waiting for `backend`), gathering into `scratch` (staging shaped like
    /// the pool, at least [`GatherPlan::gathered_pages`] pages: the prefix region).
    pub fn prepare_sync(
        backend: &CudaBackend,
        plan: &GatherPlan,
        pool: Arc<DevicePool>,
        scratch: Arc<Staging>,
    ) -> Result<Self> {
        if scratch.pages() < plan.gathered_pages() {
            return Err(Error::InvalidArgument(format!(
                "a scratch of {} pages for {} gathered pages",
                scratch.pages(),
                plan.gathered_pages()
            )));
        }
        let send = Arc::new(Staging::new(backend, pool.geometry(), plan.block().max(1))?);
        let pack_plan = plan.pack_plan(&pool, &send, |_| true)?;
        let pack = BlockCopy::prepare_sync(backend, pack_plan, pool, send.clone(), None)?;
        Ok(Self {
            pack,
            send,
            scratch,
            block: plan.block(),
            gathered: plan.gathered_pages(),
        })
    }

    /// Bytes one layer's gather lands in every rank's scratch (all components).
    pub fn layer_bytes(&self, layer: ModelLayer) -> u64 {
        self.send
            .components()
            .iter()
            .filter(|c| c.stored_layer(layer).is_some())
            .map(|c| self.gathered * c.block_bytes as u64)
            .sum()
    }

    /// Packs model layer `layer` of this rank's send list and all-gathers it into the scratch
    /// of every rank of `group`, on `backend`'s stream (every rank calls it for the same layer).
    pub fn run_layer(
        &self,
        backend: &CudaBackend,
        group: &NcclGroup,
        layer: ModelLayer,
        ctas: u32,
    ) -> Result<()> {
        if self.block == 0 {
            return Ok(());
        }
        let launch = Launch {
            ctas,
            threads: backend.max_threads(KernelFamily::Copy),
        };
        self.pack.run_layer(backend, layer, launch)?;
        let group_start = || result::group_start().map_err(nccl_error("ncclGroupStart"));
        group_start()?;
        let mut gathered = Ok(());
        for comp in self.send.components() {
            let Some(stored) = comp.stored_layer(layer) else {
                continue;
            };
            let send = self.send.layer(comp.component, stored)?;
            let recv = self.scratch.layer(comp.component, stored)?;
            let bytes = self.block as usize * comp.block_bytes;
            // SAFETY: `send` holds the block's `block` pages of this layer, `recv` (a layer of
            // the scratch) at least `gathered = size * block` pages; both are this rank's
            // device memory, held by `self` until the collective completes (the scratch and
            // the send buffer are `Arc`s kept here).
            gathered = unsafe { group.all_gather_raw(backend, send.addr(), recv.addr(), bytes) };
            if gathered.is_err() {
                break;
            }
        }
        result::group_end().map_err(nccl_error("ncclGroupEnd"))?;
        gathered
    }

    /// The send buffer (what this rank contributes).
    pub fn send_buffer(&self) -> &Arc<Staging> {
        &self.send
    }
}
