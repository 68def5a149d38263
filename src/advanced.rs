//! Pieces of kvshard's own executors, public for the GPU benchmark and the tests that time or
//! check them one by one. An engine needs none of them ([`crate::engine`] has what it does):
//! they are how [`BackendTransport`](crate::transfer::BackendTransport) cuts and launches a
//! chunk, exposed so a benchmark can time the kernel apart from the planning around it.
//!
//! - [`kernel_pieces`]: a chunk's coalesced ranges cut into the pieces one `kvs_copy_ranges`
//!   launch takes (at most [`KERNEL_PIECE_BYTES`] each);
//! - [`block_copies`]: a send plan as the block copies (`kvs_copy_blocks` programs) the default
//!   method runs, one per section, prepared ahead.

pub use crate::transfer::backend_transport::{block_copies, kernel_pieces, KERNEL_PIECE_BYTES};
