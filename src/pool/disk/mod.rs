//! The storage tier below host memory (L3, feature `nixl`; docs/storage.md): a
//! CP group's pages on disk, written by their owners, readable by every rank, crash-safe, moved
//! by NIXL's POSIX backend.
//!
//! ```text
//! dir/ (one per CP group)     w0000.slots   preallocated, O_DIRECT: slots of slot_bytes
//!                             w0000.journal header, then Commit / Free records (96 B each)
//!                             w0000.lock    the writer's flock and process id
//!                             w0001.slots   ... one set per writer rank
//! ```
//!
//! - **The directory** is handled like a database's (`dir.rs`): every file opened beneath it
//!   without following a link, nothing in it that another user could write, one writer per
//!   rank ([`StorageFailure::Untrusted`](crate::error::StorageFailure::Untrusted),
//!   [`StorageFailure::Locked`](crate::error::StorageFailure::Locked)).
//!
//! - **Slots** hold a whole page: every component (target latent of every layer, target
//!   indexer keys and scales, draft latent and indexer), in one canonical order whatever the
//!   host pool's layout, padded to the directory's direct-I/O alignment (`statx`
//!   `STATX_DIOALIGN`, 4 KiB by default). Pages move host pool <-> aligned staging memory
//!   (a copy, which also computes the checksum) <-> file; adjacent slots of a batch are one
//!   descriptor (up to [`DiskConfig::max_io_bytes`]). The copy is what lets every host layout
//!   meet O_DIRECT's alignment: an indexer block is 8,448 B, not a multiple of 4 KiB.
//! - **Presence.** A page is present only once its `Commit` record (key, slot, CRC-32C of key
//!   and page) is in its writer's journal, appended after the slot's data was made durable
//!   (`fdatasync`). A process killed mid-write leaves a slot no record names, or a torn record
//!   that fails its own checksum: after reopening, the page is a miss. A slot whose bytes no
//!   longer match its checksum (flipped bits, or reused since a lookup) is a miss on load,
//!   counted in [`DiskStats::corrupt_pages`]. Only what follows a journal's last valid record
//!   is a torn tail: a damaged record with valid ones after it is skipped and counted
//!   ([`DiskStats::damaged_records`]) or refused ([`Damaged`]), never a reason to cut.
//! - **Ordering.** Stores and loads touch host pages with the CPU, so they first wait for the
//!   work queued on the pages they name (`order.rs`): a store for their writes, a load for
//!   their reads and writes.
//! - **Sharing.** Each rank writes only its own file and journal, and only the pages it owns
//!   (each page written once, by its owner); any rank reads any rank's file. Each rank replays
//!   every journal into its index. A [`Snapshot`] (per writer, a count of records) taken by one
//!   rank and used by all makes lookups agree: presence as of a snapshot depends on nothing
//!   else ([`DiskStore::lookup`]).
//! - **Compaction.** Past [`DiskConfig::journal_records`] records a store rewrites its rank's
//!   journal from the live index, positions unchanged, crash-safe (write beside, sync, rename).
//! - **Read-only ranks** ([`DiskConfig::read_only`]) open every file without write access and
//!   create none: they replay every writer's journal, look up and load; a store is a
//!   [`StorageFailure::ReadOnly`](crate::error::StorageFailure::ReadOnly) error.
//! - **Capacity.** Each rank's file has [`DiskConfig::slots`] slots; when full, the least
//!   recently used (by this rank's stores, lookups and loads) is reclaimed, its `Free` record
//!   durable before the slot is rewritten.
//! - **Failures** are typed ([`Error::Storage`](crate::Error::Storage) with a
//!   [`StorageFailure`](crate::error::StorageFailure)): disk full, a file or directory that
//!   cannot be opened, a NIXL registration refused; the host and device pools are untouched.

mod dir;
pub mod gds;
mod io;
mod journal;
mod key_index;
mod order;
mod slots;
mod store;
mod types;

pub use io::{IoQueue, QueueChoice};
pub use store::DiskStore;
pub use types::{
    check_timeout, Damaged, DiskConfig, DiskStats, LoadOutcome, Snapshot, StoreReport,
    MAX_STAGING_BYTES, MAX_TIMEOUT, MAX_WRITERS,
};
