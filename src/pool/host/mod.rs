//! One rank's host pool (docs/design.md, "HiCache"): pinned host buffers holding `pages` pages of
//! every component in one of three layouts. The pool is a [`BlockSpace`](crate::copy::BlockSpace), so the block-copy
//! kernel reads and writes it through its device alias with no code of its own; the copy-engine
//! paths use the same address math.
//!
//! # Buffers
//!
//! A pool stores its components in host *buffers* whose arrangement a [`HostFormat`] gives:
//!
//! - [`DraftPacking::Separate`] (kvshard's own, and SGLang's "sidecar" draft): one buffer per
//!   component;
//! - [`DraftPacking::Packed`] (SGLang's default for NextN/MTP drafts): the draft is the tail layer
//!   of the target's buffers, so one latent buffer holds `L = target layers + 1` layers and one
//!   indexer buffer `L = target indexer layers + 1`. The extra layer changes the page and row
//!   strides of `page_first` and `page_first_direct` even for target rows.
//!
//! Indexer buffers may hold more pages than the pool uses ([`HostFormat::indexer_extra_pages`]:
//! SGLang's indexer host pool has one more page than its latent one), which lengthens their
//! `layer_first` layer stride; the pool's usable pages ([`BlockSpace::pages`]) stay the latent's.
//!
//! # Layouts
//!
//! Per buffer with `L` stored layers and `P` pages, blocks of `B` bytes made of `rows` rows of
//! `R` bytes (latent: 64 rows of the latent row; indexer: one 8,448-byte row per block):
//!
//! | layout | shape | layer base | page stride | row stride |
//! |---|---|---|---|---|
//! | [`HostLayout::LayerFirst`] | `[L][P][B]` | `l * P * B` | `B` | `R` |
//! | [`HostLayout::PageFirstDirect`] | `[P][L][B]` | `l * B` | `L * B` | `R` |
//! | [`HostLayout::PageFirst`], latent | `[P * 64][L][R]` | `l * R` | `64 * L * R` | `L * R` |
//! | [`HostLayout::PageFirst`], indexer | `[P][L][B]` | `l * B` | `L * B` | `B` |
//!
//! Every layout takes `P * L * B` bytes per buffer. These are SGLang's host pool shapes
//! (`mem_cache/pool_host/mla.py` and `dsa.py`, sglang 0.5.x) byte for byte. Local page 0 is the
//! padding page, as on the device: a pool has at least two pages.
//!
//! # Memory
//!
//! A pool's buffers are allocated pinned ([`HostPool::new`], [`HostPool::new_with`],
//! [`HostPool::new_numa_local`]), engine memory kvshard registers ([`HostPool::register_with`]),
//! engine memory the engine registered itself ([`HostPool::adopt_registered`]: SGLang registers
//! its host buffers with `cudaHostRegister`), or any memory of a backend's address space
//! ([`HostPool::wrap`]). Device aliases always come from the driver; the host address of each
//! buffer is kept where it is known ([`HostPool::host_ptr`]), for storage backends that read host
//! pages directly ([`HostPool::page_spans`]).

mod backing;
mod format;
mod host_pool;

pub use backing::{HostMemory, HostRegion, NumaPlacement, RegisteredRegion};
pub use format::{DraftPacking, HostBufferLayout, HostFormat, HostLayout, LayoutStrides};
pub use host_pool::HostPool;
